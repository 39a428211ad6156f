//! 128-bit global identifiers, and the IPv4-mapped form RoCEv2 uses.
//!
//! On RoCEv2 a port's GID is its IP address: an IPv4 address `a.b.c.d`
//! appears as the IPv4-mapped IPv6 address `::ffff:a.b.c.d` (in the CM REQ
//! path GIDs, the GID table, the UD address vector).

use core::fmt;

use super::Ipv4Address;

const MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// A GID (an IPv6 address in form).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID.
    pub const ZERO: Gid = Gid([0; 16]);

    /// The IPv4-mapped GID `::ffff:a.b.c.d`.
    pub const fn from_ipv4(addr: Ipv4Address) -> Gid {
        let [a, b, c, d] = addr.0;
        Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d])
    }

    /// The IPv4 address of an IPv4-mapped GID; `None` for any other GID.
    pub fn to_ipv4(&self) -> Option<Ipv4Address> {
        match self.0 {
            [p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, a, b, c, d]
                if [p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11] == MAPPED_PREFIX =>
            {
                Some(Ipv4Address([a, b, c, d]))
            }
            _ => None,
        }
    }

    /// The GID is IPv4-mapped.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.to_ipv4().is_some()
    }

    /// The subnet prefix (upper 64 bits), as the IB GID's first half.
    pub const fn subnet_prefix(&self) -> u64 {
        let [a, b, c, d, e, f, g, h, ..] = self.0;
        u64::from_be_bytes([a, b, c, d, e, f, g, h])
    }

    /// The interface identifier (lower 64 bits), as the IB GID's second half.
    pub const fn interface_id(&self) -> u64 {
        let [.., a, b, c, d, e, f, g, h] = self.0;
        u64::from_be_bytes([a, b, c, d, e, f, g, h])
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Gid {
    /// IPv4-mapped GIDs as `::ffff:a.b.c.d`, others as eight colon-separated
    /// hex groups (no zero compression).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(v4) = self.to_ipv4() {
            return write!(f, "::ffff:{v4}");
        }
        for (i, pair) in self.0.chunks_exact(2).enumerate() {
            if let [hi, lo] = *pair {
                if i > 0 {
                    f.write_str(":")?;
                }
                write!(f, "{:x}", u16::from_be_bytes([hi, lo]))?;
            }
        }
        Ok(())
    }
}

impl From<Ipv4Address> for Gid {
    fn from(addr: Ipv4Address) -> Gid {
        Gid::from_ipv4(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapping_round_trip() {
        let ip = Ipv4Address::new(192, 0, 2, 1);
        let gid = Gid::from_ipv4(ip);
        assert_eq!(
            gid.0,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1]
        );
        assert_eq!(gid.to_ipv4(), Some(ip));
        assert!(gid.is_ipv4_mapped());
        assert_eq!(gid.subnet_prefix(), 0);
        assert_eq!(gid.interface_id(), 0x0000_ffff_c000_0201);
        assert_eq!(std::format!("{gid}"), "::ffff:192.0.2.1");
    }

    #[test]
    fn other_gids_are_not_ipv4() {
        let mut link_local = [0u8; 16];
        link_local[0] = 0xfe;
        link_local[1] = 0x80;
        link_local[15] = 1;
        let gid = Gid(link_local);
        assert_eq!(gid.to_ipv4(), None);
        assert_eq!(std::format!("{gid}"), "fe80:0:0:0:0:0:0:1");
        // The IPv4-compatible form (no ffff) is not the RoCEv2 mapping.
        let mut compat = [0u8; 16];
        compat[12..].copy_from_slice(&[192, 0, 2, 1]);
        assert_eq!(Gid(compat).to_ipv4(), None);
    }
}
