//! RDMA/CM addressing on top of the IB CM: what Linux `rdma_cm` puts in a
//! REQ on RoCE, so `ib_srpt` and `isert` accept it.
//!
//! * The service ID is the port space and the destination port
//!   (`0x0106 << 16 | port` for TCP).
//! * REQ private data starts with the 36-byte RDMA/CM header (version 0,
//!   IP version, the *source* port, source and destination IP); the
//!   consumer's data follows, 56 bytes at most. REP, REJ and RTU carry no
//!   header.
//! * GIDs are the IPv4-mapped addresses, LIDs the permissive LID 0xFFFF
//!   (Linux uses it on RoCE because the hop limit is above 1), the hop
//!   limit 64 (the IPv4 default TTL), the path MTU the largest that fits
//!   the Ethernet MTU (1024 on a 1500-byte link).
//! * The passive side checks the header (version 0, IP version 4 or 6, the
//!   addresses are unicast and the destination is its own) before the
//!   consumer sees the request; otherwise it rejects with reason 28, as
//!   Linux does when `cma_ib_id_from_event` fails.
//!
//! # IRQL
//!
//! Every function here is pure computation over its arguments (no
//! allocation, no lock, bounded time): callable at any IRQL.

use hca_lowlevel::wire::{Gid, Ipv4Address};

use super::types::{CmError, MadAddress};
use crate::wire::{
    CMA_HEADER_LEN, CmPathRepr, CmaAddresses, CmaHeader, CmaHeaderRepr, IbTimeout, PathMtu,
    PortSpace, ServiceId, cm::PERMISSIVE_LID,
};

/// The REQ private data length.
pub const REQ_PRIVATE_DATA_LEN: usize = 92;
/// The consumer's share of REQ private data under RDMA/CM.
pub const USER_DATA_LEN: usize = REQ_PRIVATE_DATA_LEN - CMA_HEADER_LEN;
static_assertions::const_assert_eq!(USER_DATA_LEN, 56);

/// The hop limit Linux puts in a RoCE path (the IPv4 default TTL).
pub const ROCE_HOP_LIMIT: u8 = 64;

/// An IPv4 RDMA/CM connection's endpoints.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct RdmaCmEndpoints {
    /// The port space (TCP for SRP, iSER, NVMe-oF).
    pub port_space: PortSpace,
    /// This side's IPv4 address.
    pub src: Ipv4Address,
    /// This side's port (goes in the header; any value).
    pub src_port: u16,
    /// The target's IPv4 address.
    pub dst: Ipv4Address,
    /// The target's port (goes in the service ID).
    pub dst_port: u16,
}

impl RdmaCmEndpoints {
    /// The service ID the target listens on.
    pub const fn service_id(&self) -> ServiceId {
        ServiceId::rdma_cm(self.port_space, self.dst_port)
    }

    /// This side's GID (`::ffff:src`).
    pub const fn local_gid(&self) -> Gid {
        Gid::from_ipv4(self.src)
    }

    /// The target's GID (`::ffff:dst`).
    pub const fn remote_gid(&self) -> Gid {
        Gid::from_ipv4(self.dst)
    }

    /// The target's CM (its QP1).
    pub const fn peer(&self) -> MadAddress {
        MadAddress::cm(self.remote_gid())
    }

    /// The RDMA/CM header of the REQ.
    pub const fn header(&self) -> CmaHeaderRepr {
        CmaHeaderRepr {
            src_port: self.src_port,
            addresses: CmaAddresses::V4 {
                src: self.src,
                dst: self.dst,
            },
        }
    }

    /// The REQ private data: the header, then `user` (at most 56 bytes),
    /// then zeroes. Returns the bytes to send (always 92).
    ///
    /// # Errors
    ///
    /// [`CmError::PrivateDataTooLong`] above 56 bytes.
    ///
    /// # IRQL
    ///
    /// Any (pure computation).
    pub fn req_private_data(
        &self,
        user: &[u8],
        out: &mut [u8; REQ_PRIVATE_DATA_LEN],
    ) -> Result<usize, CmError> {
        if user.len() > USER_DATA_LEN {
            return Err(CmError::PrivateDataTooLong(USER_DATA_LEN));
        }
        out.fill(0);
        let (head, tail) = out.split_at_mut(CMA_HEADER_LEN);
        self.header().emit(&mut CmaHeader::new_unchecked(head));
        if let Some(dst) = tail.get_mut(..user.len()) {
            dst.copy_from_slice(user);
        }
        Ok(REQ_PRIVATE_DATA_LEN)
    }

    /// The REQ primary path: IPv4-mapped GIDs, permissive LIDs, hop limit
    /// 64, SL 0, traffic class 0, and `ack_timeout` as the local ACK
    /// timeout both QPs will use.
    pub const fn path(&self, ack_timeout: IbTimeout) -> CmPathRepr {
        CmPathRepr {
            local_lid: PERMISSIVE_LID,
            remote_lid: PERMISSIVE_LID,
            local_gid: self.local_gid(),
            remote_gid: self.remote_gid(),
            flow_label: 0,
            packet_rate: 0,
            traffic_class: 0,
            hop_limit: ROCE_HOP_LIMIT,
            sl: 0,
            subnet_local: false,
            local_ack_timeout: ack_timeout,
        }
    }
}

/// The local ACK timeout Linux derives from a packet lifetime
/// (`cm_ack_timeout` without the CA's ACK delay): one step above it.
pub const fn ack_timeout_for(packet_lifetime: IbTimeout) -> IbTimeout {
    IbTimeout::from_low_bits(if packet_lifetime.exponent() >= 31 {
        31
    } else {
        packet_lifetime.exponent() + 1
    })
}

/// The path MTU of a RoCE port on an Ethernet link of `netdev_mtu` bytes
/// (1500 → 1024), capped at the port's `active` MTU.
pub fn roce_path_mtu(netdev_mtu: u32, active: PathMtu) -> Option<PathMtu> {
    PathMtu::for_roce_netdev_mtu(netdev_mtu).map(|mtu| mtu.min(active))
}

/// Why the passive side refuses a REQ's RDMA/CM header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum CmaHeaderError {
    /// The header is malformed (too short, version, IP version).
    Malformed,
    /// The source is not a unicast address (zero, broadcast, multicast,
    /// loopback).
    BadSource,
    /// The destination is not this port's address.
    WrongDestination,
}

/// Checks the RDMA/CM header of a received REQ's private data against the
/// port's GID; returns the header and the consumer's data after it.
///
/// # Errors
///
/// A [`CmaHeaderError`] naming what is wrong.
///
/// # IRQL
///
/// Any (pure computation).
pub fn check_incoming(
    private_data: &[u8],
    local_gid: Gid,
) -> Result<(CmaHeaderRepr, &[u8]), CmaHeaderError> {
    let (header, user) =
        CmaHeaderRepr::parse_private_data(private_data).map_err(|_| CmaHeaderError::Malformed)?;
    match header.addresses {
        CmaAddresses::V4 { src, dst } => {
            if !src.is_unicast() || src.is_loopback() {
                return Err(CmaHeaderError::BadSource);
            }
            if Gid::from_ipv4(dst) != local_gid {
                return Err(CmaHeaderError::WrongDestination);
            }
        }
        CmaAddresses::V6 { src, dst } => {
            const LOOPBACK: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
            let [first, ..] = src;
            let mapped_v4_bad = Gid(src)
                .to_ipv4()
                .is_some_and(|v4| !v4.is_unicast() || v4.is_loopback());
            if src == [0; 16] || first == 0xff || src == LOOPBACK || mapped_v4_bad {
                return Err(CmaHeaderError::BadSource);
            }
            if Gid(dst) != local_gid {
                return Err(CmaHeaderError::WrongDestination);
            }
        }
    }
    Ok((header, user))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints() -> RdmaCmEndpoints {
        RdmaCmEndpoints {
            port_space: PortSpace::Tcp,
            src: Ipv4Address::new(10, 0, 0, 1),
            src_port: 0xc350,
            dst: Ipv4Address::new(10, 0, 0, 2),
            dst_port: 5555,
        }
    }

    #[test]
    fn service_id_and_private_data() {
        let ep = endpoints();
        assert_eq!(ep.service_id(), ServiceId(0x0000_0000_0106_15b3));
        let mut out = [0xaa; REQ_PRIVATE_DATA_LEN];
        assert_eq!(ep.req_private_data(&[1, 2, 3], &mut out), Ok(92));
        // Reference §3.8: version 0, IP version in bits 7:4, the source
        // port, 12 zero bytes before each IPv4 address.
        assert_eq!(&out[..4], &[0x00, 0x40, 0xc3, 0x50]);
        assert_eq!(&out[4..16], &[0; 12]);
        assert_eq!(&out[16..20], &[10, 0, 0, 1]);
        assert_eq!(&out[20..32], &[0; 12]);
        assert_eq!(&out[32..36], &[10, 0, 0, 2]);
        assert_eq!(&out[36..40], &[1, 2, 3, 0]);
        assert!(out[39..].iter().all(|b| *b == 0));
        assert_eq!(
            ep.req_private_data(&[0; 57], &mut out),
            Err(CmError::PrivateDataTooLong(56))
        );
        assert_eq!(ep.req_private_data(&[7; 56], &mut out), Ok(92));
        assert_eq!(out[91], 7);
    }

    #[test]
    fn path_is_roce_shaped() {
        let ep = endpoints();
        let path = ep.path(IbTimeout::new(19).unwrap());
        assert_eq!(path.local_lid, 0xffff);
        assert_eq!(path.remote_lid, 0xffff);
        assert_eq!(path.local_gid.to_ipv4(), Some(ep.src));
        assert_eq!(path.remote_gid.to_ipv4(), Some(ep.dst));
        assert_eq!(path.hop_limit, 64);
        assert!(!path.subnet_local);
        assert_eq!(ack_timeout_for(IbTimeout::new(18).unwrap()).exponent(), 19);
        assert_eq!(ack_timeout_for(IbTimeout::MAX), IbTimeout::MAX);
        assert_eq!(
            roce_path_mtu(1500, PathMtu::Mtu4096),
            Some(PathMtu::Mtu1024)
        );
        assert_eq!(
            roce_path_mtu(9000, PathMtu::Mtu2048),
            Some(PathMtu::Mtu2048)
        );
        assert_eq!(roce_path_mtu(100, PathMtu::Mtu2048), None);
    }

    #[test]
    fn incoming_header_checks() {
        let ep = endpoints();
        let mut data = [0u8; REQ_PRIVATE_DATA_LEN];
        ep.req_private_data(&[9; 56], &mut data).unwrap();
        let (header, user) = check_incoming(&data, ep.remote_gid()).unwrap();
        assert_eq!(header, ep.header());
        assert_eq!(user, &[9; 56]);
        assert_eq!(
            check_incoming(&data, ep.local_gid()).unwrap_err(),
            CmaHeaderError::WrongDestination
        );
        let mut bad = data;
        bad[0] = 1;
        assert_eq!(
            check_incoming(&bad, ep.remote_gid()).unwrap_err(),
            CmaHeaderError::Malformed
        );
        let mut bad = data;
        bad[16..20].copy_from_slice(&[224, 0, 0, 1]);
        assert_eq!(
            check_incoming(&bad, ep.remote_gid()).unwrap_err(),
            CmaHeaderError::BadSource
        );
        bad[16..20].copy_from_slice(&[127, 0, 0, 1]);
        assert_eq!(
            check_incoming(&bad, ep.remote_gid()).unwrap_err(),
            CmaHeaderError::BadSource
        );
        assert_eq!(
            check_incoming(&data[..30], ep.remote_gid()).unwrap_err(),
            CmaHeaderError::Malformed
        );
        // IPv6: multicast source refused, a unicast one accepted.
        let mut v6 = [0u8; 36];
        v6[1] = 0x60;
        v6[4] = 0xfe;
        v6[5] = 0x80;
        v6[19] = 1;
        let local = Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        v6[20..36].copy_from_slice(&local.0);
        assert!(check_incoming(&v6, local).is_ok());
        v6[4] = 0xff;
        assert_eq!(
            check_incoming(&v6, local).unwrap_err(),
            CmaHeaderError::BadSource
        );
    }
}
