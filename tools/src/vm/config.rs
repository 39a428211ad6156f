//! What the VM and its targets look like.
//!
//! One serde struct with defaults that boot as they are (`kv-vm config`
//! prints them as TOML); a file can override any part of it and command-line
//! flags override the file. Every value ends up in a shell script inside the
//! guest, so [`VmConfig::validate`] admits only values whose characters are
//! safe there and whose ranges the kernel accepts; the guest script still
//! quotes everything.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::VmError;
use super::ethernet::MacAddr;

/// The whole description of one VM instance and the targets it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VmConfig {
    /// Instance name; its run files live in `<workdir>/run/<instance>/`, so
    /// several VMs can run side by side.
    pub instance: String,
    /// Debian kernel image package to boot (for example
    /// `linux-image-6.1.0-56-amd64`); unset means the one that
    /// `linux-image-amd64` currently depends on.
    pub kernel_package: Option<String>,
    /// The virtual machine itself.
    pub machine: MachineConfig,
    /// Addresses on the one link between host and VM.
    pub network: NetworkConfig,
    /// The LUNs, in order: LUN `i` is exported as `lun_i` by both targets.
    pub luns: Vec<LunConfig>,
    /// The SRP target (`ib_srpt`).
    pub srpt: SrptConfig,
    /// The iSER target (LIO iSCSI with `ib_isert`).
    pub iser: IserConfig,
}

/// How qemu runs the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MachineConfig {
    /// Guest memory; the RAM-backed LUNs live in it.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
    /// Accelerator: TCG works everywhere; KVM only with real VT-x/AMD-V.
    pub accel: Accel,
    /// Longest wait from qemu start to the ready marker.
    pub ready_timeout_secs: u64,
    /// Kernel console log level once the targets are up (7 shows target
    /// info messages such as rejected logins in the console log).
    pub console_loglevel: u8,
    /// On a failed setup step leave the guest running (with a shell on the
    /// console) instead of powering it off; for debugging with `kv-vm console`.
    pub keep_on_failure: bool,
}

/// qemu accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Pure emulation (multi-threaded TCG).
    Tcg,
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
}

/// The link between the host socket and the guest's `eth0`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// MAC of the guest NIC; rxe derives its node GUID from it.
    pub vm_mac: MacAddr,
    /// MAC the host end uses (only for the optional static neighbour entry
    /// and for callers that need a default).
    pub host_mac: MacAddr,
    /// Guest IPv4 address on `eth0`.
    pub vm_ip: Ipv4Addr,
    /// Host IPv4 address (the initiator's), in the same subnet.
    pub host_ip: Ipv4Addr,
    /// Subnet prefix length.
    pub prefix_len: u8,
    /// Add a permanent neighbour entry host_ip -> host_mac in the guest, so
    /// the guest never needs an ARP answer from the host. Off by default: a
    /// real initiator link must answer ARP.
    pub static_host_neighbor: bool,
}

/// One LUN and the LIO backstore behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LunConfig {
    /// Which backstore holds the data.
    pub backstore: Backstore,
    /// Capacity.
    pub size_mib: u32,
    /// Logical block size reported to initiators.
    pub block_size: u32,
}

/// LIO backstore kinds the harness sets up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Backstore {
    /// `rd_mcp`: RAM pages allocated when the device is enabled.
    RdMcp,
    /// `fileio`: a sparse file on the guest's tmpfs.
    Fileio,
}

impl Backstore {
    /// The LIO HBA type name (`core/<name>_<n>/`).
    pub fn lio_name(self) -> &'static str {
        match self {
            Backstore::RdMcp => "rd_mcp",
            Backstore::Fileio => "fileio",
        }
    }
}

/// Which of its two configfs names ib_srpt's target port is created under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SrptWwnForm {
    /// `5054:00ff:fe12:3456` (the port GUID). In Linux 6.1 an RDMA/CM login
    /// on this name is matched against an ACL named after the *target's* own
    /// IP address (the session is named from the passive side's source
    /// address), so the default ACL is the VM's IP.
    Guid,
    /// `0xfe80000000000000505400fffe123456` (GID 0). Logins are matched
    /// against an ACL named `0x` + the initiator port id from the login
    /// request (32 hex digits).
    Gid,
}

/// ib_srpt settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SrptConfig {
    /// Set the SRP target up at all.
    pub enabled: bool,
    /// RDMA/CM listen port (configfs `srpt/discovery_auth/rdma_cm_port`;
    /// it is not a module parameter in 6.1). The CM service id is
    /// `0x0106_0000 | port`.
    pub rdma_cm_port: u16,
    /// Module parameter `srp_max_req_size` (unset: the module's default,
    /// 8276 in 6.1).
    pub srp_max_req_size: Option<u32>,
    /// Module parameter `srpt_srq_size` (unset: the module's 4095); it only
    /// matters with the TPG attribute `use_srq` = 1 (see `attributes`).
    pub srpt_srq_size: Option<u32>,
    /// Configfs name of the target port.
    pub wwn: SrptWwnForm,
    /// Node ACL names, each mapped to every LUN. Unset: the VM's IP for the
    /// GUID form (see [`SrptWwnForm::Guid`]); the GID form needs them named.
    pub acls: Option<Vec<String>>,
    /// Extra TPG attributes written to `tpgt_1/attrib/<name>` before enable
    /// (for example `srp_sq_size`, `srp_max_rsp_size`, `use_srq`).
    pub attributes: BTreeMap<String, String>,
}

/// LIO iSCSI target with the iSER network portal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IserConfig {
    /// Set the iSCSI/iSER target up at all.
    pub enabled: bool,
    /// Target IQN.
    pub target_iqn: String,
    /// Portal IP; unset means the VM's IP.
    pub portal_ip: Option<Ipv4Addr>,
    /// Portal port (RDMA/CM service id `0x0106_0000 | port`).
    pub portal_port: u16,
    /// Demo mode: any initiator may log in and sees every LUN
    /// (`generate_node_acls=1`, no authentication, writable).
    pub demo_mode: bool,
    /// Initiator IQNs that get explicit node ACLs mapping every LUN.
    pub acls: Vec<String>,
    /// Extra TPG attributes (`tpgt_1/attrib/<name>`).
    pub attributes: BTreeMap<String, String>,
    /// iSCSI login parameters (`tpgt_1/param/<name>`, for example
    /// `MaxRecvDataSegmentLength`, `ImmediateData`, `InitialR2T`).
    pub parameters: BTreeMap<String, String>,
    /// Module parameter `sg_tablesize` of ib_isert (unset: 128).
    pub sg_tablesize: Option<u32>,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            instance: "default".to_owned(),
            kernel_package: None,
            machine: MachineConfig::default(),
            network: NetworkConfig::default(),
            luns: vec![
                LunConfig::default(),
                LunConfig {
                    backstore: Backstore::Fileio,
                    ..LunConfig::default()
                },
            ],
            srpt: SrptConfig::default(),
            iser: IserConfig::default(),
        }
    }
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig {
            memory_mib: 512,
            cpus: 2,
            accel: Accel::Tcg,
            ready_timeout_secs: 180,
            console_loglevel: 7,
            keep_on_failure: false,
        }
    }
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            vm_mac: MacAddr([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]),
            host_mac: MacAddr([0x52, 0x54, 0x00, 0x12, 0x34, 0x01]),
            vm_ip: Ipv4Addr::new(10, 0, 0, 2),
            host_ip: Ipv4Addr::new(10, 0, 0, 1),
            prefix_len: 24,
            static_host_neighbor: false,
        }
    }
}

impl Default for LunConfig {
    fn default() -> Self {
        LunConfig {
            backstore: Backstore::RdMcp,
            size_mib: 32,
            block_size: 512,
        }
    }
}

impl Default for SrptConfig {
    fn default() -> Self {
        SrptConfig {
            enabled: true,
            rdma_cm_port: 5555,
            srp_max_req_size: None,
            srpt_srq_size: None,
            wwn: SrptWwnForm::Guid,
            acls: None,
            attributes: BTreeMap::new(),
        }
    }
}

impl Default for IserConfig {
    fn default() -> Self {
        IserConfig {
            enabled: true,
            target_iqn: "iqn.2003-01.org.linux-iscsi.kverbs:target".to_owned(),
            portal_ip: None,
            portal_port: 3260,
            demo_mode: true,
            acls: Vec::new(),
            attributes: BTreeMap::new(),
            parameters: BTreeMap::new(),
            sg_tablesize: None,
        }
    }
}

/// Guest memory the kernel, modules and tools need besides the RAM LUNs.
const GUEST_BASE_MEMORY_MIB: u32 = 192;
/// Most LUNs one configuration may ask for.
pub const MAX_LUNS: usize = 16;

impl VmConfig {
    /// Reads a TOML file; missing fields take their defaults.
    pub fn from_file(path: &Path) -> Result<Self, VmError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| VmError::io(format!("reading config {}", path.display()), e))?;
        toml::from_str(&text)
            .map_err(|e| VmError::Config(format!("{}: {}", path.display(), e.message())))
    }

    /// The configuration as TOML (what `kv-vm config` prints).
    pub fn to_toml(&self) -> String {
        // A plain struct of strings, numbers, maps and lists always serialises.
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot serialise: {e}\n"))
    }

    /// The srpt ACL names in effect (see [`SrptConfig::acls`]).
    pub fn srpt_acls(&self) -> Vec<String> {
        match (&self.srpt.acls, self.srpt.wwn) {
            (Some(acls), _) => acls.clone(),
            (None, SrptWwnForm::Guid) => vec![self.network.vm_ip.to_string()],
            (None, SrptWwnForm::Gid) => Vec::new(),
        }
    }

    /// The iSER portal address in effect.
    pub fn iser_portal_ip(&self) -> Ipv4Addr {
        self.iser.portal_ip.unwrap_or(self.network.vm_ip)
    }

    /// Checks every value for range and for characters that are safe in the
    /// guest's shell and in configfs names. Errors name the offending field.
    pub fn validate(&self) -> Result<(), VmError> {
        let err = |msg: String| Err(VmError::Config(msg));
        if !is_name(&self.instance, 32) {
            return err(format!(
                "instance {:?}: use 1-32 letters, digits, '-' or '_'",
                self.instance
            ));
        }
        if let Some(pkg) = &self.kernel_package {
            if !pkg.starts_with("linux-image-")
                || !pkg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            {
                return err(format!(
                    "kernel_package {pkg:?}: expected a Debian linux-image-* package name"
                ));
            }
        }
        let m = &self.machine;
        if !(1..=16).contains(&m.cpus) {
            return err(format!("machine.cpus {}: must be 1..=16", m.cpus));
        }
        if m.ready_timeout_secs == 0 || m.ready_timeout_secs > 3600 {
            return err(format!(
                "machine.ready_timeout_secs {}: must be 1..=3600",
                m.ready_timeout_secs
            ));
        }
        if m.console_loglevel > 8 {
            return err(format!(
                "machine.console_loglevel {}: must be 0..=8",
                m.console_loglevel
            ));
        }
        let n = &self.network;
        if !n.vm_mac.is_unicast() || n.vm_mac.0 == [0; 6] {
            return err(format!(
                "network.vm_mac {}: must be a non-zero unicast MAC",
                n.vm_mac
            ));
        }
        if !n.host_mac.is_unicast() || n.host_mac.0 == [0; 6] || n.host_mac == n.vm_mac {
            return err(format!(
                "network.host_mac {}: must be a non-zero unicast MAC other than vm_mac",
                n.host_mac
            ));
        }
        if !(8..=30).contains(&n.prefix_len) {
            return err(format!(
                "network.prefix_len {}: must be 8..=30",
                n.prefix_len
            ));
        }
        let mask = u32::MAX << (32 - u32::from(n.prefix_len));
        let (vm, host) = (u32::from(n.vm_ip), u32::from(n.host_ip));
        for (name, ip, raw) in [("vm_ip", n.vm_ip, vm), ("host_ip", n.host_ip, host)] {
            let host_part = raw & !mask;
            if ip.is_unspecified()
                || ip.is_loopback()
                || ip.is_multicast()
                || ip.is_broadcast()
                || host_part == 0
                || host_part == !mask
            {
                return err(format!(
                    "network.{name} {ip}: not a usable host address in a /{}",
                    n.prefix_len
                ));
            }
        }
        if vm == host || vm & mask != host & mask {
            return err(format!(
                "network: vm_ip {} and host_ip {} must differ and share the /{} subnet",
                n.vm_ip, n.host_ip, n.prefix_len
            ));
        }
        if self.luns.is_empty() || self.luns.len() > MAX_LUNS {
            return err(format!(
                "luns: {} given, 1..={MAX_LUNS} allowed",
                self.luns.len()
            ));
        }
        let mut ram_mib = 0u64;
        for (i, lun) in self.luns.iter().enumerate() {
            if lun.size_mib == 0 || lun.size_mib > 65536 {
                return err(format!(
                    "luns[{i}].size_mib {}: must be 1..=65536",
                    lun.size_mib
                ));
            }
            if ![512, 1024, 2048, 4096].contains(&lun.block_size) {
                return err(format!(
                    "luns[{i}].block_size {}: must be 512, 1024, 2048 or 4096",
                    lun.block_size
                ));
            }
            // Both kinds end up in guest RAM (fileio lives on tmpfs).
            ram_mib += u64::from(lun.size_mib);
        }
        if ram_mib + u64::from(GUEST_BASE_MEMORY_MIB) > u64::from(m.memory_mib) {
            return err(format!(
                "machine.memory_mib {}: the LUNs need {ram_mib} MiB of guest RAM plus {GUEST_BASE_MEMORY_MIB} MiB for the system",
                m.memory_mib
            ));
        }
        if m.memory_mib > 16384 {
            return err(format!(
                "machine.memory_mib {}: at most 16384",
                m.memory_mib
            ));
        }
        let s = &self.srpt;
        if s.enabled {
            if s.rdma_cm_port == 0 {
                return err("srpt.rdma_cm_port: must not be 0".to_owned());
            }
            if let Some(v) = s.srp_max_req_size {
                if !(64..=65536).contains(&v) {
                    return err(format!("srpt.srp_max_req_size {v}: must be 64..=65536"));
                }
            }
            if let Some(v) = s.srpt_srq_size {
                if !(1..=65536).contains(&v) {
                    return err(format!("srpt.srpt_srq_size {v}: must be 1..=65536"));
                }
            }
            let acls = self.srpt_acls();
            if acls.is_empty() {
                return err(
                    "srpt.acls: ib_srpt has no demo mode, name at least one ACL (with wwn = \"gid\": \"0x\" + the 32 hex digits of the initiator port id)"
                        .to_owned(),
                );
            }
            for acl in &acls {
                if !is_acl_name(acl) {
                    return err(format!("srpt.acls: {acl:?} is not a valid ACL name"));
                }
            }
            check_attributes("srpt.attributes", &s.attributes)?;
        }
        let i = &self.iser;
        if i.enabled {
            if !is_iqn(&i.target_iqn) {
                return err(format!(
                    "iser.target_iqn {:?}: expected iqn.YYYY-MM.reverse.domain[:name]",
                    i.target_iqn
                ));
            }
            if i.portal_port == 0 {
                return err("iser.portal_port: must not be 0".to_owned());
            }
            if !i.demo_mode && i.acls.is_empty() {
                return err(
                    "iser: without demo_mode at least one initiator IQN in iser.acls is needed"
                        .to_owned(),
                );
            }
            for acl in &i.acls {
                if !is_iqn(acl) {
                    return err(format!("iser.acls: {acl:?} is not an IQN"));
                }
            }
            check_attributes("iser.attributes", &i.attributes)?;
            check_attributes("iser.parameters", &i.parameters)?;
            if let Some(v) = i.sg_tablesize {
                if !(128..=4096).contains(&v) {
                    return err(format!("iser.sg_tablesize {v}: must be 128..=4096"));
                }
            }
        }
        if !s.enabled && !i.enabled {
            return err("srpt and iser are both disabled: nothing to serve".to_owned());
        }
        Ok(())
    }

    /// The RoCE v2 GID that rxe gives the VM's IPv4 address, in sysfs form
    /// (`0000:0000:0000:0000:0000:ffff:0a00:0002`).
    pub fn vm_ipv4_gid_sysfs(&self) -> String {
        let o = self.network.vm_ip.octets();
        format!(
            "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}",
            o[0], o[1], o[2], o[3]
        )
    }

    /// The guest-side configuration: `/etc/kvvm/config.sh`, sourced by the
    /// guest's init. Call [`VmConfig::validate`] first.
    pub fn render_guest_config(&self) -> String {
        let mut vars: Vec<(&str, String)> = Vec::new();
        let n = &self.network;
        let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
        vars.push(("KV_VM_IP", n.vm_ip.to_string()));
        vars.push(("KV_PREFIX", n.prefix_len.to_string()));
        vars.push(("KV_HOST_IP", n.host_ip.to_string()));
        vars.push(("KV_HOST_MAC", n.host_mac.to_string()));
        vars.push(("KV_STATIC_NEIGH", flag(n.static_host_neighbor)));
        vars.push(("KV_IPV4_GID", self.vm_ipv4_gid_sysfs()));
        vars.push(("KV_LOGLEVEL", self.machine.console_loglevel.to_string()));
        vars.push(("KV_KEEP_ON_FAILURE", flag(self.machine.keep_on_failure)));
        let luns: Vec<String> = self
            .luns
            .iter()
            .map(|l| {
                format!(
                    "{}:{}:{}",
                    l.backstore.lio_name(),
                    u64::from(l.size_mib) << 20,
                    l.block_size
                )
            })
            .collect();
        vars.push(("KV_LUNS", luns.join(" ")));
        let s = &self.srpt;
        vars.push(("KV_SRPT", flag(s.enabled)));
        vars.push(("KV_SRPT_PORT", s.rdma_cm_port.to_string()));
        let mut srpt_params = Vec::new();
        if let Some(v) = s.srp_max_req_size {
            srpt_params.push(format!("srp_max_req_size={v}"));
        }
        if let Some(v) = s.srpt_srq_size {
            srpt_params.push(format!("srpt_srq_size={v}"));
        }
        vars.push(("KV_SRPT_MODPARAMS", srpt_params.join(" ")));
        vars.push((
            "KV_SRPT_WWN_FORM",
            match s.wwn {
                SrptWwnForm::Guid => "guid",
                SrptWwnForm::Gid => "gid",
            }
            .to_owned(),
        ));
        vars.push(("KV_SRPT_ACLS", self.srpt_acls().join(" ")));
        vars.push(("KV_SRPT_ATTRIBS", join_map(&s.attributes)));
        let i = &self.iser;
        vars.push(("KV_ISER", flag(i.enabled)));
        vars.push(("KV_ISER_IQN", i.target_iqn.clone()));
        vars.push((
            "KV_ISER_PORTAL",
            format!("{}:{}", self.iser_portal_ip(), i.portal_port),
        ));
        vars.push(("KV_ISER_DEMO", flag(i.demo_mode)));
        vars.push(("KV_ISER_ACLS", i.acls.join(" ")));
        vars.push(("KV_ISER_ATTRIBS", join_map(&i.attributes)));
        vars.push(("KV_ISER_PARAMS", join_map(&i.parameters)));
        vars.push((
            "KV_ISERT_MODPARAMS",
            i.sg_tablesize
                .map(|v| format!("sg_tablesize={v}"))
                .unwrap_or_default(),
        ));
        let mut out =
            String::from("# Generated by kv-vm from the VM configuration; sourced by /init.\n");
        for (name, value) in vars {
            let _ = writeln!(out, "{name}={}", shell_quote(&value));
        }
        out
    }
}

/// Single-quotes `value` for a POSIX shell.
pub(crate) fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

fn join_map(map: &BTreeMap<String, String>) -> String {
    map.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn is_acl_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 223
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || ".:-_".contains(c))
}

/// An iSCSI qualified name as LIO accepts it (lower-case, `iqn.` prefix).
fn is_iqn(s: &str) -> bool {
    s.len() <= 223
        && s.len() > "iqn.yyyy-mm.x".len()
        && s.starts_with("iqn.")
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || ".:-".contains(c))
}

fn check_attributes(field: &str, map: &BTreeMap<String, String>) -> Result<(), VmError> {
    for (name, value) in map {
        if !is_name(name, 64) {
            return Err(VmError::Config(format!(
                "{field}: attribute name {name:?} is not [A-Za-z0-9_-]+"
            )));
        }
        if value.is_empty()
            || value.len() > 128
            || !value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ",._:+-".contains(c))
        {
            return Err(VmError::Config(format!(
                "{field}.{name}: value {value:?} must be 1-128 characters of [A-Za-z0-9,._:+-]"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect_config_error(cfg: &VmConfig, needle: &str) {
        match cfg.validate() {
            Err(VmError::Config(msg)) => {
                assert!(msg.contains(needle), "error {msg:?} lacks {needle:?}")
            }
            other => panic!("expected a config error mentioning {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_round_trip_through_toml() {
        let cfg = VmConfig::default();
        cfg.validate().unwrap();
        let text = cfg.to_toml();
        let back: VmConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn partial_file_overrides_only_what_it_names() {
        let cfg: VmConfig = toml::from_str(
            r#"
            instance = "t1"
            [machine]
            memory_mib = 1024
            [[luns]]
            backstore = "fileio"
            size_mib = 64
            block_size = 4096
            [srpt]
            rdma_cm_port = 6000
            srp_max_req_size = 4200
            [iser.parameters]
            MaxRecvDataSegmentLength = "262144"
            "#,
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.machine.memory_mib, 1024);
        assert_eq!(cfg.machine.cpus, 2);
        assert_eq!(
            cfg.luns,
            vec![LunConfig {
                backstore: Backstore::Fileio,
                size_mib: 64,
                block_size: 4096
            }]
        );
        assert_eq!(cfg.srpt.rdma_cm_port, 6000);
        assert_eq!(cfg.network, NetworkConfig::default());
        assert!(
            toml::from_str::<VmConfig>("[machine]\nmemroy_mib = 1\n").is_err(),
            "typo accepted"
        );
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut c = VmConfig {
            instance: "a b".into(),
            ..VmConfig::default()
        };
        expect_config_error(&c, "instance");
        c = VmConfig::default();
        c.network.host_ip = Ipv4Addr::new(10, 0, 1, 1);
        expect_config_error(&c, "share the /24");
        c = VmConfig::default();
        c.network.vm_ip = Ipv4Addr::new(10, 0, 0, 255);
        expect_config_error(&c, "network.vm_ip");
        c = VmConfig::default();
        c.network.host_mac = c.network.vm_mac;
        expect_config_error(&c, "network.host_mac");
        c = VmConfig::default();
        c.luns[0].size_mib = 400;
        expect_config_error(&c, "machine.memory_mib");
        c = VmConfig::default();
        c.luns[1].block_size = 520;
        expect_config_error(&c, "luns[1].block_size");
        c = VmConfig::default();
        c.luns.clear();
        expect_config_error(&c, "luns");
        c = VmConfig::default();
        c.srpt.wwn = SrptWwnForm::Gid;
        expect_config_error(&c, "srpt.acls");
        c.srpt.acls = Some(vec!["0x00000000000000000000000000000001".into()]);
        c.validate().unwrap();
        c.srpt.acls = Some(vec!["x; reboot".into()]);
        expect_config_error(&c, "srpt.acls");
        c = VmConfig::default();
        c.iser.target_iqn = "iqn.2003-01.Bad:Upper".into();
        expect_config_error(&c, "iser.target_iqn");
        c = VmConfig::default();
        c.iser
            .parameters
            .insert("HeaderDigest".into(), "None $(x)".into());
        expect_config_error(&c, "iser.parameters.HeaderDigest");
        c = VmConfig::default();
        c.iser.demo_mode = false;
        expect_config_error(&c, "iser.acls");
        c = VmConfig::default();
        c.srpt.srp_max_req_size = Some(10);
        expect_config_error(&c, "srp_max_req_size");
        c = VmConfig::default();
        c.kernel_package = Some("linux-image-x; rm".into());
        expect_config_error(&c, "kernel_package");
    }

    #[test]
    fn guest_config_carries_every_setting() {
        let mut c = VmConfig::default();
        c.srpt.srp_max_req_size = Some(4200);
        c.srpt.srpt_srq_size = Some(1024);
        c.srpt
            .attributes
            .insert("srp_sq_size".into(), "2048".into());
        c.iser.acls.push("iqn.1991-05.com.microsoft:host".into());
        c.iser.sg_tablesize = Some(256);
        c.luns[1].block_size = 4096;
        c.validate().unwrap();
        let text = c.render_guest_config();
        for line in [
            "KV_VM_IP='10.0.0.2'",
            "KV_HOST_MAC='52:54:00:12:34:01'",
            "KV_IPV4_GID='0000:0000:0000:0000:0000:ffff:0a00:0002'",
            "KV_LUNS='rd_mcp:33554432:512 fileio:33554432:4096'",
            "KV_SRPT_PORT='5555'",
            "KV_SRPT_MODPARAMS='srp_max_req_size=4200 srpt_srq_size=1024'",
            "KV_SRPT_WWN_FORM='guid'",
            "KV_SRPT_ACLS='10.0.0.2'",
            "KV_SRPT_ATTRIBS='srp_sq_size=2048'",
            "KV_ISER_PORTAL='10.0.0.2:3260'",
            "KV_ISER_ACLS='iqn.1991-05.com.microsoft:host'",
            "KV_ISERT_MODPARAMS='sg_tablesize=256'",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn shell_quote_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }
}
