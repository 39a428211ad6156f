//! A minimal pcap writer: what a link sent and received, for Wireshark and
//! `tshark -r` (which decode UDP port 4791 as RoCEv2 InfiniBand).
//!
//! The classic libpcap format is small enough to write by hand: a 24-byte
//! file header, then a 16-byte record header before every frame. The
//! nanosecond-resolution variant (magic `0xa1b23c4d`) is used so the
//! virtual clock of a stepped fabric keeps its resolution; every reader
//! since libpcap 1.5 and Wireshark 1.8 understands it. Fields are written
//! little-endian, which the magic number tells readers.

use std::io::{self, Write};

/// Magic number of a pcap file with nanosecond timestamps.
pub const PCAP_MAGIC_NANOS: u32 = 0xa1b2_3c4d;
/// Link type of Ethernet II frames (`LINKTYPE_ETHERNET`).
pub const LINKTYPE_ETHERNET: u32 = 1;
/// Largest frame captured whole; longer frames are truncated to it (and
/// the record keeps the original length, as libpcap does).
pub const SNAPLEN: u32 = 65_535;
/// Length of the file header.
pub const FILE_HEADER_LEN: usize = 24;
/// Length of a record header.
pub const RECORD_HEADER_LEN: usize = 16;

/// Writes Ethernet frames into a pcap stream.
pub struct PcapWriter<W: Write> {
    out: W,
    frames: u64,
}

impl<W: Write> PcapWriter<W> {
    /// Writes the file header.
    ///
    /// # Errors
    /// Those of the underlying writer.
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut header = [0u8; FILE_HEADER_LEN];
        header[0..4].copy_from_slice(&PCAP_MAGIC_NANOS.to_le_bytes());
        header[4..6].copy_from_slice(&2u16.to_le_bytes()); // version 2.4
        header[6..8].copy_from_slice(&4u16.to_le_bytes());
        // 8..12 thiszone and 12..16 sigfigs stay 0 (UTC, as everyone writes).
        header[16..20].copy_from_slice(&SNAPLEN.to_le_bytes());
        header[20..24].copy_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&header)?;
        Ok(Self { out, frames: 0 })
    }

    /// Appends one frame seen at `timestamp_ns` (nanoseconds since the Unix
    /// epoch).
    ///
    /// # Errors
    /// Those of the underlying writer.
    pub fn write_frame(&mut self, timestamp_ns: u64, frame: &[u8]) -> io::Result<()> {
        let orig_len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        let incl_len = orig_len.min(SNAPLEN);
        let secs = u32::try_from(timestamp_ns / 1_000_000_000).unwrap_or(u32::MAX);
        // NO-OVERFLOW: the remainder is below 10^9.
        let nanos = (timestamp_ns % 1_000_000_000) as u32;
        let mut record = [0u8; RECORD_HEADER_LEN];
        record[0..4].copy_from_slice(&secs.to_le_bytes());
        record[4..8].copy_from_slice(&nanos.to_le_bytes());
        record[8..12].copy_from_slice(&incl_len.to_le_bytes());
        record[12..16].copy_from_slice(&orig_len.to_le_bytes());
        self.out.write_all(&record)?;
        self.out
            .write_all(frame.get(..incl_len as usize).unwrap_or(frame))?;
        self.frames += 1;
        Ok(())
    }

    /// Frames written so far.
    #[must_use]
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Flushes the underlying writer.
    ///
    /// # Errors
    /// Those of the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The underlying writer.
    pub fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_records_have_the_libpcap_layout() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.write_frame(1_700_000_000_123_456_789, &[0xaa; 60])
            .unwrap();
        w.write_frame(5, &[1, 2, 3]).unwrap();
        assert_eq!(w.frames(), 2);
        let b = w.into_inner();
        assert_eq!(
            &b[..24],
            &[
                0x4d, 0x3c, 0xb2, 0xa1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 1, 0,
                0, 0
            ]
        );
        let r = &b[24..40];
        assert_eq!(
            u32::from_le_bytes(r[0..4].try_into().unwrap()),
            1_700_000_000
        );
        assert_eq!(u32::from_le_bytes(r[4..8].try_into().unwrap()), 123_456_789);
        assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), 60);
        assert_eq!(u32::from_le_bytes(r[12..16].try_into().unwrap()), 60);
        assert_eq!(&b[40..100], &[0xaa; 60]);
        let r2 = &b[100..116];
        assert_eq!(u32::from_le_bytes(r2[4..8].try_into().unwrap()), 5);
        assert_eq!(&b[116..], &[1, 2, 3]);
    }

    #[test]
    fn oversized_frames_are_truncated_to_the_snaplen() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.write_frame(0, &vec![7u8; SNAPLEN as usize + 10]).unwrap();
        let b = w.into_inner();
        let r = &b[24..40];
        assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), SNAPLEN);
        assert_eq!(
            u32::from_le_bytes(r[12..16].try_into().unwrap()),
            SNAPLEN + 10
        );
        assert_eq!(b.len(), 40 + SNAPLEN as usize);
    }
}
