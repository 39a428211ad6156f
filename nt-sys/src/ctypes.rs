//! The C types of the Windows x64 ABI (LLP64), fixed rather than taken from
//! `core::ffi`: there `c_long` follows the *host* (8 bytes on Linux), and the
//! bindings' layout assertions must hold in host unit tests as they do on the
//! kernel target.

#![allow(non_camel_case_types, reason = "the C names, as bindgen expects them")]

/// `char` (signed on MSVC x64).
pub type c_char = i8;
/// `signed char`.
pub type c_schar = i8;
/// `unsigned char`.
pub type c_uchar = u8;
/// `short`.
pub type c_short = i16;
/// `unsigned short`.
pub type c_ushort = u16;
/// `int`.
pub type c_int = i32;
/// `unsigned int`.
pub type c_uint = u32;
/// `long`: 4 bytes under LLP64.
pub type c_long = i32;
/// `unsigned long`: 4 bytes under LLP64.
pub type c_ulong = u32;
/// `long long`.
pub type c_longlong = i64;
/// `unsigned long long`.
pub type c_ulonglong = u64;
/// `void`, for pointers only.
pub use core::ffi::c_void;

static_assertions::assert_eq_size!(c_long, u32);
static_assertions::assert_eq_size!(c_ulong, u32);
