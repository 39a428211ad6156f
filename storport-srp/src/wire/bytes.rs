//! Big-endian field access that cannot panic.
//!
//! Every read goes through `slice::get` and yields zeros when the range is
//! not in the buffer; every write goes through `get_mut` and is dropped when
//! it is not. Views call `check_len` (and `emit` checks the buffer size)
//! before relying on the values, so the fallbacks are never observed by a
//! correct caller -- they only keep a wrong one from bugchecking.

use super::Lun;
use super::iscsi::SerialNumber;

/// A value with a fixed big-endian encoding inside a message.
pub(crate) trait FieldCodec: Sized + Copy {
    /// Encoded size in bytes.
    const SIZE: usize;
    /// Reads the value at byte offset `at`, or the zero value if the buffer
    /// is too short.
    fn read(buf: &[u8], at: usize) -> Self;
    /// Writes the value at byte offset `at`; does nothing if the buffer is
    /// too short.
    fn write(self, buf: &mut [u8], at: usize);
}

/// Copies `N` bytes at `at` out of `buf`, or zeros if they are not there.
#[inline]
pub(crate) fn read_array<const N: usize>(buf: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = at.checked_add(N).and_then(|end| buf.get(at..end)) {
        out.copy_from_slice(src);
    }
    out
}

/// Copies `src` into `buf` at `at`, or does nothing if it does not fit.
#[inline]
pub(crate) fn write_bytes(buf: &mut [u8], at: usize, src: &[u8]) {
    if let Some(dst) = at
        .checked_add(src.len())
        .and_then(|end| buf.get_mut(at..end))
    {
        dst.copy_from_slice(src);
    }
}

/// Zeroes `buf[start..end]` (clamped to the buffer).
#[inline]
pub(crate) fn zero(buf: &mut [u8], start: usize, end: usize) {
    let end = end.min(buf.len());
    if let Some(dst) = buf.get_mut(start..end) {
        dst.fill(0);
    }
}

/// `buf[start..start + len]`, or `None` if any of it is missing (including
/// on arithmetic overflow of a hostile length).
#[inline]
pub(crate) fn sub(buf: &[u8], start: usize, len: usize) -> Option<&[u8]> {
    buf.get(start..start.checked_add(len)?)
}

/// Mutable counterpart of [`sub`].
#[inline]
pub(crate) fn sub_mut(buf: &mut [u8], start: usize, len: usize) -> Option<&mut [u8]> {
    buf.get_mut(start..start.checked_add(len)?)
}

/// Reads the 24-bit big-endian value at `at`.
#[inline]
pub(crate) fn read_be24(buf: &[u8], at: usize) -> u32 {
    let [a, b, c] = read_array::<3>(buf, at);
    u32::from_be_bytes([0, a, b, c])
}

/// Writes the low 24 bits of `value` big-endian at `at`.
#[inline]
pub(crate) fn write_be24(buf: &mut [u8], at: usize, value: u32) {
    let [_, a, b, c] = value.to_be_bytes();
    write_bytes(buf, at, &[a, b, c]);
}

impl FieldCodec for u8 {
    const SIZE: usize = 1;
    #[inline]
    fn read(buf: &[u8], at: usize) -> Self {
        buf.get(at).copied().unwrap_or(0)
    }
    #[inline]
    fn write(self, buf: &mut [u8], at: usize) {
        if let Some(dst) = buf.get_mut(at) {
            *dst = self;
        }
    }
}

macro_rules! be_codec {
    ($($ty:ty),*) => {$(
        impl FieldCodec for $ty {
            const SIZE: usize = core::mem::size_of::<$ty>();
            #[inline]
            fn read(buf: &[u8], at: usize) -> Self {
                <$ty>::from_be_bytes(read_array(buf, at))
            }
            #[inline]
            fn write(self, buf: &mut [u8], at: usize) {
                write_bytes(buf, at, &self.to_be_bytes());
            }
        }
    )*};
}

be_codec!(u16, u32, u64, i32);

impl<const N: usize> FieldCodec for [u8; N] {
    const SIZE: usize = N;
    #[inline]
    fn read(buf: &[u8], at: usize) -> Self {
        read_array(buf, at)
    }
    #[inline]
    fn write(self, buf: &mut [u8], at: usize) {
        write_bytes(buf, at, &self);
    }
}

impl FieldCodec for Lun {
    const SIZE: usize = 8;
    #[inline]
    fn read(buf: &[u8], at: usize) -> Self {
        Lun(read_array(buf, at))
    }
    #[inline]
    fn write(self, buf: &mut [u8], at: usize) {
        write_bytes(buf, at, &self.0);
    }
}

impl FieldCodec for SerialNumber {
    const SIZE: usize = 4;
    #[inline]
    fn read(buf: &[u8], at: usize) -> Self {
        SerialNumber(u32::read(buf, at))
    }
    #[inline]
    fn write(self, buf: &mut [u8], at: usize) {
        self.0.write(buf, at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_big_endian() {
        let buf = [1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(u8::read(&buf, 0), 1);
        assert_eq!(u16::read(&buf, 1), 0x0203);
        assert_eq!(read_be24(&buf, 0), 0x010203);
        assert_eq!(u32::read(&buf, 0), 0x01020304);
        assert_eq!(u64::read(&buf, 1), 0x0203040506070809);
        assert_eq!(i32::read(&[0xff, 0xff, 0xff, 0xfe], 0), -2);
    }

    #[test]
    fn out_of_range_reads_are_zero_and_writes_are_dropped() {
        let mut buf = [0xAAu8; 4];
        assert_eq!(u32::read(&buf, 1), 0);
        assert_eq!(u8::read(&buf, 4), 0);
        assert_eq!(u64::read(&buf, usize::MAX - 2), 0);
        0x1122_3344u32.write(&mut buf, 1);
        0x55u8.write(&mut buf, 9);
        write_be24(&mut buf, usize::MAX, 7);
        assert_eq!(buf, [0xAA; 4]);
        assert_eq!(sub(&buf, 2, usize::MAX), None);
        assert_eq!(sub(&buf, 2, 2), Some(&[0xAA, 0xAA][..]));
    }

    #[test]
    fn writes_round_trip() {
        let mut buf = [0u8; 16];
        0xdead_beef_u32.write(&mut buf, 0);
        write_be24(&mut buf, 4, 0x00ab_cdef);
        (-5i32).write(&mut buf, 8);
        assert_eq!(&buf[..7], &[0xde, 0xad, 0xbe, 0xef, 0xab, 0xcd, 0xef]);
        assert_eq!(read_be24(&buf, 4), 0xabcdef);
        assert_eq!(i32::read(&buf, 8), -5);
        zero(&mut buf, 0, 100);
        assert_eq!(buf, [0; 16]);
    }
}
