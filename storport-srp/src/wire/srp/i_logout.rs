//! `SRP_I_LOGOUT` (16 bytes): the initiator ends the channel. (Linux
//! `ib_srpt` only logs it; a CM DREQ is what really tears the channel down.)

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const TAG: Field = 8..16;
}

/// Size of `SRP_I_LOGOUT`.
pub const LEN: usize = field::TAG.end;
const_assert_eq!(LEN, 16);

/// The value of an `SRP_I_LOGOUT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ILogoutRepr {
    /// Tag.
    pub tag: u64,
}

impl ILogoutRepr {
    /// Parses an initiator logout.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &ILogout<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::ILogout)?;
        Ok(Self { tag: iu.tag() })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        LEN
    }

    /// Writes the IU, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut ILogout<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::ILogout as u8);
        iu.set_tag(self.tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_I_LOGOUT` (`srp_i_logout`).
    pub struct ILogout, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x03).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes_and_malformed() {
        let repr = ILogoutRepr {
            tag: 0x1122_3344_5566_7788,
        };
        let mut buf = [0xEEu8; 16];
        repr.emit(&mut ILogout::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(
            buf,
            [
                3, 0, 0, 0, 0, 0, 0, 0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88
            ]
        );
        assert_eq!(
            ILogoutRepr::parse(&ILogout::new_unchecked(&buf[..])),
            Ok(repr)
        );
        assert_eq!(
            ILogoutRepr::parse(&ILogout::new_unchecked(&buf[..15])),
            Err(Error::Truncated)
        );
        buf[0] = 0x80;
        assert_eq!(
            ILogoutRepr::parse(&ILogout::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x80))
        );
        assert_eq!(
            repr.emit(&mut ILogout::new_unchecked(&mut buf[..8])),
            Err(Error::BufferTooSmall)
        );
    }
}
