//! CHAP as iSCSI uses it (RFC 7143 §12.1.3, RFC 1994): the response is
//! `MD5(identifier ‖ secret ‖ challenge)`; binary values travel as
//! `0x` + hex or `0b` + base64 (RFC 7143 §6.1).
//!
//! Only MD5 (`CHAP_A=5`) is implemented; it is what every target speaks.

use md5::{Digest, Md5};

/// `CHAP_A` value of MD5.
pub const ALGORITHM_MD5: u8 = 5;
/// Size of an MD5 response.
pub const RESPONSE_LEN: usize = 16;
/// Largest binary value (a CHAP challenge) accepted: 1024 bytes.
pub const MAX_BINARY_LEN: usize = 1024;

/// Why a binary value did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryError {
    /// Neither `0x`/`0X` nor `0b`/`0B` in front.
    NoPrefix,
    /// No digits after the prefix.
    Empty,
    /// A character that is not a digit of the encoding, or misplaced `=`
    /// padding.
    BadDigit,
    /// Base64 whose last group leaves set bits behind.
    TrailingBits,
    /// More bytes than the output holds.
    TooLong,
}

/// The CHAP response to `challenge` with `identifier` and `secret`.
#[must_use]
pub fn response(identifier: u8, secret: &[u8], challenge: &[u8]) -> [u8; RESPONSE_LEN] {
    let mut md5 = Md5::new();
    md5.update([identifier]);
    md5.update(secret);
    md5.update(challenge);
    md5.finalize().into()
}

/// Constant-time equality of two responses (no early exit a target could
/// time).
#[must_use]
pub fn responses_equal(a: &[u8; RESPONSE_LEN], b: &[u8]) -> bool {
    if b.len() != RESPONSE_LEN {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn base64_value(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decodes a binary value into `out` and returns the bytes written. An odd
/// number of hex digits has an implied leading zero (RFC 7143 §6.1).
///
/// # Errors
///
/// [`BinaryError`].
pub fn decode_binary<'o>(text: &str, out: &'o mut [u8]) -> Result<&'o [u8], BinaryError> {
    let bytes = text.as_bytes();
    let (kind, digits) = match bytes {
        [b'0', b'x' | b'X', rest @ ..] => (16, rest),
        [b'0', b'b' | b'B', rest @ ..] => (64, rest),
        _ => return Err(BinaryError::NoPrefix),
    };
    if digits.is_empty() {
        return Err(BinaryError::Empty);
    }
    let mut len = 0usize;
    let mut push = |byte: u8| -> Result<(), BinaryError> {
        let slot = out.get_mut(len).ok_or(BinaryError::TooLong)?;
        *slot = byte;
        len += 1;
        Ok(())
    };
    if kind == 16 {
        let mut high: Option<u8> = if digits.len() % 2 == 1 { Some(0) } else { None };
        for &c in digits {
            let v = hex_value(c).ok_or(BinaryError::BadDigit)?;
            match high.take() {
                Some(h) => push((h << 4) | v)?,
                None => high = Some(v),
            }
        }
    } else {
        let data_len = digits
            .iter()
            .position(|&c| c == b'=')
            .unwrap_or(digits.len());
        let (data, padding) = digits.split_at(data_len);
        if padding.len() > 2 || padding.iter().any(|&c| c != b'=') {
            return Err(BinaryError::BadDigit);
        }
        let mut acc: u32 = 0;
        let mut bits = 0u32;
        for &c in data {
            let v = base64_value(c).ok_or(BinaryError::BadDigit)?;
            acc = (acc << 6) | u32::from(v);
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                // The shift leaves exactly one byte.
                push(((acc >> bits) & 0xFF) as u8)?;
                acc &= (1 << bits) - 1;
            }
        }
        if acc != 0 {
            return Err(BinaryError::TrailingBits);
        }
    }
    let written = len;
    out.get(..written).ok_or(BinaryError::TooLong)
}

/// Writes `0x` and lower-case hex of `bytes` into `out` and returns the
/// text, `None` if `out` is too small.
pub fn encode_hex<'o>(bytes: &[u8], out: &'o mut [u8]) -> Option<&'o str> {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let len = 2 + 2 * bytes.len();
    let dst = out.get_mut(..len)?;
    let (prefix, body) = dst.split_at_mut(2);
    prefix.copy_from_slice(b"0x");
    for (pair, &b) in body.chunks_exact_mut(2).zip(bytes) {
        if let [hi, lo] = pair {
            *hi = DIGITS.get(usize::from(b >> 4)).copied().unwrap_or(b'0');
            *lo = DIGITS.get(usize::from(b & 0xF)).copied().unwrap_or(b'0');
        }
    }
    core::str::from_utf8(out.get(..len)?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> [u8; 16] {
        let mut out = [0u8; 16];
        let mut buf = [0u8; 16];
        let text = format!("0x{s}");
        out.copy_from_slice(decode_binary(&text, &mut buf).unwrap());
        out
    }

    /// RFC 1321's test suite, fed through the CHAP concatenation
    /// (identifier byte, secret, challenge).
    #[test]
    fn md5_known_vectors() {
        assert_eq!(
            response(b'a', b"", b""),
            hex("0cc175b9c0f1b6a831c399e269772661")
        );
        assert_eq!(
            response(b'a', b"b", b"c"),
            hex("900150983cd24fb0d6963f7d28e17f72")
        );
        assert_eq!(
            response(b'm', b"essage ", b"digest"),
            hex("f96b697d7cb7938d525a2f31aaf161d0")
        );
        assert_eq!(
            response(b'a', b"bcdefghijklm", b"nopqrstuvwxyz"),
            hex("c3fcd3d76192e4007dfb496cca67e13b")
        );
        let digits =
            b"12345678901234567890123456789012345678901234567890123456789012345678901234567890";
        assert_eq!(
            response(b'1', &digits[1..40], &digits[40..]),
            hex("57edf4a22be3c955ac49da2e2107b67a")
        );
    }

    #[test]
    fn chap_response_with_binary_identifier() {
        // Identifier 0x01, secret "secretsecret", challenge 00 01 .. 0f,
        // computed independently with Python's hashlib.md5.
        let challenge: [u8; 16] = core::array::from_fn(|i| i as u8);
        let r = response(1, b"secretsecret", &challenge);
        assert_eq!(r, hex("226dc576c33f04ff9c3a200ffe35f442"));
        assert!(responses_equal(&r, &r));
        let mut other = r;
        other[15] ^= 1;
        assert!(!responses_equal(&r, &other));
        assert!(!responses_equal(&r, &r[..15]));
    }

    #[test]
    fn binary_values() {
        let mut buf = [0u8; 8];
        assert_eq!(decode_binary("0x0102ff", &mut buf), Ok(&[1u8, 2, 0xff][..]));
        assert_eq!(decode_binary("0XABC", &mut buf), Ok(&[0x0a, 0xbc][..]));
        assert_eq!(decode_binary("0bAQL/", &mut buf), Ok(&[1, 2, 0xff][..]));
        assert_eq!(decode_binary("0BAQI=", &mut buf), Ok(&[1, 2][..]));
        assert_eq!(decode_binary("0bAQ==", &mut buf), Ok(&[1][..]));
        assert_eq!(
            decode_binary("0bAR==", &mut buf),
            Err(BinaryError::TrailingBits)
        );
        assert_eq!(decode_binary("0b=A", &mut buf), Err(BinaryError::BadDigit));
        assert_eq!(decode_binary("0x", &mut buf), Err(BinaryError::Empty));
        assert_eq!(decode_binary("12", &mut buf), Err(BinaryError::NoPrefix));
        assert_eq!(decode_binary("0x1g", &mut buf), Err(BinaryError::BadDigit));
        assert_eq!(
            decode_binary("0x000102030405060708", &mut buf),
            Err(BinaryError::TooLong)
        );
        let mut text = [0u8; 8];
        assert_eq!(encode_hex(&[0xab, 0x01, 0x2c], &mut text), Some("0xab012c"));
        let mut small = [0u8; 9];
        assert_eq!(encode_hex(&[1, 2, 3, 4], &mut small), None);
    }
}
