//! The RDMA/CM private-data header (Linux `struct cma_hdr`, 36 bytes).
//!
//! RDMA/CM puts it at the start of the REQ private data, so the passive
//! side learns the IP addresses and source port of the connection; the
//! consumer's own data (SRP's `srp_login_req_rdma`, iSER's 4-byte header)
//! follows at offset 36, leaving it 56 bytes. REP, RTU and REJ carry no
//! such header.
//!
//! ```text
//!  byte 0      version (0)
//!  byte 1      IP version in bits 7..4 (4 or 6); bits 3..0 unused
//!  bytes 2-3   source port (the active side's)
//!  bytes 4-19  source address      IPv4: 12 zero bytes, then the address
//!  bytes 20-35 destination address (not ::ffff:-mapped)
//! ```

use hca_lowlevel::wire::Ipv4Address;
use hca_lowlevel::wire::bytes::{self, Field, Rest};

use super::{Error, Result};

mod field {
    use super::{Field, Rest};
    pub const VERSION: usize = 0;
    pub const IP_VERSION: usize = 1;
    pub const PORT: Field = 2..4;
    pub const SRC_ADDR: Field = 4..20;
    pub const SRC_V4: Field = 16..20;
    pub const DST_ADDR: Field = 20..36;
    pub const DST_V4: Field = 32..36;
    pub const USER_DATA: Rest = 36..;
}

/// The RDMA/CM header length (where the consumer's private data starts).
pub const CMA_HEADER_LEN: usize = field::DST_ADDR.end;
static_assertions::const_assert_eq!(CMA_HEADER_LEN, 36);

/// The only RDMA/CM header version.
const CMA_VERSION: u8 = 0;

fixed_view! {
    /// A view of an RDMA/CM header at the start of REQ private data.
    CmaHeader, CMA_HEADER_LEN
}

impl<T: AsRef<[u8]>> CmaHeader<T> {
    /// Header version.
    pub fn version(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::VERSION)
    }

    /// IP version (bits 7..4 of byte 1).
    pub fn ip_version(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::IP_VERSION) >> 4
    }

    /// The active side's source port.
    pub fn src_port(&self) -> u16 {
        bytes::read_be16(self.buffer.as_ref(), field::PORT)
    }

    /// The 16-byte source address field.
    pub fn src_addr(&self) -> [u8; 16] {
        bytes::read_array(self.buffer.as_ref(), field::SRC_ADDR)
    }

    /// The 16-byte destination address field.
    pub fn dst_addr(&self) -> [u8; 16] {
        bytes::read_array(self.buffer.as_ref(), field::DST_ADDR)
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> CmaHeader<&'a T> {
    /// The consumer's private data after the header.
    pub fn user_data(&self) -> &'a [u8] {
        bytes::rest(self.buffer.as_ref(), field::USER_DATA)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmaHeader<T> {
    /// Set the version.
    pub fn set_version(&mut self, version: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::VERSION, version);
    }

    /// Set the IP version (the unused low bits are cleared).
    pub fn set_ip_version(&mut self, ip_version: u8) {
        bytes::write_u8(self.buffer.as_mut(), field::IP_VERSION, ip_version << 4);
    }

    /// Set the source port.
    pub fn set_src_port(&mut self, port: u16) {
        bytes::write_be16(self.buffer.as_mut(), field::PORT, port);
    }

    /// Set the 16-byte source address field.
    pub fn set_src_addr(&mut self, addr: &[u8; 16]) {
        bytes::write_bytes(self.buffer.as_mut(), field::SRC_ADDR, addr);
    }

    /// Set the 16-byte destination address field.
    pub fn set_dst_addr(&mut self, addr: &[u8; 16]) {
        bytes::write_bytes(self.buffer.as_mut(), field::DST_ADDR, addr);
    }
}

/// The addresses of an RDMA/CM connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmaAddresses {
    /// IPv4: initiator (source) and target (destination).
    V4 {
        /// The active side's address.
        src: Ipv4Address,
        /// The passive side's address.
        dst: Ipv4Address,
    },
    /// IPv6, as 16-byte addresses.
    V6 {
        /// The active side's address.
        src: [u8; 16],
        /// The passive side's address.
        dst: [u8; 16],
    },
}

/// The meaning of an RDMA/CM header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHeaderRepr {
    /// The active side's source port.
    pub src_port: u16,
    /// The connection's addresses.
    pub addresses: CmaAddresses,
}

impl CmaHeaderRepr {
    /// Parse an RDMA/CM header.
    ///
    /// For IPv4, only the last four bytes of each address field are read
    /// (Linux ignores the twelve bytes before them too).
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`]; [`Error::BadCmaVersion`] unless version 0;
    /// [`Error::BadCmaIpVersion`] unless IP version 4 or 6.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &CmaHeader<&T>) -> Result<CmaHeaderRepr> {
        header.check_len()?;
        if header.version() != CMA_VERSION {
            return Err(Error::BadCmaVersion(header.version()));
        }
        let buf = header.buffer.as_ref();
        let addresses = match header.ip_version() {
            4 => CmaAddresses::V4 {
                src: Ipv4Address(bytes::read_array(buf, field::SRC_V4)),
                dst: Ipv4Address(bytes::read_array(buf, field::DST_V4)),
            },
            6 => CmaAddresses::V6 {
                src: header.src_addr(),
                dst: header.dst_addr(),
            },
            other => return Err(Error::BadCmaIpVersion(other)),
        };
        Ok(CmaHeaderRepr {
            src_port: header.src_port(),
            addresses,
        })
    }

    /// Parse the RDMA/CM header at the start of REQ private data; returns it
    /// and the consumer's data after it.
    ///
    /// # Errors
    ///
    /// Those of [`Self::parse`].
    pub fn parse_private_data(private_data: &[u8]) -> Result<(CmaHeaderRepr, &[u8])> {
        let header = CmaHeader::new_checked(private_data)?;
        Ok((Self::parse(&header)?, header.user_data()))
    }

    /// The header length.
    pub const fn buffer_len(&self) -> usize {
        CMA_HEADER_LEN
    }

    /// Write the header (IPv4 addresses as 12 zero bytes and the address).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut CmaHeader<T>) {
        header.set_version(CMA_VERSION);
        header.set_src_port(self.src_port);
        match self.addresses {
            CmaAddresses::V4 { src, dst } => {
                header.set_ip_version(4);
                header.set_src_addr(&v4_field(src));
                header.set_dst_addr(&v4_field(dst));
            }
            CmaAddresses::V6 { src, dst } => {
                header.set_ip_version(6);
                header.set_src_addr(&src);
                header.set_dst_addr(&dst);
            }
        }
    }
}

/// The 16-byte address field for an IPv4 address: zeroes, then the address.
fn v4_field(addr: Ipv4Address) -> [u8; 16] {
    let [a, b, c, d] = addr.0;
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, a, b, c, d]
}

#[cfg(test)]
mod tests {
    use super::*;

    // Written by hand from the layout: IPv4 192.0.2.1:50000 -> 192.0.2.2,
    // followed by two bytes of consumer data.
    const V4: [u8; 38] = [
        0x00, 0x40, 0xc3, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 0, 2, 1, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 192, 0, 2, 2, 0xab, 0xcd,
    ];

    #[test]
    fn ipv4_header() {
        let (repr, user) = CmaHeaderRepr::parse_private_data(&V4).unwrap();
        assert_eq!(
            repr,
            CmaHeaderRepr {
                src_port: 50000,
                addresses: CmaAddresses::V4 {
                    src: Ipv4Address::new(192, 0, 2, 1),
                    dst: Ipv4Address::new(192, 0, 2, 2),
                },
            }
        );
        assert_eq!(user, &[0xab, 0xcd]);
        let mut out = [0xffu8; 36];
        repr.emit(&mut CmaHeader::new_unchecked(&mut out[..]));
        assert_eq!(&out[..], &V4[..36]);
    }

    #[test]
    fn ipv6_header_and_errors() {
        let mut v6 = [0u8; 36];
        v6[1] = 0x60;
        v6[4] = 0xfe;
        v6[5] = 0x80;
        v6[35] = 1;
        let repr = CmaHeaderRepr::parse(&CmaHeader::new_checked(&v6[..]).unwrap()).unwrap();
        let CmaAddresses::V6 { src, dst } = repr.addresses else {
            panic!("not IPv6");
        };
        assert_eq!(&src[..2], &[0xfe, 0x80]);
        assert_eq!(dst[15], 1);
        let mut out = [0u8; 36];
        repr.emit(&mut CmaHeader::new_unchecked(&mut out[..]));
        assert_eq!(out, v6);

        let mut bad = V4;
        bad[0] = 1;
        assert_eq!(
            CmaHeaderRepr::parse_private_data(&bad),
            Err(Error::BadCmaVersion(1))
        );
        bad = V4;
        bad[1] = 0x50;
        assert_eq!(
            CmaHeaderRepr::parse_private_data(&bad),
            Err(Error::BadCmaIpVersion(5))
        );
        assert_eq!(
            CmaHeaderRepr::parse_private_data(&V4[..35]),
            Err(Error::Truncated)
        );
    }
}
