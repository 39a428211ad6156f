//! The smoltcp-style view boilerplate shared by every format module.

#![forbid(unsafe_code)]

use core::fmt;

/// Why a byte buffer is not a valid instance of a hardware format.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FormatError {
    /// The buffer is shorter than the format.
    Truncated,
    /// A send WQE's opcode is not one this device executes.
    UnknownOpcode(u8),
    /// A CQE's opcode nibble is not a defined CQE opcode.
    UnknownCqeOpcode(u8),
    /// The control segment's `ds` is zero or larger than the WQE allows.
    BadDescriptorCount(u8),
    /// A segment the opcode requires is missing (the WQE is too short for it).
    MissingSegment,
    /// An inline segment's length runs past the end of the WQE, or inline data
    /// is mixed with pointer segments.
    BadInline,
    /// More data segments than the format allows.
    TooManySegments,
    /// A fast-registration segment is inconsistent (page shift out of range,
    /// page count zero or larger than the list, length beyond the pages).
    BadRegistration,
    /// The WQE does not fit (building) — more segments than `ds` can count.
    WqeTooLarge,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => f.write_str("buffer too short for the format"),
            Self::UnknownOpcode(op) => write!(f, "unknown send WQE opcode {op:#04x}"),
            Self::UnknownCqeOpcode(op) => write!(f, "unknown CQE opcode {op:#x}"),
            Self::BadDescriptorCount(ds) => write!(f, "bad WQE descriptor count {ds}"),
            Self::MissingSegment => f.write_str("WQE lacks a segment its opcode requires"),
            Self::BadInline => f.write_str("malformed inline data segment"),
            Self::TooManySegments => f.write_str("too many data segments"),
            Self::BadRegistration => f.write_str("inconsistent fast-registration segment"),
            Self::WqeTooLarge => f.write_str("WQE exceeds the maximum size"),
        }
    }
}

/// Declares a view type `Name<T: AsRef<[u8]>>` of a fixed-size format with
/// `new_unchecked`, `check_len`, `new_checked` and `into_inner`.
macro_rules! fixed_view {
    ($(#[$meta:meta])* $name:ident, $len:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps `buffer` without checking its length (accessors on a
            /// short buffer read zero and ignore writes; they never panic).
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps `buffer` after [`Self::check_len`].
            ///
            /// # Errors
            /// [`FormatError::Truncated`] if the buffer is too short.
            pub fn new_checked(buffer: T) -> Result<Self, $crate::view::FormatError> {
                let v = Self::new_unchecked(buffer);
                v.check_len()?;
                Ok(v)
            }

            /// Checks that the buffer holds the whole format; afterwards no
            /// accessor can fail.
            ///
            /// # Errors
            /// [`FormatError::Truncated`] if the buffer is too short.
            pub fn check_len(&self) -> Result<(), $crate::view::FormatError> {
                if self.buffer.as_ref().len() < $len {
                    Err($crate::view::FormatError::Truncated)
                } else {
                    Ok(())
                }
            }

            /// Returns the underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

pub(crate) use fixed_view;
