//! Total big-endian accessors over byte slices: a short buffer reads as zero
//! and ignores writes instead of panicking (views check their length once, in
//! `check_len`, so these fallbacks are never taken for a checked view).

#![forbid(unsafe_code)]

pub(crate) fn get_u8(b: &[u8], at: usize) -> u8 {
    b.get(at).copied().unwrap_or(0)
}

pub(crate) fn get_be16(b: &[u8], at: usize) -> u16 {
    match b.get(at..at.wrapping_add(2)) {
        Some(&[x0, x1]) => u16::from_be_bytes([x0, x1]),
        _ => 0,
    }
}

pub(crate) fn get_be32(b: &[u8], at: usize) -> u32 {
    match b.get(at..at.wrapping_add(4)) {
        Some(&[x0, x1, x2, x3]) => u32::from_be_bytes([x0, x1, x2, x3]),
        _ => 0,
    }
}

pub(crate) fn get_be64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(at..at.wrapping_add(8)) {
        w.copy_from_slice(s);
    }
    u64::from_be_bytes(w)
}

pub(crate) fn set_u8(b: &mut [u8], at: usize, v: u8) {
    if let Some(x) = b.get_mut(at) {
        *x = v;
    }
}

pub(crate) fn set_be16(b: &mut [u8], at: usize, v: u16) {
    if let Some(s) = b.get_mut(at..at.wrapping_add(2)) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}

pub(crate) fn set_be32(b: &mut [u8], at: usize, v: u32) {
    if let Some(s) = b.get_mut(at..at.wrapping_add(4)) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}

pub(crate) fn set_be64(b: &mut [u8], at: usize, v: u64) {
    if let Some(s) = b.get_mut(at..at.wrapping_add(8)) {
        s.copy_from_slice(&v.to_be_bytes());
    }
}

pub(crate) fn get_array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(s) = b.get(at..at.wrapping_add(N)) {
        out.copy_from_slice(s);
    }
    out
}

pub(crate) fn set_slice(b: &mut [u8], at: usize, v: &[u8]) {
    if let Some(s) = b.get_mut(at..at.wrapping_add(v.len())) {
        s.copy_from_slice(v);
    }
}
