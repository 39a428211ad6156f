//! Property tests of the SCSI layer: emit -> parse round trips for CDBs,
//! sense data and parameter data, and totality of every parser on arbitrary
//! and mutated bytes.
//!
//! Case counts follow proptest's `PROPTEST_CASES` (default 256 per
//! property): `PROPTEST_CASES=20000 cargo test -p storport-srp scsi` for a
//! longer sweep.

use proptest::prelude::*;

use super::cdb::*;
use super::data::*;
use super::sense::*;
use super::*;

fn block_size() -> impl Strategy<Value = CdbSize> {
    prop_oneof![
        Just(CdbSize::Six),
        Just(CdbSize::Ten),
        Just(CdbSize::Twelve),
        Just(CdbSize::Sixteen)
    ]
}

fn read_write() -> impl Strategy<Value = ReadWriteCdb> {
    (
        block_size(),
        any::<u64>(),
        any::<u32>(),
        0u8..8,
        any::<bool>(),
        any::<bool>(),
        0u8..32,
    )
        .prop_map(|(size, lba, blocks, protect, dpo, fua, group)| match size {
            CdbSize::Six => ReadWriteCdb {
                size,
                lba: lba & 0x1F_FFFF,
                blocks: blocks % 256 + 1,
                protect: 0,
                dpo: false,
                fua: false,
                group: 0,
            },
            CdbSize::Ten => ReadWriteCdb {
                size,
                lba: lba & 0xFFFF_FFFF,
                blocks: blocks & 0xFFFF,
                protect,
                dpo,
                fua,
                group,
            },
            CdbSize::Twelve => ReadWriteCdb {
                size,
                lba: lba & 0xFFFF_FFFF,
                blocks,
                protect,
                dpo,
                fua,
                group,
            },
            CdbSize::Sixteen => ReadWriteCdb {
                size,
                lba,
                blocks,
                protect,
                dpo,
                fua,
                group,
            },
        })
}

fn narrow(size: CdbSize, lba: u64, blocks: u32) -> (u64, u32) {
    match size {
        CdbSize::Ten => (lba & 0xFFFF_FFFF, blocks & 0xFFFF),
        CdbSize::Twelve => (lba & 0xFFFF_FFFF, blocks),
        _ => (lba, blocks),
    }
}

fn page_control() -> impl Strategy<Value = PageControl> {
    prop_oneof![
        Just(PageControl::Current),
        Just(PageControl::Changeable),
        Just(PageControl::Default),
        Just(PageControl::Saved)
    ]
}

fn cdb_repr() -> impl Strategy<Value = CdbRepr> {
    prop_oneof![
        Just(CdbRepr::TestUnitReady),
        (any::<bool>(), any::<u8>()).prop_map(|(desc, alloc_len)| CdbRepr::RequestSense(
            RequestSenseCdb { desc, alloc_len }
        )),
        (any::<bool>(), any::<bool>(), any::<u8>(), any::<u16>()).prop_map(
            |(evpd, cmddt, page_code, alloc_len)| CdbRepr::Inquiry(InquiryCdb {
                evpd,
                cmddt,
                page_code,
                alloc_len
            })
        ),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            page_control(),
            0u8..64,
            any::<u8>(),
            any::<u16>()
        )
            .prop_map(
                |(ten, dbd, llbaa, page_control, page_code, subpage, alloc_len)| {
                    CdbRepr::ModeSense(ModeSenseCdb {
                        size: if ten { CdbSize::Ten } else { CdbSize::Six },
                        dbd,
                        llbaa: ten && llbaa,
                        page_control,
                        page_code,
                        subpage,
                        alloc_len: if ten { alloc_len } else { alloc_len & 0xFF },
                    })
                }
            ),
        (any::<u32>(), any::<bool>())
            .prop_map(|(lba, pmi)| CdbRepr::ReadCapacity10(ReadCapacity10Cdb { lba, pmi })),
        (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(lba, alloc_len, pmi)| {
            CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
                lba,
                alloc_len,
                pmi,
            })
        }),
        read_write().prop_map(CdbRepr::Read),
        read_write().prop_map(CdbRepr::Write),
        (
            prop_oneof![
                Just(CdbSize::Ten),
                Just(CdbSize::Twelve),
                Just(CdbSize::Sixteen)
            ],
            any::<u64>(),
            any::<u32>(),
            0u8..8,
            any::<bool>(),
            0u8..4,
            0u8..32
        )
            .prop_map(|(size, lba, blocks, protect, dpo, bytchk, group)| {
                let (lba, blocks) = narrow(size, lba, blocks);
                CdbRepr::Verify(VerifyCdb {
                    size,
                    lba,
                    blocks,
                    protect,
                    dpo,
                    bytchk,
                    group,
                })
            }),
        (
            any::<bool>(),
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
            0u8..32
        )
            .prop_map(|(sixteen, lba, blocks, immed, group)| {
                let size = if sixteen {
                    CdbSize::Sixteen
                } else {
                    CdbSize::Ten
                };
                let (lba, blocks) = narrow(size, lba, blocks);
                CdbRepr::SynchronizeCache(SynchronizeCacheCdb {
                    size,
                    lba,
                    blocks,
                    immed,
                    group,
                })
            }),
        (any::<u8>(), any::<u32>()).prop_map(|(select_report, alloc_len)| {
            CdbRepr::ReportLuns(ReportLunsCdb {
                select_report,
                alloc_len,
            })
        }),
        (any::<bool>(), 0u8..32, any::<u16>()).prop_map(|(anchor, group, param_list_len)| {
            CdbRepr::Unmap(UnmapCdb {
                anchor,
                group,
                param_list_len,
            })
        }),
    ]
}

fn sense_key() -> impl Strategy<Value = SenseKey> {
    (0u8..16).prop_map(SenseKey::from_nibble)
}

fn sense_repr() -> impl Strategy<Value = SenseRepr> {
    (
        any::<bool>(),
        any::<bool>(),
        sense_key(),
        any::<(u8, u8)>(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<[u8; 3]>()),
        any::<u8>(),
        any::<[bool; 4]>(),
    )
        .prop_map(
            |(
                descriptor,
                deferred,
                key,
                (asc, ascq),
                information,
                command_specific,
                sks,
                fru,
                flags,
            )| {
                let [filemark, eom, ili, overflow] = flags;
                let mut repr = SenseRepr {
                    format: if descriptor {
                        SenseFormat::Descriptor
                    } else {
                        SenseFormat::Fixed
                    },
                    deferred,
                    key,
                    code: AdditionalSense { asc, ascq },
                    information,
                    command_specific,
                    sense_key_specific: sks.map(|[first, hi, lo]| [first & 0x7F, hi, lo]),
                    fru,
                    filemark,
                    eom,
                    ili,
                    overflow,
                };
                if !descriptor {
                    // Fixed format: 32-bit values, a zero command-specific
                    // field reads back as absent.
                    repr.information = repr.information.map(|v| v & 0xFFFF_FFFF);
                    repr.command_specific = repr
                        .command_specific
                        .map(|v| v & 0xFFFF_FFFF)
                        .filter(|v| *v != 0);
                }
                repr
            },
        )
}

/// A few flipped bytes, sometimes a cut or an appended tail.
fn mutate(bytes: &[u8], flips: &[(usize, u8)], cut: usize, tail: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    if !out.is_empty() {
        let len = out.len();
        for &(at, mask) in flips {
            out[at % len] ^= mask;
        }
    }
    out.truncate(out.len().saturating_sub(cut));
    out.extend_from_slice(tail);
    out
}

proptest! {
    #[test]
    fn cdb_round_trip(repr in cdb_repr()) {
        let bytes = repr.to_cdb16().unwrap();
        let len = repr.buffer_len();
        prop_assert!(bytes[len..].iter().all(|b| *b == 0));
        prop_assert_eq!(CdbRepr::parse_bytes(&bytes[..len]), Ok(repr));
        let view = Cdb::new_checked(&bytes[..len]).unwrap();
        prop_assert_eq!(view.opcode(), repr.opcode());
        prop_assert_eq!(view.control(), 0);
        prop_assert_eq!(view.data_direction(), Some(repr.data_direction()));
        // One byte short is always refused.
        prop_assert!(
            matches!(
                CdbRepr::parse_bytes(&bytes[..len - 1]),
                Err(CdbError::Truncated { .. })
            ),
            "short CDB accepted"
        );
    }

    #[test]
    fn cdb_parse_is_total_and_idempotent(bytes in prop::collection::vec(any::<u8>(), 0..24)) {
        let view = Cdb::new_unchecked(&bytes[..]);
        let _ = (view.control(), view.naca(), view.cdb_len(), view.as_bytes(), view.data_direction());
        if let Ok(repr) = CdbRepr::parse(&view) {
            let again = repr.to_cdb16().expect("every parsed CDB can be emitted");
            prop_assert_eq!(CdbRepr::parse_bytes(&again), Ok(repr));
        }
    }

    #[test]
    fn sense_round_trip(repr in sense_repr()) {
        let mut buf = [0u8; 64];
        let len = repr.emit(&mut buf).unwrap();
        prop_assert_eq!(len, repr.buffer_len());
        prop_assert_eq!(SenseRepr::parse(&buf[..len]), Ok(repr));
        // Any cut still parses (or is too short for a key) without error
        // of another kind.
        for cut in 0..len {
            match SenseRepr::parse(&buf[..cut]) {
                Ok(short) => {
                    prop_assert_eq!(short.format, repr.format);
                    prop_assert_eq!(short.key, repr.key);
                }
                Err(e) => prop_assert!(
                    matches!(e, SenseError::Empty | SenseError::Truncated),
                    "cut at {} gave {:?}", cut, e
                ),
            }
        }
    }

    #[test]
    fn sense_parse_is_total_and_idempotent(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        code in 0x70u8..0x74,
    ) {
        let mut bytes = bytes;
        if let Some(first) = bytes.first_mut() {
            *first = (*first & 0x80) | code;
        }
        if let Ok(repr) = SenseRepr::parse(&bytes) {
            let mut buf = [0u8; 64];
            let len = repr.emit(&mut buf).expect("parsed sense can be emitted");
            prop_assert_eq!(SenseRepr::parse(&buf[..len]), Ok(repr));
        }
    }

    #[test]
    fn mutated_sense_never_panics(
        repr in sense_repr(),
        flips in prop::collection::vec((any::<usize>(), 1u8..=255), 0..4),
        cut in 0usize..8,
        tail in prop::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut buf = [0u8; 64];
        let len = repr.emit(&mut buf).unwrap();
        let bytes = mutate(&buf[..len], &flips, cut, &tail);
        let _ = SenseRepr::parse(&bytes);
    }

    #[test]
    fn data_round_trips(
        last_lba in any::<u64>(),
        block_len in any::<u32>(),
        exps in (0u8..8, 0u8..16, 0u8..16, 0u16..0x4000),
        flags in any::<[bool; 3]>(),
    ) {
        let (p_type, p_i_exponent, per_physical, lowest) = exps;
        let rc16 = ReadCapacity16Repr {
            last_lba,
            block_len,
            prot_en: flags[0],
            p_type,
            p_i_exponent,
            blocks_per_physical_exponent: per_physical,
            lbpme: flags[1],
            lbprz: flags[2],
            lowest_aligned_lba: lowest,
        };
        let mut out = [0u8; 32];
        rc16.emit(&mut ReadCapacity16Data::new_unchecked(&mut out)).unwrap();
        prop_assert_eq!(ReadCapacity16Repr::parse(&ReadCapacity16Data::new_unchecked(&out[..])), Ok(rc16));

        let rc10 = ReadCapacity10Repr::for_capacity(last_lba, block_len);
        let mut out = [0u8; 8];
        rc10.emit(&mut ReadCapacity10Data::new_unchecked(&mut out)).unwrap();
        prop_assert_eq!(ReadCapacity10Repr::parse(&ReadCapacity10Data::new_unchecked(&out[..])), Ok(rc10));
    }

    #[test]
    fn data_parsers_are_total(bytes in prop::collection::vec(any::<u8>(), 0..48)) {
        let _ = ReadCapacity10Repr::parse(&ReadCapacity10Data::new_unchecked(&bytes[..]));
        let _ = ReadCapacity16Repr::parse(&ReadCapacity16Data::new_unchecked(&bytes[..]));
        if let Ok(inquiry) = StandardInquiryRepr::parse(&StandardInquiry::new_unchecked(&bytes[..])) {
            let mut out = [0u8; 36];
            inquiry.emit(&mut StandardInquiry::new_unchecked(&mut out)).unwrap();
            let again = StandardInquiryRepr::parse(&StandardInquiry::new_unchecked(&out[..])).unwrap();
            prop_assert_eq!(again, StandardInquiryRepr { additional_len: 31, ..inquiry });
        }
        let luns = ReportLunsData::new_unchecked(&bytes[..]);
        let count = luns.luns().count();
        prop_assert!(count <= bytes.len().saturating_sub(8) / 8);
        prop_assert!(count as u64 <= u64::from(luns.lun_count()));
    }

    #[test]
    fn lun_single_level_round_trip(index in 0u16..0x4000) {
        let lun = Lun::from_index(index).unwrap();
        prop_assert_eq!(lun.index(), Some(index));
        let mut out = [0u8; 16];
        emit_report_luns(&[lun], &mut out).unwrap();
        prop_assert_eq!(ReportLunsData::new_unchecked(&out[..]).luns().next(), Some(lun));
    }
}
