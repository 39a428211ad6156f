//! The 44-byte path description inside a REQ (primary at 52, alternate at 96).
//!
//! ```text
//!  bytes 0-1   local port LID        (RoCE: 0xFFFF, permissive)
//!  bytes 2-3   remote port LID       (RoCE: 0xFFFF)
//!  bytes 4-19  local port GID        (RoCE: the initiator's IPv4-mapped address)
//!  bytes 20-35 remote port GID       (RoCE: the target's)
//!  bytes 36-39 flow label(20) | reserved(6) | packet rate(6)
//!  byte 40     traffic class
//!  byte 41     hop limit
//!  byte 42     SL(4) | subnet local(1) | reserved(3)
//!  byte 43     local ACK timeout(5) | reserved(3)
//! ```

use hca_lowlevel::wire::Gid;
use hca_lowlevel::wire::bytes::{self, Field};

use super::{IbTimeout, get_bits, set_bits};
use crate::wire::{Result, check_range};

mod field {
    use super::Field;
    pub const LOCAL_LID: Field = 0..2;
    pub const REMOTE_LID: Field = 2..4;
    pub const LOCAL_GID: Field = 4..20;
    pub const REMOTE_GID: Field = 20..36;
    pub const FLOW_RATE: Field = 36..40;
    pub const TRAFFIC_CLASS: usize = 40;
    pub const HOP_LIMIT: usize = 41;
    pub const SL_SUBNET: usize = 42;
    pub const ACK_TIMEOUT: usize = 43;
}

/// The length of a REQ path description.
pub const PATH_LEN: usize = field::ACK_TIMEOUT + 1;
static_assertions::const_assert_eq!(PATH_LEN, 44);

/// The permissive LID, which the Linux CM puts in both LID fields on RoCE.
pub const PERMISSIVE_LID: u16 = 0xffff;

const FLOW_LABEL_SHIFT: u32 = 12;
const FLOW_LABEL_MAX: u32 = 0xf_ffff;
const PACKET_RATE_MASK: u32 = 0x3f;
const SL_MASK: u8 = 0xf0;
const SUBNET_LOCAL_MASK: u8 = 0x08;
const ACK_TIMEOUT_MASK: u8 = 0xf8;

fixed_view! {
    /// A view of a REQ path description.
    CmPath, PATH_LEN
}

impl<T: AsRef<[u8]>> CmPath<T> {
    /// Local port LID.
    pub fn local_lid(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::LOCAL_LID)
    }

    /// Remote port LID.
    pub fn remote_lid(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::REMOTE_LID)
    }

    /// Local port GID.
    pub fn local_gid(&self) -> Gid {
        Gid(bytes::read_array(self.buffer.as_ref(), field::LOCAL_GID))
    }

    /// Remote port GID.
    pub fn remote_gid(&self) -> Gid {
        Gid(bytes::read_array(self.buffer.as_ref(), field::REMOTE_GID))
    }

    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        bytes::read_be32(self.buffer.as_ref(), field::FLOW_RATE) >> FLOW_LABEL_SHIFT
    }

    /// Packet rate (6 bits, IBA rate encoding).
    pub fn packet_rate(&self) -> u8 {
        // CAST: masked to six bits.
        (bytes::read_be32(self.buffer.as_ref(), field::FLOW_RATE) & PACKET_RATE_MASK) as u8
    }

    /// Traffic class.
    pub fn traffic_class(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::TRAFFIC_CLASS)
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::HOP_LIMIT)
    }

    /// Service level (4 bits).
    pub fn sl(&self) -> u8 {
        get_bits(self.buffer.as_ref(), field::SL_SUBNET, SL_MASK)
    }

    /// Subnet local.
    pub fn subnet_local(&self) -> bool {
        get_bits(self.buffer.as_ref(), field::SL_SUBNET, SUBNET_LOCAL_MASK) != 0
    }

    /// Local ACK timeout.
    pub fn local_ack_timeout(&self) -> IbTimeout {
        IbTimeout::from_low_bits(get_bits(
            self.buffer.as_ref(),
            field::ACK_TIMEOUT,
            ACK_TIMEOUT_MASK,
        ))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmPath<T> {
    /// Set the local port LID.
    pub fn set_local_lid(&mut self, lid: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::LOCAL_LID, lid);
    }

    /// Set the remote port LID.
    pub fn set_remote_lid(&mut self, lid: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::REMOTE_LID, lid);
    }

    /// Set the local port GID.
    pub fn set_local_gid(&mut self, gid: Gid) {
        bytes::write_bytes(self.buffer.as_mut(), field::LOCAL_GID, &gid.0);
    }

    /// Set the remote port GID.
    pub fn set_remote_gid(&mut self, gid: Gid) {
        bytes::write_bytes(self.buffer.as_mut(), field::REMOTE_GID, &gid.0);
    }

    /// Set flow label and packet rate; the reserved bits between them are
    /// cleared and excess bits of either value dropped.
    pub fn set_flow_label_and_rate(&mut self, flow_label: u32, packet_rate: u8) {
        let word = ((flow_label & FLOW_LABEL_MAX) << FLOW_LABEL_SHIFT)
            | (u32::from(packet_rate) & PACKET_RATE_MASK);
        bytes::write_be32(self.buffer.as_mut(), field::FLOW_RATE, word);
    }

    /// Set the traffic class.
    pub fn set_traffic_class(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::TRAFFIC_CLASS, value);
    }

    /// Set the hop limit.
    pub fn set_hop_limit(&mut self, value: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::HOP_LIMIT, value);
    }

    /// Set the service level (low four bits of `sl`).
    pub fn set_sl(&mut self, sl: u8) {
        set_bits(self.buffer.as_mut(), field::SL_SUBNET, SL_MASK, sl);
    }

    /// Set subnet local.
    pub fn set_subnet_local(&mut self, value: bool) {
        set_bits(
            self.buffer.as_mut(),
            field::SL_SUBNET,
            SUBNET_LOCAL_MASK,
            u8::from(value),
        );
    }

    /// Set the local ACK timeout (the other bits of the byte are kept).
    pub fn set_local_ack_timeout(&mut self, timeout: IbTimeout) {
        set_bits(
            self.buffer.as_mut(),
            field::ACK_TIMEOUT,
            ACK_TIMEOUT_MASK,
            timeout.exponent(),
        );
    }
}

/// The meaning of a REQ path description.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmPathRepr {
    /// Local port LID ([`PERMISSIVE_LID`] on RoCE).
    pub local_lid: u16,
    /// Remote port LID ([`PERMISSIVE_LID`] on RoCE).
    pub remote_lid: u16,
    /// Local port GID (the requester's).
    pub local_gid: Gid,
    /// Remote port GID (the responder's).
    pub remote_gid: Gid,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local (0 on RoCE).
    pub subnet_local: bool,
    /// Local ACK timeout (exponent 0: none).
    pub local_ack_timeout: IbTimeout,
}

impl CmPathRepr {
    /// Parse a path description (total: every bit pattern is a path).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](crate::wire::Error::Truncated).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(path: &CmPath<&T>) -> Result<CmPathRepr> {
        path.check_len()?;
        Ok(CmPathRepr {
            local_lid: path.local_lid(),
            remote_lid: path.remote_lid(),
            local_gid: path.local_gid(),
            remote_gid: path.remote_gid(),
            flow_label: path.flow_label(),
            packet_rate: path.packet_rate(),
            traffic_class: path.traffic_class(),
            hop_limit: path.hop_limit(),
            sl: path.sl(),
            subnet_local: path.subnet_local(),
            local_ack_timeout: path.local_ack_timeout(),
        })
    }

    /// The length of the emitted description.
    pub const fn buffer_len(&self) -> usize {
        PATH_LEN
    }

    /// Check every value fits its bit field.
    ///
    /// # Errors
    ///
    /// [`Error::FieldOutOfRange`](crate::wire::Error::FieldOutOfRange) for
    /// the flow label, packet rate or SL.
    pub fn check(&self) -> Result<()> {
        check_range(self.flow_label, FLOW_LABEL_MAX, "path flow label")?;
        check_range(
            u32::from(self.packet_rate),
            PACKET_RATE_MASK,
            "path packet rate",
        )?;
        check_range(u32::from(self.sl), 15, "path SL")
    }

    /// Write the description (reserved bits in its bytes are cleared,
    /// except in byte 43, where the REQ keeps SAP-supported).
    ///
    /// # Errors
    ///
    /// Those of [`Self::check`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, path: &mut CmPath<T>) -> Result<()> {
        self.check()?;
        path.set_local_lid(self.local_lid);
        path.set_remote_lid(self.remote_lid);
        path.set_local_gid(self.local_gid);
        path.set_remote_gid(self.remote_gid);
        path.set_flow_label_and_rate(self.flow_label, self.packet_rate);
        path.set_traffic_class(self.traffic_class);
        path.set_hop_limit(self.hop_limit);
        bytes::write_u8(path.buffer.as_mut(), field::SL_SUBNET, 0);
        path.set_sl(self.sl);
        path.set_subnet_local(self.subnet_local);
        path.set_local_ack_timeout(self.local_ack_timeout);
        Ok(())
    }

    /// The path is present: the Linux CM treats an alternate path as absent
    /// when its local LID is 0 and its local GID all zero.
    pub fn is_present(&self) -> bool {
        self.local_lid != 0 || self.local_gid != Gid::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;
    use hca_lowlevel::wire::Ipv4Address;

    #[test]
    fn bit_fields() {
        let mut buf = [0u8; 44];
        let repr = CmPathRepr {
            local_lid: PERMISSIVE_LID,
            remote_lid: PERMISSIVE_LID,
            local_gid: Gid::from_ipv4(Ipv4Address::new(192, 0, 2, 1)),
            remote_gid: Gid::from_ipv4(Ipv4Address::new(192, 0, 2, 2)),
            flow_label: 0xf_ffff,
            packet_rate: 0x3f,
            traffic_class: 0x12,
            hop_limit: 64,
            sl: 0xf,
            subnet_local: true,
            local_ack_timeout: IbTimeout::MAX,
        };
        repr.emit(&mut CmPath::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(
            &buf[36..44],
            &[0xff, 0xff, 0xf0, 0x3f, 0x12, 0x40, 0xf8, 0xf8]
        );
        assert_eq!(
            CmPathRepr::parse(&CmPath::new_checked(&buf[..]).unwrap()),
            Ok(repr)
        );
    }

    #[test]
    fn out_of_range() {
        let mut buf = [0u8; 44];
        let base = CmPathRepr::parse(&CmPath::new_unchecked(&buf[..])).unwrap();
        assert!(!base.is_present());
        let bad = CmPathRepr {
            flow_label: 0x10_0000,
            ..base
        };
        assert_eq!(
            bad.emit(&mut CmPath::new_unchecked(&mut buf[..])),
            Err(Error::FieldOutOfRange("path flow label"))
        );
        let bad = CmPathRepr { sl: 16, ..base };
        assert_eq!(bad.check(), Err(Error::FieldOutOfRange("path SL")));
        let bad = CmPathRepr {
            packet_rate: 64,
            ..base
        };
        assert_eq!(bad.check(), Err(Error::FieldOutOfRange("path packet rate")));
    }
}
