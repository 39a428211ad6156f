//! Wire formats of the initiator's protocols: SRP information units, the iSER
//! header, iSCSI PDUs and the iSCSI login/text `key=value` data.
//!
//! Every message follows one contract, taken from smoltcp:
//!
//! * a *view* `Foo<T: AsRef<[u8]>>` over a byte buffer, with `new_unchecked`,
//!   `check_len` and `new_checked`; getters on `AsRef<[u8]>`, setters on
//!   `AsMut<[u8]>`, field ranges in one private `mod field` per message;
//! * a *repr* `FooRepr` holding validated values, with `parse` (from a view),
//!   `emit` (into a view) and `buffer_len`.
//!
//! Unlike smoltcp, nothing here can panic even without `check_len`: an
//! accessor reads zeros past the end of a short buffer and a setter drops the
//! write. `check_len` is what makes the values *meaningful*; `parse` is what
//! makes them *valid* (it rejects every malformed input with a specific
//! error). `emit` checks the buffer size and the repr's own consistency, so it
//! never writes a message that its own `parse` would reject.
//!
//! # IRQL
//!
//! Everything in this module is pure computation on caller-owned buffers: no
//! allocation, no blocking, no locks. It is callable at any IRQL
//! <= DISPATCH_LEVEL, including the I/O fast path (building an `SRP_CMD` or an
//! iSER SCSI Command PDU in `HwStartIo`).

#![forbid(unsafe_code)]

/// Declares a view type over a byte buffer with plain fixed-offset fields.
///
/// Every field names a range from the module's `field` table and a type that
/// implements [`FieldCodec`]; a compile-time assertion pins the range width to
/// the type's size. Semantic accessors are written by hand next to the macro.
macro_rules! wire_view {
    (
        $(#[$meta:meta])*
        pub struct $name:ident, min_len = $min_len:expr, error = $err:ty, truncated = $truncated:expr;
        $(
            $(#[$fmeta:meta])*
            $get:ident, $set:ident: $ty:ty = $field:expr;
        )*
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps `buffer` without checking its length. Accessors never
            /// panic; past the end of a short buffer they read zeros, so call
            /// `check_len` before trusting them.
            #[inline]
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps `buffer` after `check_len`: from then on every
            /// fixed-field accessor reads bytes that are really there.
            ///
            /// # Errors
            ///
            /// The buffer is shorter than the fixed part of the message.
            #[inline]
            pub fn new_checked(buffer: T) -> ::core::result::Result<Self, $err> {
                let view = Self::new_unchecked(buffer);
                view.check_len()?;
                Ok(view)
            }

            /// Checks that the buffer holds at least the fixed part of the
            /// message (variable parts are checked by their own accessors).
            ///
            /// # Errors
            ///
            /// The buffer is shorter than the fixed part of the message.
            #[inline]
            pub fn check_len(&self) -> ::core::result::Result<(), $err> {
                if self.buffer.as_ref().len() < $min_len {
                    Err($truncated)
                } else {
                    Ok(())
                }
            }

            /// Gives the buffer back.
            #[inline]
            pub fn into_inner(self) -> T {
                self.buffer
            }

            /// The whole underlying buffer, including any bytes past the
            /// message.
            #[inline]
            pub fn as_bytes(&self) -> &[u8] {
                self.buffer.as_ref()
            }

            $(
                $(#[$fmeta])*
                #[inline]
                pub fn $get(&self) -> $ty {
                    <$ty as $crate::wire::bytes::FieldCodec>::read(
                        self.buffer.as_ref(),
                        $field.start,
                    )
                }
            )*
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            /// The whole underlying buffer, mutably.
            #[inline]
            pub fn as_bytes_mut(&mut self) -> &mut [u8] {
                self.buffer.as_mut()
            }

            $(
                #[doc = concat!("Sets the field that [`Self::", stringify!($get), "`] reads.")]
                #[inline]
                pub fn $set(&mut self, value: $ty) {
                    $crate::wire::bytes::FieldCodec::write(
                        value,
                        self.buffer.as_mut(),
                        $field.start,
                    );
                }
            )*
        }

        $(
            const _: () = assert!(
                $field.end - $field.start
                    == <$ty as $crate::wire::bytes::FieldCodec>::SIZE
            );
        )*
    };
}

pub(crate) mod bytes;
pub mod iscsi;
pub mod iser;
pub mod srp;
pub mod text;

#[cfg(test)]
mod test_util;

use core::fmt;

/// A byte range of one field inside a message.
pub(crate) type Field = core::ops::Range<usize>;

/// A SCSI logical unit number as it travels: eight bytes, SAM encoding.
///
/// Both SRP and iSCSI carry the LUN opaquely; only the two helpers below
/// interpret it, for the single-level addressing every target here uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Lun(pub [u8; 8]);

impl Lun {
    /// The LUN of a single-level address: peripheral device addressing for
    /// LUNs below 256, flat space addressing up to 16383 (SAM-5 4.7).
    ///
    /// Returns `None` for LUNs flat space cannot express.
    pub const fn from_index(index: u16) -> Option<Self> {
        let [hi, lo] = index.to_be_bytes();
        if index < 256 {
            Some(Self([0, lo, 0, 0, 0, 0, 0, 0]))
        } else if index < 0x4000 {
            Some(Self([0x40 | hi, lo, 0, 0, 0, 0, 0, 0]))
        } else {
            None
        }
    }

    /// The index of a single-level peripheral or flat-space LUN, `None` for
    /// any other addressing method or a multi-level LUN.
    pub const fn index(&self) -> Option<u16> {
        let [b0, b1, b2, b3, b4, b5, b6, b7] = self.0;
        if b2 != 0 || b3 != 0 || b4 != 0 || b5 != 0 || b6 != 0 || b7 != 0 {
            return None;
        }
        match b0 >> 6 {
            0 if b0 == 0 => Some(b1 as u16),
            1 => Some((((b0 & 0x3f) as u16) << 8) | b1 as u16),
            _ => None,
        }
    }
}

impl fmt::Display for Lun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index() {
            Some(index) => write!(f, "LUN {index}"),
            None => {
                f.write_str("LUN ")?;
                for byte in self.0 {
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
        }
    }
}

/// The residual of one data direction of a SCSI command, as SRP and iSCSI
/// both report it: an overflow or underflow flag plus a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Residual {
    /// Exactly the expected amount was transferred.
    #[default]
    None,
    /// The command wanted this many bytes more than the buffer described.
    Overflow(u32),
    /// This many bytes of the buffer were not transferred.
    Underflow(u32),
}

impl Residual {
    /// The flag (`over` or `under`, or none) and the count to send.
    pub(crate) const fn encode(self, over: u8, under: u8) -> (u8, u32) {
        match self {
            Self::None => (0, 0),
            Self::Overflow(count) => (over, count),
            Self::Underflow(count) => (under, count),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lun_single_level_round_trip() {
        for index in [0u16, 1, 255, 256, 1000, 0x3fff] {
            let lun = Lun::from_index(index).unwrap();
            assert_eq!(lun.index(), Some(index), "{lun:?}");
        }
        assert_eq!(Lun::from_index(0x4000), None);
        assert_eq!(Lun::from_index(5).unwrap().0, [0, 5, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            Lun::from_index(0x123).unwrap().0,
            [0x41, 0x23, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn lun_other_addressing_has_no_index() {
        // Peripheral addressing with a bus number, logical-unit addressing,
        // and a second level all fall outside the single-level helpers.
        assert_eq!(Lun([0x01, 5, 0, 0, 0, 0, 0, 0]).index(), None);
        assert_eq!(Lun([0x80, 5, 0, 0, 0, 0, 0, 0]).index(), None);
        assert_eq!(Lun([0, 5, 0, 1, 0, 0, 0, 0]).index(), None);
        assert_eq!(
            format!("{}", Lun([0x80, 5, 0, 0, 0, 0, 0, 0])),
            "LUN 8005000000000000"
        );
        assert_eq!(format!("{}", Lun::from_index(7).unwrap()), "LUN 7");
    }
}
