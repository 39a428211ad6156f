//! `SRP_T_LOGOUT` (16 bytes): the target ends the channel. (Linux `ib_srp`
//! only logs it.)

use static_assertions::const_assert_eq;

use super::{Error, Opcode, Result, SOLNT, check_emit_len, expect_opcode};
use crate::wire::bytes;

mod field {
    use crate::wire::Field;

    pub const OPCODE: Field = 0..1;
    pub const SOL_NOT: Field = 1..2;
    pub const REASON: Field = 4..8;
    pub const TAG: Field = 8..16;
}

/// Size of `SRP_T_LOGOUT`.
pub const LEN: usize = field::TAG.end;
const_assert_eq!(LEN, 16);

/// The value of an `SRP_T_LOGOUT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TLogoutRepr {
    /// `SOLNT`: sent with the solicited-event bit.
    pub solicited: bool,
    /// The target's reason code, kept as received (Linux assigns it no
    /// meaning).
    pub reason: u32,
    /// Tag.
    pub tag: u64,
}

impl TLogoutRepr {
    /// Parses a target logout.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`].
    pub fn parse<T: AsRef<[u8]>>(iu: &TLogout<T>) -> Result<Self> {
        iu.check_len()?;
        expect_opcode(iu.opcode(), Opcode::TLogout)?;
        Ok(Self {
            solicited: iu.sol_not() & SOLNT != 0,
            reason: iu.reason(),
            tag: iu.tag(),
        })
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
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, iu: &mut TLogout<T>) -> Result<()> {
        check_emit_len(iu.as_bytes(), LEN)?;
        bytes::zero(iu.as_bytes_mut(), 0, LEN);
        iu.set_opcode(Opcode::TLogout as u8);
        iu.set_sol_not(if self.solicited { SOLNT } else { 0 });
        iu.set_reason(self.reason);
        iu.set_tag(self.tag);
        Ok(())
    }
}

wire_view! {
    /// A view of `SRP_T_LOGOUT` (`srp_t_logout`).
    pub struct TLogout, min_len = LEN, error = Error, truncated = Error::Truncated;
    /// IU type byte (0x80).
    opcode, set_opcode: u8 = field::OPCODE;
    /// Raw `sol_not` byte.
    sol_not, set_sol_not: u8 = field::SOL_NOT;
    /// Reason code.
    reason, set_reason: u32 = field::REASON;
    /// Tag.
    tag, set_tag: u64 = field::TAG;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_bytes_and_malformed() {
        let repr = TLogoutRepr {
            solicited: true,
            reason: 2,
            tag: 9,
        };
        let mut buf = [0xEEu8; 16];
        repr.emit(&mut TLogout::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, [0x80, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(
            TLogoutRepr::parse(&TLogout::new_unchecked(&buf[..])),
            Ok(repr)
        );
        assert_eq!(
            TLogoutRepr::parse(&TLogout::new_unchecked(&buf[..15])),
            Err(Error::Truncated)
        );
        buf[0] = 0x03;
        assert_eq!(
            TLogoutRepr::parse(&TLogout::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x03))
        );
        assert_eq!(
            repr.emit(&mut TLogout::new_unchecked(&mut buf[..15])),
            Err(Error::BufferTooSmall)
        );
    }
}
