//! The host end of the VM's RoCEv2 link, for an initiator on the software
//! HCA: the frame socket ([`LinkWire`]), connection-manager timing a TCG
//! guest can keep up with ([`tcg_cm_config`]) and SRP timeouts for it
//! ([`tcg_srp_config`]), and what the initiator is
//! told of the VM's targets: the SRP `add_target` string for `ib_srpt`
//! ([`srpt_add_target`]) and the iSER node record for LIO
//! ([`isert_node_record`]).

use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hca_lowlevel::sim::FrameSocket;
use kverbs::cm::CmConfig;
use kverbs::wire::IbTimeout;
use storport_srp::srp::SrpConfig;
use storport_srp::srp::params::Timeouts;

use super::{TargetInfo, VmError};

/// The host end of the VM's Ethernet link: the unix datagram socket, with
/// frame counters and a switch that drops every frame both ways.
pub struct LinkWire {
    sock: UnixDatagram,
    blackhole: AtomicBool,
    /// Frames sent to the VM.
    pub sent: AtomicU64,
    /// Frames received from the VM.
    pub received: AtomicU64,
    /// Frames dropped by the blackhole (both ways).
    pub dropped: AtomicU64,
}

impl LinkWire {
    /// Wraps the VM's link socket ([`super::Vm::take_link`]).
    #[must_use]
    pub fn new(sock: UnixDatagram) -> Self {
        LinkWire {
            sock,
            blackhole: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// Drops every frame both ways while `on` (a cable pulled).
    pub fn set_blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
    }
}

impl FrameSocket for LinkWire {
    fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        if self.blackhole.load(Ordering::SeqCst) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.sent.fetch_add(1, Ordering::Relaxed);
        FrameSocket::send(&self.sock, frame)
    }

    fn recv(&self, buf: &mut [u8], wait: Duration) -> std::io::Result<Option<usize>> {
        let Some(n) = FrameSocket::recv(&self.sock, buf, wait)? else {
            return Ok(None);
        };
        if self.blackhole.load(Ordering::SeqCst) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        self.received.fetch_add(1, Ordering::Relaxed);
        Ok(Some(n))
    }
}

/// CM and RC timing for a TCG guest: a packet lifetime of 2^17 × 4.096 µs
/// (an RC ACK timeout near 1 s) and a CM response timeout of 2^20 ×
/// 4.096 µs (about 4 s): an emulated kernel under load answers slowly,
/// and a retry storm would only slow it down more.
#[must_use]
pub fn tcg_cm_config() -> CmConfig {
    let t = |v| IbTimeout::new(v).unwrap_or(IbTimeout::from_low_bits(v));
    CmConfig {
        packet_lifetime: t(17),
        cm_response_timeout: t(20),
        max_cm_retries: 5,
        timewait: t(14),
        connections: 64,
        listeners: 1,
        ..CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0)
    }
}

/// The SRP engine's settings for a TCG guest, which is slow: a reconnect
/// delay of 1 s, fast-fail after 10 s, the device lost after 120 s, and
/// 20 s for a task management function.
#[must_use]
pub fn tcg_srp_config() -> SrpConfig {
    SrpConfig {
        timeouts: Timeouts::new(
            Some(Duration::from_secs(1)),
            Some(Duration::from_secs(10)),
            Some(Duration::from_secs(120)),
        )
        .unwrap_or_default(),
        tmf_timeout: Duration::from_secs(20),
        ..SrpConfig::default()
    }
}

/// The `add_target` string for the VM's `ib_srpt`: RDMA/CM form, the
/// target port id being the service GUID (the node GUID) twice, then
/// `keys` (comma-separated, e.g. `queue_size=64,max_sect=2048`).
///
/// # Errors
/// [`VmError::Config`] when the VM runs no SRP target or reports a target
/// port id that is not one GUID twice.
pub fn srpt_add_target(info: &TargetInfo, keys: &str) -> Result<String, VmError> {
    let srpt = info
        .srpt
        .as_ref()
        .ok_or_else(|| VmError::Config("the VM runs no SRP target".into()))?;
    let tpid = srpt.target_port_id.trim_start_matches("0x");
    let (high, low) = tpid.split_at_checked(16).unwrap_or(("", ""));
    if tpid.len() != 32 || high != low {
        return Err(VmError::Config(format!(
            "ib_srpt's target_port_id {:?} is not a GUID twice",
            srpt.target_port_id
        )));
    }
    let mut s = format!(
        "id_ext={high},ioc_guid={high},dest={}:{}",
        info.vm_ip, srpt.rdma_cm_port
    );
    let keys = keys.trim().trim_matches(',');
    if !keys.is_empty() {
        s.push(',');
        s.push_str(keys);
    }
    Ok(s)
}

/// The iSER node record (the `iscsiadm` form the driver parses) for the
/// VM's LIO iSCSI target: its IQN and iSER portal, `initiator` as our
/// name, a short reconnect delay, then `keys` (extra `key = value` lines).
///
/// # Errors
/// [`VmError::Config`] when the VM runs no iSER target.
pub fn isert_node_record(
    info: &TargetInfo,
    initiator: &str,
    keys: &str,
) -> Result<String, VmError> {
    let iser = info
        .iser
        .as_ref()
        .ok_or_else(|| VmError::Config("the VM runs no iSER target".into()))?;
    let mut r = format!(
        "node.name = {}\nnode.conn[0].address = {}\nnode.conn[0].port = {}\n\
         iface.initiatorname = {initiator}\nnode.session.timeo.reconnect_delay = 1\n",
        iser.target_iqn, iser.portal_ip, iser.portal_port
    );
    for line in keys.lines().map(str::trim).filter(|l| !l.is_empty()) {
        r.push_str(line);
        r.push('\n');
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::vm::{IserInfo, SrptInfo};

    fn info() -> TargetInfo {
        TargetInfo {
            instance: "t".into(),
            kernel_package: String::new(),
            kernel_release: String::new(),
            vm_mac: crate::vm::ethernet::MacAddr([0x52, 0x54, 0, 0x12, 0x34, 0x56]),
            vm_ip: Ipv4Addr::new(10, 0, 0, 2),
            host_mac: crate::vm::ethernet::MacAddr([0x52, 0x54, 0, 0x12, 0x34, 1]),
            host_ip: Ipv4Addr::new(10, 0, 0, 1),
            prefix_len: 24,
            node_guid: "5054:00ff:fe12:3456".into(),
            gid0: "fe80:0000:0000:0000:5054:00ff:fe12:3456".into(),
            ipv4_gid_index: 1,
            srpt: Some(SrptInfo {
                wwn: "5054:00ff:fe12:3456".into(),
                srp_max_req_size: 8276,
                rdma_cm_port: 5555,
                service_id: 0x0106_15b3,
                target_port_id: "0x505400fffe123456505400fffe123456".into(),
                acls: vec!["10.0.0.2".into()],
            }),
            iser: Some(IserInfo {
                target_iqn: "iqn.2003-01.org.linux-iscsi.kverbs:target".into(),
                portal_ip: Ipv4Addr::new(10, 0, 0, 2),
                portal_port: 3260,
                service_id: 0x0106_0cbc,
                demo_mode: true,
                acls: Vec::new(),
            }),
            luns: Vec::new(),
            boot_secs: 0.0,
        }
    }

    #[test]
    fn the_srpt_add_target_names_the_guid_and_the_portal() {
        let s = srpt_add_target(&info(), "queue_size=64,").unwrap();
        assert_eq!(
            s,
            "id_ext=505400fffe123456,ioc_guid=505400fffe123456,dest=10.0.0.2:5555,queue_size=64"
        );
        let mut odd = info();
        if let Some(srpt) = odd.srpt.as_mut() {
            srpt.target_port_id = "0x505400fffe123456505400fffe123457".into();
        }
        assert!(matches!(srpt_add_target(&odd, ""), Err(VmError::Config(_))));
        odd.srpt = None;
        assert!(matches!(srpt_add_target(&odd, ""), Err(VmError::Config(_))));
    }

    #[test]
    fn the_isert_node_record_names_the_portal_and_appends_the_keys() {
        let r = isert_node_record(&info(), "iqn.x:me", " a = 1 \n\nb = 2").unwrap();
        assert_eq!(
            r,
            "node.name = iqn.2003-01.org.linux-iscsi.kverbs:target\n\
             node.conn[0].address = 10.0.0.2\nnode.conn[0].port = 3260\n\
             iface.initiatorname = iqn.x:me\nnode.session.timeo.reconnect_delay = 1\na = 1\nb = 2\n"
        );
        let mut none = info();
        none.iser = None;
        assert!(isert_node_record(&none, "iqn.x:me", "").is_err());
    }
}
