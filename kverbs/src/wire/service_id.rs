//! Service IDs, and how RDMA/CM encodes a port space and port in them.
//!
//! A CM REQ names its listener by a 64-bit service ID. RDMA/CM (what Linux
//! `ib_srpt` on RoCE and `isert` listen with) uses
//! `service ID = port_space << 16 | port`, e.g. TCP port space 0x0106 and
//! port 3260 give `0x0000_0000_0106_0CBC`. Seen as the "IB/IP" layout, the
//! top 40 bits are the prefix `0x00_0000_0001`, then the IP protocol byte
//! (0x06 TCP, 0x11 UDP, 0x3F IB), then the port.

use core::fmt;

/// An RDMA/CM port space (Linux `enum rdma_ucm_port_space`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum PortSpace {
    /// IPoIB.
    Ipoib = 0x0002,
    /// TCP: reliable connected QPs (SRP, iSER, NVMe-oF).
    Tcp = 0x0106,
    /// UDP: UD QPs.
    Udp = 0x0111,
    /// IB: any QP type, AF_IB addressing.
    Ib = 0x013f,
}

impl PortSpace {
    /// The port space with this value.
    pub const fn from_u16(value: u16) -> Option<PortSpace> {
        match value {
            0x0002 => Some(PortSpace::Ipoib),
            0x0106 => Some(PortSpace::Tcp),
            0x0111 => Some(PortSpace::Udp),
            0x013f => Some(PortSpace::Ib),
            _ => None,
        }
    }
}

/// A CM service ID (big-endian on the wire).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct ServiceId(pub u64);

impl ServiceId {
    /// The RDMA/CM IB/IP prefix: service IDs `0x0000_0000_01xx_yyyy`.
    pub const IB_IP_PREFIX: u64 = 0x0000_0000_0100_0000;
    /// The mask of the prefix.
    pub const IB_IP_PREFIX_MASK: u64 = 0xffff_ffff_ff00_0000;
    /// The mask RDMA/CM compares its IB/IP port-space IDs under (port excluded).
    pub const IB_IP_PS_MASK: u64 = 0xffff_ffff_ffff_0000;

    /// The service ID RDMA/CM listens on for `port` in `space`.
    pub const fn rdma_cm(space: PortSpace, port: u16) -> ServiceId {
        ServiceId(((space as u64) << 16) | port as u64)
    }

    /// The RDMA/CM port space, if this is an RDMA/CM service ID (bits 16..63
    /// hold a known port space, as `rdma_ps_from_service_id` reads it).
    pub const fn port_space(self) -> Option<PortSpace> {
        if self.0 >> 32 != 0 {
            return None;
        }
        // CAST: the upper 32 bits are zero, so bits 16..31 are all there is.
        PortSpace::from_u16((self.0 >> 16) as u16)
    }

    /// The RDMA/CM port (the low 16 bits).
    pub const fn port(self) -> u16 {
        // CAST: truncation to the low 16 bits is the definition.
        self.0 as u16
    }

    /// The ID has the IB/IP prefix.
    pub const fn has_ib_ip_prefix(self) -> bool {
        self.0 & Self::IB_IP_PREFIX_MASK == Self::IB_IP_PREFIX
    }

    /// The IP protocol byte of an IB/IP service ID (0x06 TCP, 0x11 UDP,
    /// 0x3F IB), or `None` without the prefix.
    pub const fn ip_protocol(self) -> Option<u8> {
        if self.has_ib_ip_prefix() {
            // CAST: one byte extracted by the shift and the truncation.
            Some((self.0 >> 16) as u8)
        } else {
            None
        }
    }
}

impl fmt::Debug for ServiceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServiceId({:#018x})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_cm_encoding() {
        let iser = ServiceId::rdma_cm(PortSpace::Tcp, 3260);
        assert_eq!(iser.0, 0x0000_0000_0106_0cbc);
        assert_eq!(iser.port_space(), Some(PortSpace::Tcp));
        assert_eq!(iser.port(), 3260);
        assert!(iser.has_ib_ip_prefix());
        assert_eq!(iser.ip_protocol(), Some(0x06));
        assert_eq!(iser.0 & ServiceId::IB_IP_PS_MASK, 0x0000_0000_0106_0000);
        let udp = ServiceId::rdma_cm(PortSpace::Udp, 1);
        assert_eq!(udp.ip_protocol(), Some(0x11));
        let ib = ServiceId::rdma_cm(PortSpace::Ib, 0xffff);
        assert_eq!(ib.0, 0x0000_0000_013f_ffff);
        assert_eq!(ib.ip_protocol(), Some(0x3f));
        let ipoib = ServiceId::rdma_cm(PortSpace::Ipoib, 5);
        assert_eq!(ipoib.port_space(), Some(PortSpace::Ipoib));
        assert!(!ipoib.has_ib_ip_prefix());
    }

    #[test]
    fn other_ids() {
        // An IB-CM service ID such as srpt's (the HCA's node GUID).
        let guid = ServiceId(0x5054_00ff_fe12_3456);
        assert_eq!(guid.port_space(), None);
        assert_eq!(guid.ip_protocol(), None);
        assert_eq!(ServiceId(0x0000_0000_0107_0001).port_space(), None);
        assert_eq!(std::format!("{:?}", guid), "ServiceId(0x505400fffe123456)");
    }
}
