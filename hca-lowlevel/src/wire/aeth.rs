//! ACK Extended Transport Header (4 bytes): syndrome and MSN.
//!
//! ```text
//!  byte 0    syndrome: reserved(1) | type(2) | value(5)
//!              type 00 ACK      value = credit count (31: not valid / unlimited)
//!              type 01 RNR NAK  value = RNR timer code
//!              type 10 reserved
//!              type 11 NAK      value = NAK code
//!  bytes 1-3 MSN (24 bits)
//! ```

use core::fmt;

use super::bytes::{self, Field};
use super::{Error, Msn, Result};

mod field {
    use super::Field;
    pub const SYNDROME: usize = 0;
    pub const MSN: Field = 1..4;
}

/// The AETH length.
pub const HEADER_LEN: usize = field::MSN.end;
static_assertions::const_assert_eq!(HEADER_LEN, 4);

const TYPE_MASK: u8 = 0x60;
const VALUE_MASK: u8 = 0x1f;
const TYPE_ACK: u8 = 0x00;
const TYPE_RNR_NAK: u8 = 0x20;
const TYPE_NAK: u8 = 0x60;

macro_rules! five_bit_code {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(u8);

        impl $name {
            /// The code, or `None` when it does not fit in five bits.
            pub const fn new(code: u8) -> Option<Self> {
                if code <= VALUE_MASK { Some(Self(code)) } else { None }
            }

            /// The low five bits of `code`.
            pub const fn from_low_bits(code: u8) -> Self {
                Self(code & VALUE_MASK)
            }

            /// The code (0..=31).
            pub const fn get(self) -> u8 {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }
    };
}

five_bit_code! {
    /// The credit count of an ACK: the responder's free receive WQEs,
    /// encoded logarithmically (IBA 9.7.5.1.4).
    CreditCount
}

impl CreditCount {
    /// "Credit count not valid": the responder does not do end-to-end flow
    /// control (rxe always sends this).
    pub const INVALID: Self = Self(31);
}

five_bit_code! {
    /// An RNR NAK timer code: how long the requester waits before retrying
    /// (IBA table 45).
    RnrTimer
}

impl RnrTimer {
    /// Microseconds for each code, code 0 being the longest (655.36 ms).
    const MICROS: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];

    /// The delay this code asks for, in microseconds.
    pub fn as_micros(self) -> u32 {
        Self::MICROS.get(usize::from(self.0)).copied().unwrap_or(0)
    }

    /// The shortest timer code whose delay is at least `micros`; code 0
    /// (655.36 ms, the longest) when none of the others reaches it.
    pub fn at_least_micros(micros: u32) -> RnrTimer {
        (1u8..32)
            .map(RnrTimer)
            .find(|code| code.as_micros() >= micros)
            .unwrap_or(RnrTimer(0))
    }
}

five_bit_code! {
    /// A NAK code. Codes the IBA reserves are kept as received, so the
    /// requester decides what an unknown NAK means (rxe: remote operational
    /// error) instead of the parser dropping it.
    NakCode
}

impl NakCode {
    /// PSN sequence error: the responder expected another PSN (in the BTH).
    pub const PSN_SEQUENCE_ERROR: Self = Self(0);
    /// Invalid request (class C error).
    pub const INVALID_REQUEST: Self = Self(1);
    /// Remote access error: bad R_Key, range or access rights.
    pub const REMOTE_ACCESS_ERROR: Self = Self(2);
    /// Remote operational error.
    pub const REMOTE_OPERATIONAL_ERROR: Self = Self(3);
    /// Invalid RD request (RD only).
    pub const INVALID_RD_REQUEST: Self = Self(4);

    /// The code is one the IBA reserves (5..=31).
    pub const fn is_reserved(self) -> bool {
        self.0 > 4
    }
}

/// The meaning of an AETH syndrome byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AethSyndrome {
    /// Positive acknowledgement.
    Ack(CreditCount),
    /// Receiver not ready: retry after the timer.
    RnrNak(RnrTimer),
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl AethSyndrome {
    /// The syndrome byte (reserved bit 7 clear).
    pub const fn to_u8(self) -> u8 {
        match self {
            AethSyndrome::Ack(c) => TYPE_ACK | c.0,
            AethSyndrome::RnrNak(t) => TYPE_RNR_NAK | t.0,
            AethSyndrome::Nak(n) => TYPE_NAK | n.0,
        }
    }

    /// Decode a syndrome byte; the reserved bit 7 is ignored.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedAethSyndrome`] for type `0b10`.
    pub const fn from_u8(byte: u8) -> Result<AethSyndrome> {
        let value = byte & VALUE_MASK;
        match byte & TYPE_MASK {
            TYPE_ACK => Ok(AethSyndrome::Ack(CreditCount(value))),
            TYPE_RNR_NAK => Ok(AethSyndrome::RnrNak(RnrTimer(value))),
            TYPE_NAK => Ok(AethSyndrome::Nak(NakCode(value))),
            _ => Err(Error::ReservedAethSyndrome(byte)),
        }
    }
}

fixed_view! {
    /// A view of an AETH at the start of a buffer.
    Aeth, HEADER_LEN
}

impl<T: AsRef<[u8]>> Aeth<T> {
    /// The raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        bytes::read_u8(self.buffer.as_ref(), field::SYNDROME)
    }

    /// The decoded syndrome.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedAethSyndrome`].
    pub fn syndrome(&self) -> Result<AethSyndrome> {
        AethSyndrome::from_u8(self.syndrome_raw())
    }

    /// Message sequence number.
    pub fn msn(&self) -> Msn {
        Msn::from_low_bits(bytes::read_be24(self.buffer.as_ref(), field::MSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Aeth<T> {
    /// Set the syndrome.
    pub fn set_syndrome(&mut self, syndrome: AethSyndrome) {
        bytes::write_u8(self.buffer.as_mut(), field::SYNDROME, syndrome.to_u8());
    }

    /// Set the message sequence number.
    pub fn set_msn(&mut self, msn: Msn) {
        bytes::write_be24(self.buffer.as_mut(), field::MSN, msn.get());
    }
}

/// The meaning of an AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// ACK, RNR NAK or NAK, with its value.
    pub syndrome: AethSyndrome,
    /// The responder's count of completed messages.
    pub msn: Msn,
}

impl AethRepr {
    /// Parse an AETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::ReservedAethSyndrome`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Aeth<&T>) -> Result<AethRepr> {
        header.check_len()?;
        Ok(AethRepr {
            syndrome: header.syndrome()?,
            msn: header.msn(),
        })
    }

    /// The length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut Aeth<T>) {
        header.set_syndrome(self.syndrome);
        header.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_unlimited_credits() {
        let bytes = [0x1f, 0x00, 0x00, 0x05];
        let repr = AethRepr::parse(&Aeth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(repr.syndrome, AethSyndrome::Ack(CreditCount::INVALID));
        assert_eq!(repr.msn.get(), 5);
        let mut out = [0u8; 4];
        repr.emit(&mut Aeth::new_unchecked(&mut out[..]));
        assert_eq!(out, bytes);
    }

    #[test]
    fn nak_codes_and_rnr() {
        let syn = |b: u8| AethSyndrome::from_u8(b);
        assert_eq!(
            syn(0x60),
            Ok(AethSyndrome::Nak(NakCode::PSN_SEQUENCE_ERROR))
        );
        assert_eq!(syn(0x61), Ok(AethSyndrome::Nak(NakCode::INVALID_REQUEST)));
        assert_eq!(
            syn(0x62),
            Ok(AethSyndrome::Nak(NakCode::REMOTE_ACCESS_ERROR))
        );
        assert_eq!(
            syn(0x63),
            Ok(AethSyndrome::Nak(NakCode::REMOTE_OPERATIONAL_ERROR))
        );
        assert_eq!(
            syn(0x64),
            Ok(AethSyndrome::Nak(NakCode::INVALID_RD_REQUEST))
        );
        // A reserved NAK code is kept, not refused.
        let reserved = syn(0x6a).unwrap();
        assert!(matches!(reserved, AethSyndrome::Nak(c) if c.is_reserved() && c.get() == 10));
        assert_eq!(
            syn(0x2e),
            Ok(AethSyndrome::RnrNak(RnrTimer::new(14).unwrap()))
        );
        // Bit 7 is reserved and ignored.
        assert_eq!(syn(0x9f), syn(0x1f));
        assert_eq!(syn(0x45), Err(Error::ReservedAethSyndrome(0x45)));
        for byte in 0..=255u8 {
            if let Ok(s) = syn(byte) {
                assert_eq!(s.to_u8(), byte & 0x7f);
            }
        }
    }

    #[test]
    fn rnr_timer_table() {
        let t = |c: u8| RnrTimer::new(c).unwrap().as_micros();
        assert_eq!(t(0), 655_360);
        assert_eq!(t(1), 10);
        assert_eq!(t(14), 1_280); // tshark: "1.28 ms"
        assert_eq!(t(31), 491_520);
        assert_eq!(RnrTimer::at_least_micros(1_000).get(), 14);
        assert_eq!(RnrTimer::at_least_micros(0).get(), 1);
        assert_eq!(RnrTimer::at_least_micros(500_000).get(), 0);
        assert_eq!(RnrTimer::new(32), None);
        assert_eq!(RnrTimer::from_low_bits(0xff).get(), 31);
    }

    #[test]
    fn truncated_and_reserved_type() {
        let bytes = [0x40, 0, 0, 0];
        assert_eq!(
            Aeth::new_checked(&bytes[..3]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            AethRepr::parse(&Aeth::new_unchecked(&bytes[..])),
            Err(Error::ReservedAethSyndrome(0x40))
        );
    }
}
