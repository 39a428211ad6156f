//! iSER (RFC 7145) as Linux speaks it over InfiniBand and RoCE: the 28-byte
//! iSER header in front of every iSCSI control PDU sent with RDMA SEND, the
//! Hello/HelloReply messages (iWARP only; Linux IB/RoCE iSER never sends
//! them, but they parse), and the 4-byte iSER header in RDMA/CM private
//! data.
//!
//! The header of a control PDU advertises the initiator's buffers: the
//! *write* STag/VA is where the target RDMA-READs SCSI write data from, the
//! *read* STag/VA where it RDMA-WRITEs read data to. Each is valid only with
//! its flag (WSV, RSV). Linux `isert` RDMA-READs from the write VA without
//! adding the length of data already sent as immediate or unsolicited data,
//! so the write VA must point past it.
//!
//! Errors are [`iscsi::Error`]: an iSER message is
//! parsed together with the iSCSI PDU it carries.

use bitflags::bitflags;
use static_assertions::const_assert_eq;

use super::bytes::{self, FieldCodec};
use super::iscsi::{self, BHS_LEN, Error, IscsiPdu, Result};

mod field {
    use crate::wire::Field;

    // Control-type header, 28 bytes.
    pub const FLAGS: Field = 0..1;
    pub const WRITE_STAG: Field = 4..8;
    pub const WRITE_VA: Field = 8..16;
    pub const READ_STAG: Field = 16..20;
    pub const READ_VA: Field = 20..28;

    // Hello / HelloReply, 12 bytes.
    pub const VERSIONS: Field = 1..2;
    pub const IRD_ORD: Field = 2..4;
    pub const HELLO_RESERVED: Field = 4..12;

    // RDMA/CM private data header, 4 bytes.
    pub const CM_FLAGS: Field = 0..1;
    pub const CM_RESERVED: Field = 1..4;
}

/// Size of the iSER header of a control PDU.
pub const HEADER_LEN: usize = field::READ_VA.end;
/// Size of a Hello or HelloReply message.
pub const HELLO_LEN: usize = field::HELLO_RESERVED.end;
/// Size of the iSER header in RDMA/CM private data.
pub const CM_HEADER_LEN: usize = field::CM_RESERVED.end;
/// iSER header plus iSCSI BHS: what precedes the data of every PDU
/// (`ISER_HEADERS_LEN`).
pub const HEADERS_LEN: usize = HEADER_LEN + BHS_LEN;

const_assert_eq!(HEADER_LEN, 28);
const_assert_eq!(HELLO_LEN, 12);
const_assert_eq!(CM_HEADER_LEN, 4);
const_assert_eq!(HEADERS_LEN, 76);

/// The opcode nibble of byte 0.
const OPCODE_MASK: u8 = 0xF0;
/// `ISCSI_CTRL`: an iSCSI control-type PDU follows.
const OPCODE_CONTROL: u8 = 0x10;
/// `ISER_HELLO`.
const OPCODE_HELLO: u8 = 0x20;
/// `ISER_HELLORPLY`.
const OPCODE_HELLO_REPLY: u8 = 0x30;
/// `ISER_WSV`: the write STag/VA are valid.
const WSV: u8 = 0x08;
/// `ISER_RSV`: the read STag/VA are valid.
const RSV: u8 = 0x04;
/// The REJ flag of a HelloReply.
const HELLO_REJECT: u8 = 0x01;

/// An advertised initiator buffer: STag (R_Key) and base virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RdmaBuf {
    /// The STag (R_Key) the target uses.
    pub stag: u32,
    /// The buffer's base virtual address (or offset, for zero-based MRs).
    pub va: u64,
}

/// The value of the iSER header of a control PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IserCtrlRepr {
    /// Where the target RDMA-READs write data from (WSV).
    pub write: Option<RdmaBuf>,
    /// Where the target RDMA-WRITEs read data to (RSV).
    pub read: Option<RdmaBuf>,
}

impl IserCtrlRepr {
    /// Parses a control header. A buffer whose flag is clear is ignored.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::UnknownIserOpcode`] (also for Hello
    /// and HelloReply, which are not control headers).
    pub fn parse<T: AsRef<[u8]>>(header: &IserHeader<T>) -> Result<Self> {
        header.check_len()?;
        let flags = header.flags();
        if flags & OPCODE_MASK != OPCODE_CONTROL {
            return Err(Error::UnknownIserOpcode(flags >> 4));
        }
        let write = (flags & WSV != 0).then(|| RdmaBuf {
            stag: header.write_stag(),
            va: header.write_va(),
        });
        let read = (flags & RSV != 0).then(|| RdmaBuf {
            stag: header.read_stag(),
            va: header.read_va(),
        });
        Ok(Self { write, read })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header (absent buffers as zeros).
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut IserHeader<T>) -> Result<()> {
        if header.as_bytes().len() < HEADER_LEN {
            return Err(Error::BufferTooSmall);
        }
        bytes::zero(header.as_bytes_mut(), 0, HEADER_LEN);
        let mut flags = OPCODE_CONTROL;
        if let Some(write) = self.write {
            flags |= WSV;
            header.set_write_stag(write.stag);
            header.set_write_va(write.va);
        }
        if let Some(read) = self.read {
            flags |= RSV;
            header.set_read_stag(read.stag);
            header.set_read_va(read.va);
        }
        header.set_flags(flags);
        Ok(())
    }
}

wire_view! {
    /// A view of the 28-byte iSER header of a control PDU (`iser_ctrl`).
    pub struct IserHeader, min_len = HEADER_LEN, error = Error, truncated = Error::Truncated;
    /// Raw flags: opcode nibble, WSV, RSV.
    flags, set_flags: u8 = field::FLAGS;
    /// Write STag.
    write_stag, set_write_stag: u32 = field::WRITE_STAG;
    /// Write base VA.
    write_va, set_write_va: u64 = field::WRITE_VA;
    /// Read STag.
    read_stag, set_read_stag: u32 = field::READ_STAG;
    /// Read base VA.
    read_va, set_read_va: u64 = field::READ_VA;
}

/// The value of an iSER Hello (initiator to target, iWARP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HelloRepr {
    /// Highest iSER version supported (4 bits).
    pub max_version: u8,
    /// Lowest iSER version supported (4 bits).
    pub min_version: u8,
    /// iSER-IRD: RDMA READs the initiator can have outstanding as responder.
    pub ird: u16,
}

/// The value of an iSER HelloReply (target to initiator, iWARP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HelloReplyRepr {
    /// Highest iSER version supported (4 bits).
    pub max_version: u8,
    /// The version in use (4 bits).
    pub current_version: u8,
    /// iSER-ORD: RDMA READs the target will have outstanding.
    pub ord: u16,
    /// REJ: the target rejects the connection.
    pub rejected: bool,
}

wire_view! {
    /// A view of an iSER Hello or HelloReply message.
    pub struct IserHello, min_len = HELLO_LEN, error = Error, truncated = Error::Truncated;
    /// Raw byte 0: opcode nibble (and REJ in a HelloReply).
    flags, set_flags: u8 = field::FLAGS;
    /// Raw byte 1: two version nibbles.
    versions, set_versions: u8 = field::VERSIONS;
    /// iSER-IRD (Hello) or iSER-ORD (HelloReply).
    ird_ord, set_ird_ord: u16 = field::IRD_ORD;
}

/// Any iSER message, parsed with the PDU it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IserMessage<'a> {
    /// An iSCSI control-type PDU.
    Control {
        /// The iSER header.
        header: IserCtrlRepr,
        /// The iSCSI PDU after it.
        pdu: IscsiPdu<'a>,
    },
    /// A Hello.
    Hello(HelloRepr),
    /// A HelloReply.
    HelloReply(HelloReplyRepr),
}

impl<'a> IserMessage<'a> {
    /// Parses one received RDMA SEND: iSER header, then (for control PDUs)
    /// the iSCSI PDU with its data segment. Bytes after a 12-byte Hello or
    /// HelloReply are ignored.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::UnknownIserOpcode`], and the errors of
    /// [`IscsiPdu::parse`].
    pub fn parse(buf: &'a [u8]) -> Result<Self> {
        let flags = *buf.first().ok_or(Error::Truncated)?;
        match flags & OPCODE_MASK {
            OPCODE_CONTROL => {
                let header = IserCtrlRepr::parse(&IserHeader::new_checked(buf)?)?;
                let rest = buf.get(HEADER_LEN..).ok_or(Error::Truncated)?;
                Ok(Self::Control {
                    header,
                    pdu: IscsiPdu::parse(rest)?,
                })
            }
            OPCODE_HELLO => {
                let hello = IserHello::new_checked(buf)?;
                Ok(Self::Hello(HelloRepr {
                    max_version: hello.versions() >> 4,
                    min_version: hello.versions() & 0x0F,
                    ird: hello.ird_ord(),
                }))
            }
            OPCODE_HELLO_REPLY => {
                let reply = IserHello::new_checked(buf)?;
                Ok(Self::HelloReply(HelloReplyRepr {
                    max_version: reply.versions() >> 4,
                    current_version: reply.versions() & 0x0F,
                    ord: reply.ird_ord(),
                    rejected: reply.flags() & HELLO_REJECT != 0,
                }))
            }
            other => Err(Error::UnknownIserOpcode(other >> 4)),
        }
    }

    /// Bytes [`Self::emit`] writes (no padding: iSER sends none).
    pub const fn buffer_len(&self) -> usize {
        match self {
            Self::Control { pdu, .. } => HEADER_LEN + pdu.buffer_len(iscsi::Padding::None),
            Self::Hello(_) | Self::HelloReply(_) => HELLO_LEN,
        }
    }

    /// Writes the message and returns its length.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`] and the errors of [`IscsiPdu::emit`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        let out = buf.get_mut(..len).ok_or(Error::BufferTooSmall)?;
        match self {
            Self::Control { header, pdu } => {
                header.emit(&mut IserHeader::new_unchecked(&mut *out))?;
                let rest = out.get_mut(HEADER_LEN..).ok_or(Error::BufferTooSmall)?;
                pdu.emit(rest, iscsi::Padding::None)?;
            }
            Self::Hello(hello) => {
                bytes::zero(out, 0, HELLO_LEN);
                let mut view = IserHello::new_unchecked(out);
                view.set_flags(OPCODE_HELLO);
                view.set_versions((hello.max_version << 4) | (hello.min_version & 0x0F));
                view.set_ird_ord(hello.ird);
            }
            Self::HelloReply(reply) => {
                bytes::zero(out, 0, HELLO_LEN);
                let mut view = IserHello::new_unchecked(out);
                let rej = if reply.rejected { HELLO_REJECT } else { 0 };
                view.set_flags(OPCODE_HELLO_REPLY | rej);
                view.set_versions((reply.max_version << 4) | (reply.current_version & 0x0F));
                view.set_ird_ord(reply.ord);
            }
        }
        Ok(len)
    }
}

/// Writes the iSER header and the iSCSI BHS of a control PDU whose data
/// segment (`data_len` bytes) the caller sends from its own buffer as a
/// second scatter/gather element: the I/O fast path of an iSER initiator
/// (SCSI Command with immediate data, unsolicited Data-Out). Returns
/// [`HEADERS_LEN`].
///
/// # Errors
///
/// [`Error::BufferTooSmall`], [`Error::DataSegmentTooLong`].
pub fn emit_headers(
    buf: &mut [u8],
    header: &IserCtrlRepr,
    bhs: &iscsi::BhsRepr,
    data_len: u32,
) -> Result<usize> {
    let out = buf.get_mut(..HEADERS_LEN).ok_or(Error::BufferTooSmall)?;
    let (iser, rest) = out.split_at_mut(HEADER_LEN);
    header.emit(&mut IserHeader::new_unchecked(iser))?;
    bhs.emit(rest)?;
    iscsi::set_data_segment_len(rest, data_len)?;
    Ok(HEADERS_LEN)
}

bitflags! {
    /// Flags of the iSER header in RDMA/CM private data (RFC 7145 annex A):
    /// what the sender does *not* support.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct IserCmFlags: u8 {
        /// `ISER_ZBVA_NOT_SUP`: no zero-based virtual addresses (Linux
        /// always sets it).
        const ZBVA_NOT_SUPPORTED = 0x80;
        /// `ISER_SEND_W_INV_NOT_SUP`: do not answer with SEND WITH
        /// INVALIDATE (set by an initiator that will not accept remote
        /// invalidation).
        const SEND_WITH_INVALIDATE_NOT_SUPPORTED = 0x40;
    }
}

impl FieldCodec for IserCmFlags {
    const SIZE: usize = 1;
    fn read(buf: &[u8], at: usize) -> Self {
        // Undefined bits are ignored on receipt and never sent.
        Self::from_bits_truncate(u8::read(buf, at))
    }
    fn write(self, buf: &mut [u8], at: usize) {
        self.bits().write(buf, at);
    }
}

wire_view! {
    /// A view of the iSER header in RDMA/CM REQ/REP private data
    /// (`iser_cm_hdr`).
    pub struct IserCmHeader, min_len = CM_HEADER_LEN, error = Error, truncated = Error::Truncated;
    /// The flags.
    flags, set_flags: IserCmFlags = field::CM_FLAGS;
}

/// The value of the iSER RDMA/CM header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IserCmRepr {
    /// What the sender does not support.
    pub flags: IserCmFlags,
}

impl IserCmRepr {
    /// Parses the header.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`].
    pub fn parse<T: AsRef<[u8]>>(header: &IserCmHeader<T>) -> Result<Self> {
        header.check_len()?;
        Ok(Self {
            flags: header.flags(),
        })
    }

    /// Bytes [`Self::emit`] writes.
    pub const fn buffer_len(&self) -> usize {
        CM_HEADER_LEN
    }

    /// Writes the header, reserved bytes zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, header: &mut IserCmHeader<T>) -> Result<()> {
        if header.as_bytes().len() < CM_HEADER_LEN {
            return Err(Error::BufferTooSmall);
        }
        bytes::zero(header.as_bytes_mut(), 0, CM_HEADER_LEN);
        header.set_flags(self.flags);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Lun;
    use crate::wire::iscsi::{BhsRepr, ScsiCommandRepr, SerialNumber, TaskAttr};

    /// An iSER + SCSI Command PDU for READ(10) of 8 blocks into a buffer
    /// advertised with RSV, as `ib_iser` sends it (no data segment).
    #[test]
    fn read10_control_pdu_golden_bytes() {
        let cmd = ScsiCommandRepr {
            immediate: false,
            is_final: true,
            read: true,
            write: false,
            attr: TaskAttr::Simple,
            lun: Lun::from_index(1).unwrap(),
            itt: 0x0000_0012,
            expected_data_len: 4096,
            cmd_sn: SerialNumber(0x20),
            exp_stat_sn: SerialNumber(0x31),
            cdb: [0x28, 0, 0, 0, 0x10, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0],
        };
        let msg = IserMessage::Control {
            header: IserCtrlRepr {
                write: None,
                read: Some(RdmaBuf {
                    stag: 0x0001_2345,
                    va: 0xffff_8880_1234_0000,
                }),
            },
            pdu: IscsiPdu {
                header: BhsRepr::ScsiCommand(cmd),
                ahs: &[],
                data: &[],
            },
        };
        let expected: [u8; 76] = [
            0x14, 0, 0, 0, // ISCSI_CTRL | RSV
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // write stag, va
            0x00, 0x01, 0x23, 0x45, // read stag
            0xff, 0xff, 0x88, 0x80, 0x12, 0x34, 0x00, 0x00, // read va
            0x01, 0xC1, 0, 0, // SCSI Command, F|R|SIMPLE
            0, 0, 0, 0, // AHS, DSL
            0, 1, 0, 0, 0, 0, 0, 0, // LUN 1
            0, 0, 0, 0x12, // ITT
            0, 0, 0x10, 0, // EDTL 4096
            0, 0, 0, 0x20, // CmdSN
            0, 0, 0, 0x31, // ExpStatSN
            0x28, 0, 0, 0, 0x10, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, // CDB
        ];
        let mut buf = [0xEEu8; 76];
        assert_eq!(msg.emit(&mut buf), Ok(76));
        assert_eq!(buf, expected);
        assert_eq!(IserMessage::parse(&buf), Ok(msg));
    }

    /// The fast path writes the same bytes as the whole-message emitter,
    /// minus the data segment.
    #[test]
    fn headers_for_external_data() {
        let cmd = ScsiCommandRepr {
            immediate: false,
            is_final: true,
            read: false,
            write: true,
            attr: TaskAttr::Simple,
            lun: Lun::default(),
            itt: 7,
            expected_data_len: 8192,
            cmd_sn: SerialNumber(3),
            exp_stat_sn: SerialNumber(4),
            cdb: [0x2a, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0],
        };
        let header = IserCtrlRepr {
            write: Some(RdmaBuf {
                stag: 0x99,
                va: 0x1000 + 512,
            }),
            read: None,
        };
        let data = [0x5Au8; 512];
        let whole = IserMessage::Control {
            header,
            pdu: IscsiPdu {
                header: BhsRepr::ScsiCommand(cmd),
                ahs: &[],
                data: &data,
            },
        };
        let mut expected = [0u8; 76 + 512];
        whole.emit(&mut expected).unwrap();
        let mut buf = [0xEEu8; 80];
        assert_eq!(
            emit_headers(&mut buf, &header, &BhsRepr::ScsiCommand(cmd), 512),
            Ok(76)
        );
        assert_eq!(buf[..76], expected[..76]);
        assert_eq!(buf[76..], [0xEE; 4]);
        assert_eq!(
            emit_headers(&mut buf[..75], &header, &BhsRepr::ScsiCommand(cmd), 0),
            Err(Error::BufferTooSmall)
        );
        assert_eq!(
            emit_headers(&mut buf, &header, &BhsRepr::ScsiCommand(cmd), 1 << 24),
            Err(Error::DataSegmentTooLong)
        );
    }

    #[test]
    fn hello_messages() {
        let hello = IserMessage::Hello(HelloRepr {
            max_version: 10,
            min_version: 10,
            ird: 16,
        });
        let mut buf = [0xEEu8; 12];
        assert_eq!(hello.emit(&mut buf), Ok(12));
        assert_eq!(buf, [0x20, 0xAA, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(IserMessage::parse(&buf), Ok(hello));
        let reply = IserMessage::HelloReply(HelloReplyRepr {
            max_version: 10,
            current_version: 10,
            ord: 4,
            rejected: true,
        });
        assert_eq!(reply.emit(&mut buf), Ok(12));
        assert_eq!(buf[..4], [0x31, 0xAA, 0, 4]);
        assert_eq!(IserMessage::parse(&buf), Ok(reply));
        assert_eq!(IserMessage::parse(&buf[..11]), Err(Error::Truncated));
        assert_eq!(
            IserCtrlRepr::parse(&IserHeader::new_unchecked(&[0x20u8; 28][..])),
            Err(Error::UnknownIserOpcode(2))
        );
    }

    #[test]
    fn malformed() {
        assert_eq!(IserMessage::parse(&[]), Err(Error::Truncated));
        assert_eq!(
            IserMessage::parse(&[0x40; 80]),
            Err(Error::UnknownIserOpcode(4))
        );
        assert_eq!(IserMessage::parse(&[0x10; 27]), Err(Error::Truncated));
        let mut buf = [0u8; 28 + 47];
        buf[0] = 0x10;
        assert_eq!(IserMessage::parse(&buf), Err(Error::Truncated));
        let mut small = [0u8; 27];
        assert_eq!(
            IserCtrlRepr::default().emit(&mut IserHeader::new_unchecked(&mut small[..])),
            Err(Error::BufferTooSmall)
        );
        let hello = IserMessage::Hello(HelloRepr {
            max_version: 1,
            min_version: 1,
            ird: 0,
        });
        assert_eq!(hello.emit(&mut small[..11]), Err(Error::BufferTooSmall));
    }

    #[test]
    fn flags_without_valid_bits_are_ignored() {
        let mut buf = [0u8; 28];
        buf[0] = 0x10;
        buf[4..8].copy_from_slice(&[1, 2, 3, 4]);
        let repr = IserCtrlRepr::parse(&IserHeader::new_unchecked(&buf[..])).unwrap();
        assert_eq!(
            repr,
            IserCtrlRepr {
                write: None,
                read: None
            }
        );
    }

    /// What `ib_iser` puts after the RDMA/CM header: ZBVA not supported and,
    /// without remote invalidation, SEND_W_INV not supported.
    #[test]
    fn cm_header() {
        let repr = IserCmRepr {
            flags: IserCmFlags::ZBVA_NOT_SUPPORTED
                | IserCmFlags::SEND_WITH_INVALIDATE_NOT_SUPPORTED,
        };
        let mut buf = [0xEEu8; 4];
        repr.emit(&mut IserCmHeader::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, [0xC0, 0, 0, 0]);
        assert_eq!(
            IserCmRepr::parse(&IserCmHeader::new_unchecked(&buf[..])),
            Ok(repr)
        );
        let target = IserCmRepr::parse(&IserCmHeader::new_unchecked(&[0x81u8, 0, 0, 0][..]));
        assert_eq!(
            target,
            Ok(IserCmRepr {
                flags: IserCmFlags::ZBVA_NOT_SUPPORTED
            })
        );
        assert_eq!(
            IserCmRepr::parse(&IserCmHeader::new_unchecked(&buf[..3])),
            Err(Error::Truncated)
        );
        assert_eq!(
            repr.emit(&mut IserCmHeader::new_unchecked(&mut buf[..3])),
            Err(Error::BufferTooSmall)
        );
    }
}
