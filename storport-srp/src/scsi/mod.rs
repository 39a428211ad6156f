//! The transport-independent SCSI layer shared by the initiator and the
//! software targets: operation codes, status codes, sense data, command
//! descriptor blocks, and the parameter data of the few commands an
//! initiator itself interprets (READ CAPACITY, INQUIRY, REPORT LUNS).
//!
//! The references are T10 SAM-5, SPC-4 and SBC-3. Only what a block device
//! initiator and a RAM-disk target need is here, but what is here is complete
//! for its part: every sense key, every sense descriptor a block device uses,
//! every field of the decoded CDBs.
//!
//! The contracts match [`crate::wire`]:
//!
//! * byte layouts are views `Foo<T: AsRef<[u8]>>` with `new_unchecked`,
//!   `check_len` and `new_checked`, whose accessors never panic (past the end
//!   of a short buffer they read zeros and setters drop the write);
//! * decoded values are `*Repr` types with `parse`, `emit` and `buffer_len`;
//!   `parse` is total and gives every malformed input a specific error,
//!   `emit` never writes bytes its own `parse` would reject.
//!
//! Values that come from the wire but are open-ended sets (operation codes,
//! status bytes, ASC/ASCQ pairs) are newtypes over the raw value with named
//! constants, so that an unknown value survives a round trip unchanged.
//!
//! # IRQL
//!
//! Everything in this module is pure computation on caller-owned buffers: no
//! allocation, no blocking, no locks. It is callable at any IRQL
//! <= DISPATCH_LEVEL, including `HwStartIo` and the completion DPC.

#![forbid(unsafe_code)]

pub mod cdb;
pub mod data;
pub mod opcode;
pub mod sense;
pub mod status;

#[cfg(test)]
mod tests;

pub use crate::wire::Lun;
pub use cdb::{
    Cdb, CdbError, CdbRepr, CdbSize, InquiryCdb, ModeSenseCdb, PageControl, ReadCapacity10Cdb,
    ReadCapacity16Cdb, ReadWriteCdb, ReportLunsCdb, RequestSenseCdb, SynchronizeCacheCdb, UnmapCdb,
    VerifyCdb,
};
pub use data::{
    DataError, PERIPHERAL_NO_LUN, ReadCapacity10Data, ReadCapacity10Repr, ReadCapacity16Data,
    ReadCapacity16Repr, ReportLunsData, StandardInquiry, StandardInquiryRepr, ascii_field,
    emit_report_luns, report_luns_len,
};
pub use opcode::Opcode;
pub use sense::{
    AdditionalSense, DescriptorSenseHeader, FixedSense, SenseError, SenseFormat, SenseKey,
    SenseRepr,
};
pub use status::Status;

/// Which way a command moves data, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataDirection {
    /// No data phase.
    None,
    /// Target to initiator (DATA-IN: reads, INQUIRY, MODE SENSE...).
    In,
    /// Initiator to target (DATA-OUT: writes, UNMAP, MODE SELECT...).
    Out,
}

/// The place of a field in a CDB or parameter list, as the sense-key
/// specific "field pointer" reports it (SPC-4 4.5.2.4.2): the byte, and the
/// most significant bit of the field when it does not start at bit 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FieldPointer {
    /// Byte offset of the field (of its most significant byte).
    pub byte: u16,
    /// The field's most significant bit (0..=7), when it is narrower than a
    /// byte or does not start at bit 7; `None` for whole-byte fields.
    pub bit: Option<u8>,
}

impl FieldPointer {
    /// A field made of whole bytes starting at `byte`.
    pub const fn byte(byte: u16) -> Self {
        Self { byte, bit: None }
    }

    /// A field whose most significant bit is `bit` of byte `byte`. A `bit`
    /// above 7 is clamped to 7.
    pub const fn bit(byte: u16, bit: u8) -> Self {
        Self {
            byte,
            bit: Some(if bit > 7 { 7 } else { bit }),
        }
    }
}

/// Declares a fixed-layout view over a byte buffer: the smoltcp view
/// contract, with accessors over the big-endian field codecs of
/// [`crate::wire`]. Each field names a range and a type; a compile-time
/// assertion pins the range width to the type's size.
macro_rules! scsi_view {
    (
        $(#[$meta:meta])*
        pub struct $name:ident, min_len = $min_len:expr, error: $errty:ty = $err:expr;
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
            /// panic; past the end of a short buffer they read zeros.
            #[inline]
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps `buffer` after [`Self::check_len`].
            ///
            /// # Errors
            ///
            /// The buffer is shorter than the fixed layout.
            #[inline]
            pub fn new_checked(buffer: T) -> ::core::result::Result<Self, $errty> {
                let view = Self::new_unchecked(buffer);
                view.check_len()?;
                Ok(view)
            }

            /// Checks that the buffer holds the whole fixed layout.
            ///
            /// # Errors
            ///
            /// The buffer is shorter than the fixed layout.
            #[inline]
            pub fn check_len(&self) -> ::core::result::Result<(), $errty> {
                if self.buffer.as_ref().len() < $min_len {
                    Err($err)
                } else {
                    Ok(())
                }
            }

            /// Gives the buffer back.
            #[inline]
            pub fn into_inner(self) -> T {
                self.buffer
            }

            /// The whole underlying buffer.
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

pub(crate) use scsi_view;
