//! Total big-endian field accessors for wire views.
//!
//! Views read and write fixed fields through these helpers rather than by
//! indexing, so an accessor can never panic (a panic in the kernel is a
//! bugcheck): a read that falls outside the buffer yields zero and a write
//! that falls outside is dropped. `new_checked` on a view guarantees neither
//! happens; the fallback only matters for views made with `new_unchecked`.
//!
//! They are public so that the other wire modules of the workspace (CM MADs
//! in `kverbs`, SRP and iSER in `storport-srp`) share one implementation.

use core::ops::{Range, RangeFrom};

/// A fixed field: a byte range within a header.
pub type Field = Range<usize>;
/// The rest of a buffer from an offset: a payload.
pub type Rest = RangeFrom<usize>;

/// The `N` bytes at `field`, or zeroes when the field is not wholly inside `buf`.
#[inline]
pub fn read_array<const N: usize>(buf: &[u8], field: Field) -> [u8; N] {
    buf.get(field)
        .and_then(|bytes| <[u8; N]>::try_from(bytes).ok())
        .unwrap_or([0; N])
}

/// The byte at `at`, or zero.
#[inline]
pub fn read_u8(buf: &[u8], at: usize) -> u8 {
    buf.get(at).copied().unwrap_or(0)
}

/// The big-endian `u16` at `field` (two bytes), or zero.
#[inline]
pub fn read_be16(buf: &[u8], field: Field) -> u16 {
    u16::from_be_bytes(read_array(buf, field))
}

/// The big-endian 24-bit value at `field` (three bytes), or zero.
#[inline]
pub fn read_be24(buf: &[u8], field: Field) -> u32 {
    let [a, b, c] = read_array::<3>(buf, field);
    u32::from_be_bytes([0, a, b, c])
}

/// The big-endian `u32` at `field` (four bytes), or zero.
#[inline]
pub fn read_be32(buf: &[u8], field: Field) -> u32 {
    u32::from_be_bytes(read_array(buf, field))
}

/// The big-endian `u64` at `field` (eight bytes), or zero.
#[inline]
pub fn read_be64(buf: &[u8], field: Field) -> u64 {
    u64::from_be_bytes(read_array(buf, field))
}

/// Copy `bytes` into `field`; dropped unless the field lies wholly inside
/// `buf` and has exactly `bytes.len()` bytes.
#[inline]
pub fn write_bytes(buf: &mut [u8], field: Field, bytes: &[u8]) {
    if let Some(dst) = buf.get_mut(field) {
        if dst.len() == bytes.len() {
            dst.copy_from_slice(bytes);
        }
    }
}

/// Store `value` at `at`; dropped when `at` is outside `buf`.
#[inline]
pub fn write_u8(buf: &mut [u8], at: usize, value: u8) {
    if let Some(dst) = buf.get_mut(at) {
        *dst = value;
    }
}

/// Store `value` big-endian in the two bytes of `field`.
#[inline]
pub fn write_be16(buf: &mut [u8], field: Field, value: u16) {
    write_bytes(buf, field, &value.to_be_bytes());
}

/// Store the low 24 bits of `value` big-endian in the three bytes of `field`.
#[inline]
pub fn write_be24(buf: &mut [u8], field: Field, value: u32) {
    let [_, a, b, c] = value.to_be_bytes();
    write_bytes(buf, field, &[a, b, c]);
}

/// Store `value` big-endian in the four bytes of `field`.
#[inline]
pub fn write_be32(buf: &mut [u8], field: Field, value: u32) {
    write_bytes(buf, field, &value.to_be_bytes());
}

/// Store `value` big-endian in the eight bytes of `field`.
#[inline]
pub fn write_be64(buf: &mut [u8], field: Field, value: u64) {
    write_bytes(buf, field, &value.to_be_bytes());
}

/// Replace the bits of `mask` in the byte at `at` with those of `value`.
///
/// `value` is given already shifted into place; bits outside `mask` are ignored.
#[inline]
pub fn write_bits_u8(buf: &mut [u8], at: usize, mask: u8, value: u8) {
    let old = read_u8(buf, at);
    write_u8(buf, at, (old & !mask) | (value & mask));
}

/// The bytes of `rest`, or an empty slice when it starts beyond the buffer.
#[inline]
pub fn rest(buf: &[u8], rest: Rest) -> &[u8] {
    buf.get(rest).unwrap_or(&[])
}

/// The bytes of `field`, or an empty slice when it is not wholly inside `buf`.
#[inline]
pub fn slice(buf: &[u8], field: Field) -> &[u8] {
    buf.get(field).unwrap_or(&[])
}

/// The mutable bytes of `field`, or an empty slice when it is not wholly inside `buf`.
#[inline]
pub fn slice_mut(buf: &mut [u8], field: Field) -> &mut [u8] {
    buf.get_mut(field).unwrap_or(&mut [])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_in_bounds_are_big_endian() {
        let buf = [0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08];
        assert_eq!(read_u8(&buf, 7), 0x08);
        assert_eq!(read_be16(&buf, 0..2), 0x0102);
        assert_eq!(read_be24(&buf, 1..4), 0x02_0304);
        assert_eq!(read_be32(&buf, 4..8), 0x0506_0708);
        assert_eq!(read_be64(&buf, 0..8), 0x0102_0304_0506_0708);
    }

    #[test]
    fn reads_out_of_bounds_yield_zero() {
        let buf = [0xffu8; 3];
        assert_eq!(read_u8(&buf, 3), 0);
        assert_eq!(read_be32(&buf, 0..4), 0);
        assert_eq!(read_be16(&buf, 2..4), 0);
        assert_eq!(rest(&buf, 4..), &[] as &[u8]);
        assert_eq!(slice(&buf, 1..9), &[] as &[u8]);
    }

    #[test]
    fn writes_out_of_bounds_are_dropped() {
        let mut buf = [0u8; 3];
        write_be32(&mut buf, 0..4, 0xdead_beef);
        write_u8(&mut buf, 3, 1);
        assert_eq!(buf, [0, 0, 0]);
        // A field whose width differs from the value is not written either.
        write_bytes(&mut buf, 0..3, &[1, 2]);
        assert_eq!(buf, [0, 0, 0]);
        write_be24(&mut buf, 0..3, 0xaa_bbcc);
        assert_eq!(buf, [0xaa, 0xbb, 0xcc]);
        write_bits_u8(&mut buf, 0, 0x0f, 0x05);
        assert_eq!(buf[0], 0xa5);
    }
}
