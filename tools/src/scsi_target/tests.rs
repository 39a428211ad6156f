//! Device server tests: every command, every error path, golden answers,
//! truncation, residuals, fault hooks, concurrency, and a property test of
//! data integrity against a model.
//!
//! Requests are built with the `storport_srp::scsi` CDB builders, as the
//! initiator and the benchmark build them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use storport_srp::scsi::cdb::*;
use storport_srp::scsi::data::{ReadCapacity16Data, ReadCapacity16Repr, ReportLunsData};
use storport_srp::scsi::{
    AdditionalSense, CdbRepr, FieldPointer, Lun, SenseFormat, SenseKey, SenseRepr, Status,
};
use storport_srp::wire::Residual;

use super::*;

const TARGET_ID: u64 = 0x1234;
/// LUN 0: 512-byte blocks, 1 MiB.
const LUN0_BLOCKS: u64 = 2048;
/// LUN 5: 4096-byte blocks.
const LUN5_BLOCKS: u64 = 300;

fn target() -> ScsiTarget {
    let mut target = ScsiTarget::new(TargetConfig::new(TARGET_ID));
    target
        .add_lun(0, LunConfig::new(BlockSize::B512, LUN0_BLOCKS))
        .unwrap();
    target
        .add_lun(5, LunConfig::new(BlockSize::B4096, LUN5_BLOCKS))
        .unwrap();
    target
}

fn lun(index: u16) -> Lun {
    Lun::from_index(index).unwrap()
}

fn cdb(repr: CdbRepr) -> [u8; 16] {
    repr.to_cdb16().unwrap()
}

/// Runs a data-in (or no-data) command.
fn run(target: &ScsiTarget, index: u16, repr: CdbRepr, capacity: u32) -> (Response, Vec<u8>) {
    target.execute_to_vec(&Request::new(lun(index), &cdb(repr), capacity))
}

/// Runs a data-out command.
fn run_out(target: &ScsiTarget, index: u16, repr: CdbRepr, data: &[u8]) -> Response {
    let (response, data_in) =
        target.execute_to_vec(&Request::with_data_out(lun(index), &cdb(repr), data));
    assert!(data_in.is_empty());
    response
}

fn read(lba: u64, blocks: u32) -> CdbRepr {
    CdbRepr::Read(ReadWriteCdb::new(lba, blocks))
}

fn write(lba: u64, blocks: u32) -> CdbRepr {
    CdbRepr::Write(ReadWriteCdb::new(lba, blocks))
}

fn inquiry(evpd: bool, page_code: u8, alloc_len: u16) -> CdbRepr {
    CdbRepr::Inquiry(InquiryCdb {
        evpd,
        cmddt: false,
        page_code,
        alloc_len,
    })
}

fn mode_sense(size: CdbSize, page_code: u8, alloc_len: u16) -> ModeSenseCdb {
    ModeSenseCdb {
        size,
        dbd: false,
        llbaa: false,
        page_control: PageControl::Current,
        page_code,
        subpage: 0,
        alloc_len,
    }
}

fn good(response: &Response) {
    assert_eq!(response.status, Status::GOOD, "{response:?}");
    assert_eq!(response.sense, None);
}

/// Asserts CHECK CONDITION with this key and code; returns the sense.
#[track_caller]
fn check(response: &Response, key: SenseKey, code: AdditionalSense) -> SenseRepr {
    assert_eq!(response.status, Status::CHECK_CONDITION, "{response:?}");
    let sense = response.sense.expect("CHECK CONDITION carries sense");
    assert_eq!((sense.key, sense.code), (key, code), "{sense:?}");
    assert_eq!(response.data_in_len, 0);
    // The bytes on the wire parse back to the same sense.
    let bytes = response.sense_bytes().unwrap();
    assert_eq!(SenseRepr::parse(&bytes), Ok(sense));
    sense
}

#[track_caller]
fn invalid_field(response: &Response, field: FieldPointer) {
    let sense = check(
        response,
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_CDB,
    );
    assert_eq!(sense.field_pointer(), Some((true, field)));
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

// ---------------------------------------------------------------- INQUIRY

fn standard_inquiry_golden(qualifier_type: u8) -> Vec<u8> {
    let mut expected = vec![qualifier_type, 0x00, 0x06, 0x12, 0x1F, 0x00, 0x00, 0x02];
    expected.extend_from_slice(b"KVERBS  RAMDISK         0001");
    expected
}

#[test]
fn inquiry_standard_golden() {
    let target = target();
    let (response, data) = run(&target, 0, inquiry(false, 0, 255), 255);
    good(&response);
    assert_eq!(data, standard_inquiry_golden(0x00));
    assert_eq!(response.data_in_len, 36);
    assert_eq!(response.data_in_residual, Residual::Underflow(255 - 36));
    assert_eq!(response.data_out_residual, Residual::None);
}

#[test]
fn inquiry_allocation_length_truncates() {
    let target = target();
    let (response, data) = run(&target, 0, inquiry(false, 0, 5), 96);
    good(&response);
    assert_eq!(data, &standard_inquiry_golden(0)[..5]);
    assert_eq!(response.data_in_residual, Residual::Underflow(91));
    // Allocation length 0 is not an error; nothing moves.
    let (response, data) = run(&target, 0, inquiry(false, 0, 0), 0);
    good(&response);
    assert!(data.is_empty());
    assert_eq!(response.data_in_residual, Residual::None);
    // An initiator buffer smaller than the allocation length: what fits is
    // sent, the rest is an overflow.
    let (response, data) = run(&target, 0, inquiry(false, 0, 255), 20);
    good(&response);
    assert_eq!(data, &standard_inquiry_golden(0)[..20]);
    assert_eq!(response.data_in_residual, Residual::Overflow(16));
}

#[test]
fn inquiry_vpd_pages_golden() {
    let target = target();
    let vpd = |page| {
        let (response, data) = run(&target, 0, inquiry(true, page, 0x200), 0x200);
        good(&response);
        data
    };
    assert_eq!(
        vpd(0x00),
        [0x00, 0x00, 0x00, 0x06, 0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2]
    );
    let serial = b"KV000000001234L0000";
    let mut expected = vec![0x00, 0x80, 0x00, serial.len() as u8];
    expected.extend_from_slice(serial);
    assert_eq!(vpd(0x80), expected);

    let mut expected = vec![0x00, 0x83, 0x00, 0x2B];
    expected.extend_from_slice(&[0x01, 0x03, 0x00, 0x08]);
    expected.extend_from_slice(&[0x30, 0x00, 0x00, 0x00, 0x12, 0x34, 0x00, 0x00]);
    expected.extend_from_slice(&[0x02, 0x01, 0x00, 0x1B]);
    expected.extend_from_slice(b"KVERBS  ");
    expected.extend_from_slice(serial);
    assert_eq!(vpd(0x83), expected);

    let limits = vpd(0xB0);
    assert_eq!(limits.len(), 64);
    assert_eq!(&limits[..4], &[0x00, 0xB0, 0x00, 0x3C]);
    assert_eq!(&limits[6..8], &[0x00, 0x01], "transfer granularity");
    assert_eq!(&limits[8..12], &32768u32.to_be_bytes(), "max transfer");
    assert_eq!(&limits[12..16], &32768u32.to_be_bytes(), "optimal transfer");
    assert_eq!(&limits[20..24], &[0xFF; 4], "max unmap LBA count");
    assert_eq!(
        &limits[24..28],
        &256u32.to_be_bytes(),
        "max unmap descriptors"
    );
    assert_eq!(&limits[28..32], &1u32.to_be_bytes(), "unmap granularity");

    let characteristics = vpd(0xB1);
    assert_eq!(&characteristics[..6], &[0x00, 0xB1, 0x00, 0x3C, 0x00, 0x01]);
    assert_eq!(vpd(0xB2), [0x00, 0xB2, 0x00, 0x04, 0x00, 0x84, 0x02, 0x00]);

    // The 4 KiB LUN has its own serial and designator.
    let (_, lun5) = run(&target, 5, inquiry(true, 0x80, 64), 64);
    assert_eq!(&lun5[4..], b"KV000000001234L0005");
}

#[test]
fn inquiry_errors() {
    let target = target();
    let (response, _) = run(&target, 0, inquiry(true, 0x89, 255), 255);
    invalid_field(&response, FieldPointer::byte(2));
    let (response, _) = run(&target, 0, inquiry(false, 0x80, 255), 255);
    invalid_field(&response, FieldPointer::byte(2));
    let cmddt = CdbRepr::Inquiry(InquiryCdb {
        evpd: false,
        cmddt: true,
        page_code: 0,
        alloc_len: 36,
    });
    let (response, _) = run(&target, 0, cmddt, 36);
    invalid_field(&response, FieldPointer::bit(1, 1));
    assert_eq!(response.data_in_residual, Residual::Underflow(36));
    // Without thin provisioning, VPD 0xB2 is not offered.
    let mut thick = LunConfig::new(BlockSize::B512, 8);
    thick.thin_provisioning = false;
    let target = ScsiTarget::single(1, thick).unwrap();
    let (_, pages) = run(&target, 0, inquiry(true, 0, 255), 255);
    assert_eq!(&pages[4..], &[0x00, 0x80, 0x83, 0xB0, 0xB1]);
    let (response, _) = run(&target, 0, inquiry(true, 0xB2, 255), 255);
    invalid_field(&response, FieldPointer::byte(2));
}

// ---------------------------------------------------------- READ CAPACITY

#[test]
fn read_capacity10_golden() {
    let target = target();
    let rc10 = CdbRepr::ReadCapacity10(ReadCapacity10Cdb::default());
    let (response, data) = run(&target, 0, rc10, 8);
    good(&response);
    assert_eq!(data, [0x00, 0x00, 0x07, 0xFF, 0x00, 0x00, 0x02, 0x00]);
    let (_, data) = run(&target, 5, rc10, 8);
    assert_eq!(data, [0x00, 0x00, 0x01, 0x2B, 0x00, 0x00, 0x10, 0x00]);
    // LBA without PMI is an invalid field; with PMI it is accepted.
    let with_lba = CdbRepr::ReadCapacity10(ReadCapacity10Cdb { lba: 1, pmi: false });
    let (response, _) = run(&target, 0, with_lba, 8);
    invalid_field(&response, FieldPointer::byte(2));
    let pmi = CdbRepr::ReadCapacity10(ReadCapacity10Cdb { lba: 1, pmi: true });
    good(&run(&target, 0, pmi, 8).0);
    // A capacity beyond 32 bits reports 0xFFFFFFFF.
    let huge = ScsiTarget::single(2, LunConfig::new(BlockSize::B512, 1 << 33)).unwrap();
    let (response, data) = run(&huge, 0, rc10, 8);
    good(&response);
    assert_eq!(&data[..4], &[0xFF; 4]);
}

#[test]
fn read_capacity16_golden_and_truncation() {
    let target = target();
    let rc16 = |alloc_len| {
        CdbRepr::ReadCapacity16(ReadCapacity16Cdb {
            lba: 0,
            alloc_len,
            pmi: false,
        })
    };
    let (response, data) = run(&target, 0, rc16(32), 32);
    good(&response);
    let mut expected = vec![
        0, 0, 0, 0, 0, 0, 0x07, 0xFF, 0x00, 0x00, 0x02, 0x00, 0, 0, 0xC0, 0,
    ];
    expected.resize(32, 0);
    assert_eq!(data, expected);
    let (response, data) = run(&target, 0, rc16(12), 32);
    good(&response);
    assert_eq!(data, &expected[..12]);
    assert_eq!(response.data_in_residual, Residual::Underflow(20));
    let huge = ScsiTarget::single(2, LunConfig::new(BlockSize::B4096, 1 << 33)).unwrap();
    let (_, data) = run(&huge, 0, rc16(32), 32);
    let parsed = ReadCapacity16Repr::parse(&ReadCapacity16Data::new_unchecked(&data[..])).unwrap();
    assert_eq!(parsed.last_lba, (1 << 33) - 1);
    assert_eq!(parsed.block_len, 4096);
    // Service action other than 0x10 under SERVICE ACTION IN(16).
    let mut other = cdb(rc16(32));
    other[1] = 0x11;
    let (response, _) = target.execute_to_vec(&Request::new(lun(0), &other, 32));
    invalid_field(&response, FieldPointer::bit(1, 4));
}

// ------------------------------------------------------------ READ / WRITE

#[test]
fn write_then_read_every_cdb_size_and_block_size() {
    let target = target();
    for (index, block_len, blocks_total) in [(0u16, 512usize, LUN0_BLOCKS), (5, 4096, LUN5_BLOCKS)]
    {
        for (n, size) in [
            CdbSize::Six,
            CdbSize::Ten,
            CdbSize::Twelve,
            CdbSize::Sixteen,
        ]
        .into_iter()
        .enumerate()
        {
            let lba = 3 + n as u64 * 20;
            let blocks = 7u32;
            let data = pattern(n as u8 + index as u8, blocks as usize * block_len);
            let rw = ReadWriteCdb {
                size,
                ..ReadWriteCdb::new(lba, blocks)
            };
            let response = run_out(&target, index, CdbRepr::Write(rw), &data);
            good(&response);
            assert_eq!(response.data_out_residual, Residual::None);
            let (response, back) = run(&target, index, CdbRepr::Read(rw), data.len() as u32);
            good(&response);
            assert_eq!(back, data, "LUN {index} {size:?}");
            assert_eq!(response.data_in_residual, Residual::None);
        }
        // The last block is readable, the one after is not.
        good(&run(&target, index, read(blocks_total - 1, 1), block_len as u32).0);
    }
    let stats = target.lun(0).unwrap().stats();
    assert_eq!(stats.writes, 4);
    assert_eq!(stats.reads, 5, "four read-backs and the last block");
    assert_eq!(stats.bytes_written, 4 * 7 * 512);
}

#[test]
fn read6_of_256_blocks_and_unwritten_blocks_read_as_zero() {
    let target = target();
    let read6 = CdbRepr::Read(ReadWriteCdb {
        size: CdbSize::Six,
        ..ReadWriteCdb::new(100, 256)
    });
    // The 6-byte CDB carries 0 for 256 blocks.
    assert_eq!(cdb(read6)[4], 0);
    let (response, data) = run(&target, 0, read6, 256 * 512);
    good(&response);
    assert_eq!(data.len(), 256 * 512);
    assert!(data.iter().all(|b| *b == 0));
}

#[test]
fn read_into_a_short_buffer_sends_what_fits() {
    let target = target();
    let data = pattern(9, 8 * 512);
    good(&run_out(&target, 0, write(10, 8), &data));
    let (response, back) = run(&target, 0, read(10, 8), 1000);
    good(&response);
    assert_eq!(back, &data[..1000]);
    assert_eq!(response.data_in_len, 1000);
    assert_eq!(
        response.data_in_residual,
        Residual::Overflow(8 * 512 - 1000)
    );
    // A larger buffer than the command needs: underflow.
    let (response, back) = run(&target, 0, read(10, 1), 4096);
    good(&response);
    assert_eq!(back, &data[..512]);
    assert_eq!(response.data_in_residual, Residual::Underflow(4096 - 512));
}

#[test]
fn data_in_pieces_come_straight_from_the_store() {
    // A read that spans chunks arrives in one piece per chunk.
    let target = target();
    let chunk = target.lun(0).unwrap().store().chunk_bytes() as usize;
    let blocks = (2 * chunk / 512) as u32;
    let data = pattern(1, blocks as usize * 512);
    good(&run_out(&target, 0, write(64, blocks), &data));
    let mut pieces = Vec::new();
    let read_cdb = cdb(read(64, blocks));
    let request = Request::new(lun(0), &read_cdb, data.len() as u32);
    let response = target.execute(&request, &mut |piece| pieces.push(piece.to_vec()));
    good(&response);
    assert_eq!(
        pieces.len(),
        3,
        "64 blocks into the first chunk, so 3 pieces"
    );
    assert_eq!(pieces.concat(), data);
}

#[test]
fn lba_out_of_range() {
    let target = target();
    for repr in [
        read(LUN0_BLOCKS, 1),
        read(LUN0_BLOCKS - 1, 2),
        CdbRepr::Read(ReadWriteCdb::new(u64::MAX, 2)),
        CdbRepr::Write(ReadWriteCdb::new(u64::MAX - 1, 4)),
    ] {
        let (response, data) = run(&target, 0, repr, 4096);
        check(
            &response,
            SenseKey::IllegalRequest,
            AdditionalSense::LBA_OUT_OF_RANGE,
        );
        assert!(data.is_empty());
        assert_eq!(response.data_in_residual, Residual::Underflow(4096));
    }
    // A write out of range changes nothing and consumes nothing.
    let response = run_out(&target, 0, write(LUN0_BLOCKS - 1, 2), &[0xFF; 1024]);
    check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::LBA_OUT_OF_RANGE,
    );
    assert_eq!(response.data_out_residual, Residual::Underflow(1024));
    let (_, last) = run(&target, 0, read(LUN0_BLOCKS - 1, 1), 512);
    assert!(last.iter().all(|b| *b == 0));
    // Zero blocks at the capacity is in range (SBC: nothing is accessed).
    good(&run(&target, 0, read(LUN0_BLOCKS, 0), 0).0);
    assert_eq!(target.lun(0).unwrap().stats().check_conditions, 5);
}

#[test]
fn transfer_length_and_protect_fields() {
    let mut config = LunConfig::new(BlockSize::B512, 1024);
    config.max_transfer_blocks = 16;
    let target = ScsiTarget::single(3, config).unwrap();
    for (size, byte) in [
        (CdbSize::Six, 4),
        (CdbSize::Ten, 7),
        (CdbSize::Twelve, 6),
        (CdbSize::Sixteen, 10),
    ] {
        let rw = ReadWriteCdb {
            size,
            ..ReadWriteCdb::new(0, 17)
        };
        invalid_field(
            &run(&target, 0, CdbRepr::Read(rw), 1 << 20).0,
            FieldPointer::byte(byte),
        );
        let response = run_out(&target, 0, CdbRepr::Write(rw), &[0; 17 * 512]);
        invalid_field(&response, FieldPointer::byte(byte));
    }
    good(&run(&target, 0, read(0, 16), 16 * 512).0);
    let protected = CdbRepr::Read(ReadWriteCdb {
        protect: 1,
        ..ReadWriteCdb::new(0, 1)
    });
    invalid_field(&run(&target, 0, protected, 512).0, FieldPointer::bit(1, 7));
    // DPO and FUA are accepted.
    let fua = CdbRepr::Write(ReadWriteCdb {
        dpo: true,
        ..ReadWriteCdb::new(0, 1).with_fua(true)
    });
    good(&run_out(&target, 0, fua, &[1; 512]));
}

#[test]
fn zero_length_transfers_are_good() {
    let target = target();
    let (response, data) = run(&target, 0, read(5, 0), 0);
    good(&response);
    assert!(data.is_empty());
    let response = run_out(&target, 0, write(5, 0), &[]);
    good(&response);
    assert_eq!(response.data_out_residual, Residual::None);
}

#[test]
fn data_out_length_mismatch() {
    let target = target();
    // Too little data-out: rejected before anything is written.
    let response = run_out(&target, 0, write(0, 4), &[0xAA; 1500]);
    check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_COMMAND_IU,
    );
    assert_eq!(response.data_out_residual, Residual::Overflow(2048 - 1500));
    let (_, data) = run(&target, 0, read(0, 4), 2048);
    assert!(data.iter().all(|b| *b == 0));
    // A WRITE without any data-out buffer at all.
    let (response, _) = target.execute_to_vec(&Request::new(lun(0), &cdb(write(0, 1)), 0));
    assert_eq!(response.data_out_residual, Residual::Overflow(512));
    // Too much: the command's length wins, the rest is an underflow.
    let response = run_out(&target, 0, write(0, 1), &[0xBB; 700]);
    good(&response);
    assert_eq!(response.data_out_residual, Residual::Underflow(188));
    let (_, data) = run(&target, 0, read(0, 2), 1024);
    assert!(data[..512].iter().all(|b| *b == 0xBB));
    assert!(data[512..].iter().all(|b| *b == 0));
    // Data-out on a data-in command is not consumed.
    let inquiry_cdb = cdb(inquiry(false, 0, 36));
    let request = Request {
        data_in_capacity: 36,
        ..Request::with_data_out(lun(0), &inquiry_cdb, &[1, 2, 3])
    };
    let (response, _) = target.execute_to_vec(&request);
    good(&response);
    assert_eq!(response.data_out_residual, Residual::Underflow(3));
}

#[test]
fn read_only_unit() {
    let mut config = LunConfig::new(BlockSize::B512, 64);
    config.read_only = true;
    let target = ScsiTarget::single(4, config).unwrap();
    let response = run_out(&target, 0, write(0, 1), &[1; 512]);
    check(
        &response,
        SenseKey::DataProtect,
        AdditionalSense::WRITE_PROTECTED,
    );
    good(&run(&target, 0, read(0, 1), 512).0);
    // Range errors come before write protection.
    let response = run_out(&target, 0, write(64, 1), &[1; 512]);
    check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::LBA_OUT_OF_RANGE,
    );
    let (_, mode) = run(
        &target,
        0,
        CdbRepr::ModeSense(mode_sense(CdbSize::Six, 0x08, 255)),
        255,
    );
    assert_eq!(mode[2], 0x90, "WP and DPOFUA");
}

// ------------------------------------------------------------------ VERIFY

/// Runs a data-out command whose data-out is device memory holding
/// `data` (the SRP target's staging buffer), `len` bytes of it.
fn run_out_dma(
    target: &ScsiTarget,
    index: u16,
    repr: CdbRepr,
    data: &[u8],
    len: usize,
) -> Response {
    let memory = hca_lowlevel::sim::PhysMemory::new(1 << 20);
    let buf = memory.alloc(data.len().max(1)).unwrap();
    buf.write(0, data).unwrap();
    let cdb = cdb(repr);
    let request = Request {
        data_out: Some(DataOut::dma(&buf, len).unwrap()),
        ..Request::new(lun(index), &cdb, 0)
    };
    let (response, data_in) = target.execute_to_vec(&request);
    assert!(data_in.is_empty());
    response
}

#[test]
fn device_memory_data_out_is_checked_and_stored_as_bytes_are() {
    let target = target();
    // Across the store's first chunk end (64 KiB = block 128).
    let data = pattern(5, 200 * 512);
    let response = run_out_dma(&target, 0, write(20, 200), &data, data.len());
    good(&response);
    assert_eq!(response.data_out_residual, Residual::None);
    assert_eq!(run(&target, 0, read(20, 200), 200 * 512).1, data);
    // Too little: rejected before anything is written, with the residual.
    let response = run_out_dma(&target, 0, write(300, 4), &[0xAA; 2048], 1500);
    check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_COMMAND_IU,
    );
    assert_eq!(response.data_out_residual, Residual::Overflow(2048 - 1500));
    assert!(
        run(&target, 0, read(300, 4), 2048)
            .1
            .iter()
            .all(|b| *b == 0)
    );
    // Too much: the command's length wins; the bytes past it stay out.
    let response = run_out_dma(&target, 0, write(300, 1), &[0xBB; 700], 700);
    good(&response);
    assert_eq!(response.data_out_residual, Residual::Underflow(188));
    let back = run(&target, 0, read(300, 2), 1024).1;
    assert!(back[..512].iter().all(|b| *b == 0xBB));
    assert!(back[512..].iter().all(|b| *b == 0));
    // VERIFY compares device memory too.
    good(&run_out_dma(
        &target,
        0,
        verify(20, 4, 1),
        &data[..2048],
        2048,
    ));
    let mut wrong = data[..2048].to_vec();
    wrong[777] ^= 1;
    let sense = check(
        &run_out_dma(&target, 0, verify(20, 4, 1), &wrong, 2048),
        SenseKey::Miscompare,
        AdditionalSense::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(sense.information, Some(777));
    // UNMAP reads its parameter list from device memory.
    let list = unmap_list(&[(20, 8)]);
    good(&run_out_dma(
        &target,
        0,
        unmap(list.len()),
        &list,
        list.len(),
    ));
    assert!(run(&target, 0, read(20, 8), 4096).1.iter().all(|b| *b == 0));
    assert_eq!(run(&target, 0, read(28, 1), 512).1, data[8 * 512..9 * 512]);
    // A write-protected unit refuses it as it refuses bytes.
    let mut config = LunConfig::new(BlockSize::B512, 64);
    config.read_only = true;
    let mut protected = ScsiTarget::new(TargetConfig::new(TARGET_ID));
    protected.add_lun(0, config).unwrap();
    check(
        &run_out_dma(&protected, 0, write(0, 1), &[1; 512], 512),
        SenseKey::DataProtect,
        AdditionalSense::WRITE_PROTECTED,
    );
}

fn verify(lba: u64, blocks: u32, bytchk: u8) -> CdbRepr {
    CdbRepr::Verify(VerifyCdb {
        size: CdbSize::Ten,
        lba,
        blocks,
        protect: 0,
        dpo: false,
        bytchk,
        group: 0,
    })
}

#[test]
fn verify_medium_compare_and_miscompare() {
    let target = target();
    let data = pattern(3, 4 * 512);
    good(&run_out(&target, 0, write(40, 4), &data));
    good(&run(&target, 0, verify(40, 4, 0), 0).0);
    let response = run_out(&target, 0, verify(40, 4, 1), &data);
    good(&response);
    assert_eq!(response.data_out_residual, Residual::None);
    let mut wrong = data.clone();
    wrong[1234] ^= 0x40;
    let sense = check(
        &run_out(&target, 0, verify(40, 4, 1), &wrong),
        SenseKey::Miscompare,
        AdditionalSense::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(sense.information, Some(1234));
    // BYTCHK 11b: one block compared with each block.
    let same = vec![0x77; 512];
    good(&run_out(&target, 0, write(100, 1), &same));
    good(&run_out(&target, 0, write(101, 1), &same));
    let response = run_out(&target, 0, verify(100, 2, 3), &same);
    good(&response);
    let sense = check(
        &run_out(&target, 0, verify(100, 3, 3), &same),
        SenseKey::Miscompare,
        AdditionalSense::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(sense.information, Some(2 * 512), "block 102 is zeros");
    // BYTCHK 10b is reserved; VRPROTECT is not supported; range checked.
    invalid_field(
        &run(&target, 0, verify(0, 1, 2), 0).0,
        FieldPointer::bit(1, 2),
    );
    let protected = CdbRepr::Verify(VerifyCdb {
        protect: 2,
        ..match verify(0, 1, 0) {
            CdbRepr::Verify(v) => v,
            _ => unreachable!(),
        }
    });
    invalid_field(&run(&target, 0, protected, 0).0, FieldPointer::bit(1, 7));
    check(
        &run(&target, 0, verify(LUN0_BLOCKS, 1, 0), 0).0,
        SenseKey::IllegalRequest,
        AdditionalSense::LBA_OUT_OF_RANGE,
    );
    // Short data-out for a comparing VERIFY.
    check(
        &run_out(&target, 0, verify(40, 4, 1), &data[..100]),
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_COMMAND_IU,
    );
}

#[test]
fn miscompare_beyond_32_bits_uses_descriptor_sense_bytes() {
    // A fixed-format LU whose miscompare offset needs 64 bits still puts
    // valid bytes on the wire (descriptor format).
    let response = Response {
        status: Status::CHECK_CONDITION,
        sense: Some(
            SenseRepr::new(
                SenseKey::Miscompare,
                AdditionalSense::MISCOMPARE_DURING_VERIFY,
            )
            .with_information(1 << 32),
        ),
        data_in_len: 0,
        data_in_residual: Residual::None,
        data_out_residual: Residual::None,
    };
    let bytes = response.sense_bytes().unwrap();
    assert_eq!(bytes[0], 0x72);
    assert_eq!(SenseRepr::parse(&bytes).unwrap().information, Some(1 << 32));
}

// ------------------------------------------------------- SYNCHRONIZE CACHE

#[test]
fn synchronize_cache_10_and_16() {
    let target = target();
    let sync = |size, lba, blocks| {
        CdbRepr::SynchronizeCache(SynchronizeCacheCdb {
            size,
            lba,
            blocks,
            immed: false,
            group: 0,
        })
    };
    good(&run(&target, 0, sync(CdbSize::Ten, 0, 0), 0).0);
    good(&run(&target, 0, sync(CdbSize::Sixteen, 100, 1948), 0).0);
    good(&run(&target, 0, sync(CdbSize::Ten, LUN0_BLOCKS - 1, 0), 0).0);
    for (size, lba, blocks) in [
        (CdbSize::Ten, LUN0_BLOCKS, 0),
        (CdbSize::Sixteen, 100, 1949),
        (CdbSize::Sixteen, u64::MAX, 1),
    ] {
        check(
            &run(&target, 0, sync(size, lba, blocks), 0).0,
            SenseKey::IllegalRequest,
            AdditionalSense::LBA_OUT_OF_RANGE,
        );
    }
    assert_eq!(target.lun(0).unwrap().stats().syncs, 3);
}

// ---------------------------------------------------- TUR, REQUEST SENSE

#[test]
fn test_unit_ready_and_request_sense() {
    let target = target();
    let (response, data) = run(&target, 0, CdbRepr::TestUnitReady, 0);
    good(&response);
    assert!(data.is_empty());
    let request_sense =
        |desc, alloc_len| CdbRepr::RequestSense(RequestSenseCdb { desc, alloc_len });
    let (response, data) = run(&target, 0, request_sense(false, 252), 252);
    good(&response);
    assert_eq!(
        data,
        [0x70, 0, 0, 0, 0, 0, 0, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    let (_, data) = run(&target, 0, request_sense(true, 252), 252);
    assert_eq!(data, [0x72, 0, 0, 0, 0, 0, 0, 0]);
    let (response, data) = run(&target, 0, request_sense(false, 8), 252);
    assert_eq!(data.len(), 8);
    assert_eq!(response.data_in_residual, Residual::Underflow(244));
}

// ------------------------------------------------------------- REPORT LUNS

fn report_luns(select_report: u8, alloc_len: u32) -> CdbRepr {
    CdbRepr::ReportLuns(ReportLunsCdb {
        select_report,
        alloc_len,
    })
}

#[test]
fn report_luns_golden_and_truncation() {
    let mut target = target();
    target
        .add_lun(300, LunConfig::new(BlockSize::B512, 8))
        .unwrap();
    let (response, data) = run(&target, 0, report_luns(0, 4096), 4096);
    good(&response);
    assert_eq!(
        data,
        [
            0, 0, 0, 24, 0, 0, 0, 0, // header
            0, 0, 0, 0, 0, 0, 0, 0, // LUN 0
            0, 5, 0, 0, 0, 0, 0, 0, // LUN 5
            0x41, 0x2C, 0, 0, 0, 0, 0, 0, // LUN 300, flat space addressing
        ]
    );
    // Truncated: the list length still describes the whole list.
    let (response, short) = run(&target, 0, report_luns(2, 12), 4096);
    good(&response);
    assert_eq!(short, &data[..12]);
    let view = ReportLunsData::new_checked(&short[..]).unwrap();
    assert_eq!(view.lun_count(), 3);
    // Well-known LUs only: none; reserved select report values rejected.
    let (_, none) = run(&target, 0, report_luns(1, 64), 64);
    assert_eq!(none, [0; 8]);
    invalid_field(
        &run(&target, 0, report_luns(0x07, 64), 64).0,
        FieldPointer::byte(2),
    );
    // REPORT LUNS works when addressed to a LUN that does not exist.
    let (response, data2) = run(&target, 9, report_luns(0, 4096), 4096);
    good(&response);
    assert_eq!(data2, data);
}

// ------------------------------------------------------------- absent LUNs

#[test]
fn absent_lun_answers() {
    let target = target();
    // Standard INQUIRY: peripheral qualifier 011b, device type 1Fh.
    let (response, data) = run(&target, 1, inquiry(false, 0, 96), 96);
    good(&response);
    assert_eq!(data, standard_inquiry_golden(0x7F));
    // Everything else: LOGICAL UNIT NOT SUPPORTED.
    for repr in [
        inquiry(true, 0x80, 96),
        CdbRepr::TestUnitReady,
        read(0, 1),
        CdbRepr::ReadCapacity10(ReadCapacity10Cdb::default()),
    ] {
        check(
            &run(&target, 1, repr, 96).0,
            SenseKey::IllegalRequest,
            AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED,
        );
    }
    // Even an unknown opcode: the LUN is checked first.
    let (response, _) = target.execute_to_vec(&Request::new(lun(1), &[0xC7; 16], 0));
    check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED,
    );
    // REQUEST SENSE: GOOD, with the reason in the data.
    let (response, data) = run(
        &target,
        1,
        CdbRepr::RequestSense(RequestSenseCdb {
            desc: false,
            alloc_len: 18,
        }),
        18,
    );
    good(&response);
    let sense = SenseRepr::parse(&data).unwrap();
    assert_eq!(sense.key, SenseKey::IllegalRequest);
    assert_eq!(sense.code, AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED);
    // A LUN in another addressing method is absent too.
    let logical_unit_addressing = Lun([0x80, 0, 0, 0, 0, 0, 0, 0]);
    let (response, data) = target.execute_to_vec(&Request::new(
        logical_unit_addressing,
        &cdb(inquiry(false, 0, 36)),
        36,
    ));
    good(&response);
    assert_eq!(data[0], 0x7F);
}

// ------------------------------------------------- opcode and CDB checks

#[test]
fn unknown_opcode_golden_sense() {
    let target = target();
    for opcode in [0x04u8, 0x15, 0x4D, 0xA3, 0xC0] {
        let (response, _) = target.execute_to_vec(&Request::new(lun(0), &[opcode; 16], 0));
        let sense = check(
            &response,
            SenseKey::IllegalRequest,
            AdditionalSense::INVALID_COMMAND_OPERATION_CODE,
        );
        assert_eq!(sense.field_pointer(), Some((true, FieldPointer::byte(0))));
        assert_eq!(
            &*response.sense_bytes().unwrap(),
            &[
                0x70, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x20, 0x00,
                0x00, 0xC0, 0x00, 0x00
            ]
        );
    }
}

#[test]
fn control_byte_and_malformed_cdbs() {
    let target = target();
    let mut tur = [0u8; 6];
    tur[5] = 0x04; // NACA
    invalid_field(
        &target.execute_to_vec(&Request::new(lun(0), &tur, 0)).0,
        FieldPointer::bit(5, 2),
    );
    let mut read10 = cdb(read(0, 1));
    read10[9] = 0x01; // LINK
    invalid_field(
        &target.execute_to_vec(&Request::new(lun(0), &read10, 512)).0,
        FieldPointer::bit(9, 0),
    );
    invalid_field(
        &target.execute_to_vec(&Request::new(lun(0), &[], 0)).0,
        FieldPointer::byte(0),
    );
    let (response, _) = target.execute_to_vec(&Request::new(lun(0), &read10[..7], 512));
    let sense = check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_CDB,
    );
    assert_eq!(sense.field_pointer(), None);
}

// -------------------------------------------------------------- MODE SENSE

#[test]
fn mode_sense6_caching_page_golden() {
    let target = target();
    let (response, data) = run(
        &target,
        0,
        CdbRepr::ModeSense(mode_sense(CdbSize::Six, 0x08, 255)),
        255,
    );
    good(&response);
    let mut expected = vec![0x1F, 0x00, 0x10, 0x08];
    expected.extend_from_slice(&[0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x02, 0x00]);
    let mut caching = vec![0x08, 0x12, 0x04];
    caching.resize(20, 0);
    expected.extend_from_slice(&caching);
    assert_eq!(data, expected);
    // Header only: the mode data length still counts the whole answer.
    let (response, data) = run(
        &target,
        0,
        CdbRepr::ModeSense(mode_sense(CdbSize::Six, 0x08, 4)),
        255,
    );
    good(&response);
    assert_eq!(data, &expected[..4]);
}

#[test]
fn mode_sense10_long_lba_control_page_golden() {
    let target = target();
    let (response, data) = run(
        &target,
        5,
        CdbRepr::ModeSense(ModeSenseCdb {
            llbaa: true,
            ..mode_sense(CdbSize::Ten, 0x0A, 512)
        }),
        512,
    );
    good(&response);
    let mut expected = vec![0x00, 0x22, 0x00, 0x10, 0x01, 0x00, 0x00, 0x10];
    expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x01, 0x2C, 0, 0, 0, 0, 0, 0, 0x10, 0x00]);
    expected.extend_from_slice(&[0x0A, 0x0A, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(data, expected);
}

#[test]
fn mode_sense_all_pages_dbd_and_page_control() {
    let target = target();
    let all = ModeSenseCdb {
        dbd: true,
        ..mode_sense(CdbSize::Ten, 0x3F, 512)
    };
    let (response, data) = run(&target, 0, CdbRepr::ModeSense(all), 512);
    good(&response);
    assert_eq!(data.len(), 8 + 20 + 12);
    assert_eq!(
        &data[..8],
        &[0x00, 0x26, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00]
    );
    assert_eq!((data[8], data[28]), (0x08, 0x0A));
    // All pages and subpages.
    let (response, again) = run(
        &target,
        0,
        CdbRepr::ModeSense(ModeSenseCdb {
            subpage: 0xFF,
            ..all
        }),
        512,
    );
    good(&response);
    assert_eq!(again, data);
    // Changeable values: nothing is changeable.
    let (response, mask) = run(
        &target,
        0,
        CdbRepr::ModeSense(ModeSenseCdb {
            page_control: PageControl::Changeable,
            ..all
        }),
        512,
    );
    good(&response);
    assert_eq!(mask[8 + 2], 0, "WCE not changeable");
    assert!(mask[8 + 2..28].iter().all(|b| *b == 0));
    // Default values equal current ones.
    let (_, defaults) = run(
        &target,
        0,
        CdbRepr::ModeSense(ModeSenseCdb {
            page_control: PageControl::Default,
            ..all
        }),
        512,
    );
    assert_eq!(defaults, data);
    // Saved values are not supported.
    let sense = check(
        &run(
            &target,
            0,
            CdbRepr::ModeSense(ModeSenseCdb {
                page_control: PageControl::Saved,
                ..all
            }),
            512,
        )
        .0,
        SenseKey::IllegalRequest,
        AdditionalSense::SAVING_PARAMETERS_NOT_SUPPORTED,
    );
    assert_eq!(sense.field_pointer(), Some((true, FieldPointer::bit(2, 7))));
    invalid_field(
        &run(
            &target,
            0,
            CdbRepr::ModeSense(mode_sense(CdbSize::Six, 0x1C, 255)),
            255,
        )
        .0,
        FieldPointer::bit(2, 5),
    );
    invalid_field(
        &run(
            &target,
            0,
            CdbRepr::ModeSense(ModeSenseCdb { subpage: 1, ..all }),
            512,
        )
        .0,
        FieldPointer::byte(3),
    );
}

#[test]
fn write_cache_and_descriptor_sense_switches() {
    let mut config = LunConfig::new(BlockSize::B512, 64);
    config.write_cache = false;
    config.descriptor_sense = true;
    let target = ScsiTarget::single(5, config).unwrap();
    let (_, caching) = run(
        &target,
        0,
        CdbRepr::ModeSense(ModeSenseCdb {
            dbd: true,
            ..mode_sense(CdbSize::Six, 0x08, 255)
        }),
        255,
    );
    assert_eq!(caching[4 + 2], 0, "WCE off");
    let (_, control) = run(
        &target,
        0,
        CdbRepr::ModeSense(ModeSenseCdb {
            dbd: true,
            ..mode_sense(CdbSize::Six, 0x0A, 255)
        }),
        255,
    );
    assert_eq!(control[4 + 2], 0x04, "D_SENSE");
    let (response, _) = run(&target, 0, read(64, 1), 512);
    let sense = check(
        &response,
        SenseKey::IllegalRequest,
        AdditionalSense::LBA_OUT_OF_RANGE,
    );
    assert_eq!(sense.format, SenseFormat::Descriptor);
    assert_eq!(
        &*response.sense_bytes().unwrap(),
        &[0x72, 0x05, 0x21, 0x00, 0x00, 0x00, 0x00, 0x00]
    );
}

// ------------------------------------------------------------------- UNMAP

fn unmap_list(ranges: &[(u64, u32)]) -> Vec<u8> {
    let descriptors = ranges.len() * 16;
    let mut list = Vec::new();
    list.extend_from_slice(&((descriptors + 6) as u16).to_be_bytes());
    list.extend_from_slice(&(descriptors as u16).to_be_bytes());
    list.extend_from_slice(&[0; 4]);
    for &(lba, blocks) in ranges {
        list.extend_from_slice(&lba.to_be_bytes());
        list.extend_from_slice(&blocks.to_be_bytes());
        list.extend_from_slice(&[0; 4]);
    }
    list
}

fn unmap(len: usize) -> CdbRepr {
    CdbRepr::Unmap(UnmapCdb {
        anchor: false,
        group: 0,
        param_list_len: len as u16,
    })
}

#[test]
fn unmap_deallocates_and_validates_first() {
    let target = target();
    let lu = Arc::clone(target.lun(0).unwrap());
    good(&run_out(&target, 0, write(0, 512), &[0xEE; 512 * 512]));
    let chunks_before = lu.store().allocated_chunks();
    let list = unmap_list(&[(0, 128), (200, 8)]);
    let response = run_out(&target, 0, unmap(list.len()), &list);
    good(&response);
    assert_eq!(lu.stats().unmapped_blocks, 136);
    let (_, data) = run(&target, 0, read(0, 256), 256 * 512);
    assert!(data[..128 * 512].iter().all(|b| *b == 0));
    assert!(data[128 * 512..200 * 512].iter().all(|b| *b == 0xEE));
    assert!(data[200 * 512..208 * 512].iter().all(|b| *b == 0));
    assert!(data[208 * 512..].iter().all(|b| *b == 0xEE));
    assert_eq!(
        lu.store().allocated_chunks(),
        chunks_before - 1,
        "first 64 KiB freed"
    );

    // One descriptor out of range: nothing is unmapped.
    let list = unmap_list(&[(300, 8), (LUN0_BLOCKS, 1)]);
    check(
        &run_out(&target, 0, unmap(list.len()), &list),
        SenseKey::IllegalRequest,
        AdditionalSense::LBA_OUT_OF_RANGE,
    );
    let (_, data) = run(&target, 0, read(300, 8), 8 * 512);
    assert!(data.iter().all(|b| *b == 0xEE));
    // Parameter list too short for its header.
    check(
        &run_out(&target, 0, unmap(4), &[0; 4]),
        SenseKey::IllegalRequest,
        AdditionalSense::PARAMETER_LIST_LENGTH_ERROR,
    );
    // No parameter list: nothing to do.
    good(&run_out(&target, 0, unmap(0), &[]));
    // Too many descriptors.
    let many: Vec<_> = (0..257).map(|i| (i, 1)).collect();
    let list = unmap_list(&many);
    let sense = check(
        &run_out(&target, 0, unmap(list.len()), &list),
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    assert_eq!(sense.field_pointer(), Some((false, FieldPointer::byte(2))));
    // ANCHOR is not supported.
    let anchored = CdbRepr::Unmap(UnmapCdb {
        anchor: true,
        group: 0,
        param_list_len: 24,
    });
    invalid_field(
        &run_out(&target, 0, anchored, &unmap_list(&[(0, 1)])),
        FieldPointer::bit(1, 0),
    );
    // Without thin provisioning UNMAP is an unknown command.
    let mut thick = LunConfig::new(BlockSize::B512, 8);
    thick.thin_provisioning = false;
    let thick = ScsiTarget::single(6, thick).unwrap();
    let list = unmap_list(&[(0, 1)]);
    check(
        &run_out(&thick, 0, unmap(list.len()), &list),
        SenseKey::IllegalRequest,
        AdditionalSense::INVALID_COMMAND_OPERATION_CODE,
    );
}

// ------------------------------------------------------------ fault hooks

#[test]
fn fault_hooks_answer_then_step_aside() {
    let target = target();
    target
        .faults()
        .push(FaultRule::sense(SenseKey::UnitAttention, AdditionalSense::POWER_ON_RESET).times(2));
    for _ in 0..2 {
        check(
            &run(&target, 0, CdbRepr::TestUnitReady, 0).0,
            SenseKey::UnitAttention,
            AdditionalSense::POWER_ON_RESET,
        );
    }
    good(&run(&target, 0, CdbRepr::TestUnitReady, 0).0);

    target.faults().push(
        FaultRule::status(Status::BUSY)
            .only(FaultFilter::Writes)
            .on_lun(5),
    );
    target
        .faults()
        .push(FaultRule::status(Status::TASK_SET_FULL).only(FaultFilter::Reads));
    // A write to LUN 0 is not BUSY; the write to LUN 5 is, once, and is not
    // executed.
    good(&run_out(&target, 0, write(0, 1), &[1; 512]));
    let response = run_out(&target, 5, write(0, 1), &[2; 4096]);
    assert_eq!(response.status, Status::BUSY);
    assert_eq!(response.sense, None);
    assert_eq!(response.data_out_residual, Residual::Underflow(4096));
    let (_, block) = run(&target, 5, read(0, 1), 4096);
    assert_eq!(block, Vec::<u8>::new(), "the read met TASK SET FULL");
    let (response, block) = run(&target, 5, read(0, 1), 4096);
    good(&response);
    assert!(block.iter().all(|b| *b == 0), "the BUSY write was not done");
    assert_eq!(target.faults().fired(), 4);
    assert_eq!(target.faults().pending(), 0);

    // A delayed command is executed after the delay.
    let delay = Duration::from_millis(20);
    target.faults().push(FaultRule::delay(delay));
    let started = Instant::now();
    good(&run(&target, 0, CdbRepr::TestUnitReady, 0).0);
    assert!(started.elapsed() >= delay);
    // Faults apply to absent LUNs too (a misbehaving target is misbehaving
    // everywhere).
    target
        .faults()
        .push(FaultRule::status(Status::ACA_ACTIVE).forever());
    assert_eq!(
        run(&target, 9, CdbRepr::TestUnitReady, 0).0.status,
        Status::ACA_ACTIVE
    );
    assert_eq!(
        run(&target, 0, read(0, 1), 512).0.status,
        Status::ACA_ACTIVE
    );
    target.faults().clear();
    good(&run(&target, 0, read(0, 1), 512).0);
}

// ------------------------------------------------------------ configuration

#[test]
fn configuration_errors() {
    let mut target = target();
    assert_eq!(
        target
            .add_lun(5, LunConfig::new(BlockSize::B512, 1))
            .unwrap_err(),
        ConfigError::DuplicateLun(5)
    );
    assert_eq!(
        target
            .add_lun(MAX_LUNS, LunConfig::new(BlockSize::B512, 1))
            .unwrap_err(),
        ConfigError::LunOutOfRange(MAX_LUNS)
    );
    assert_eq!(
        target
            .add_lun(6, LunConfig::new(BlockSize::B512, 0))
            .unwrap_err(),
        ConfigError::ZeroCapacity
    );
    assert_eq!(target.lun_indices().collect::<Vec<_>>(), [0, 5]);
}

// ------------------------------------------------------------- concurrency

/// Iterations of the stress tests: `SCSI_TARGET_STRESS_ITERS` (default 200).
fn stress_iterations() -> usize {
    std::env::var("SCSI_TARGET_STRESS_ITERS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(200)
}

#[test]
fn channels_on_separate_regions_keep_their_data() {
    let target = Arc::new(target());
    let iterations = stress_iterations();
    let threads: Vec<_> = (0..4u8)
        .map(|thread| {
            let target = Arc::clone(&target);
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(u64::from(thread));
                let base = u64::from(thread) * 512;
                for _ in 0..iterations {
                    let lba = base + rng.u64(0..500);
                    let blocks = rng.u32(1..=12);
                    let data = pattern(rng.u8(..), blocks as usize * 512);
                    good(&run_out(&target, 0, write(lba, blocks), &data));
                    let (response, back) = run(&target, 0, read(lba, blocks), data.len() as u32);
                    good(&response);
                    assert_eq!(back, data, "thread {thread} LBA {lba}");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(target.lun(0).unwrap().stats().writes, 4 * iterations as u64);
}

#[test]
fn concurrent_writes_to_the_same_blocks_never_tear_a_block() {
    // Writers fill 16 blocks with their own byte, over and over; readers
    // check every block they see is uniform. A block is never half one
    // writer's and half another's.
    let target = Arc::new(target());
    let iterations = stress_iterations();
    let writers: Vec<_> = (1..=3u8)
        .map(|id| {
            let target = Arc::clone(&target);
            std::thread::spawn(move || {
                let data = vec![id; 16 * 512];
                for _ in 0..iterations {
                    good(&run_out(&target, 0, write(120, 16), &data));
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let target = Arc::clone(&target);
            std::thread::spawn(move || {
                for _ in 0..iterations {
                    let (response, data) = run(&target, 0, read(120, 16), 16 * 512);
                    good(&response);
                    for block in data.chunks(512) {
                        assert!(block.iter().all(|b| *b == block[0]), "torn block");
                    }
                }
            })
        })
        .collect();
    for thread in writers.into_iter().chain(readers) {
        thread.join().unwrap();
    }
}

// ------------------------------------------------- property: data integrity

#[derive(Debug, Clone)]
enum Op {
    Write {
        size: CdbSize,
        lba: u64,
        blocks: u32,
        seed: u8,
    },
    Read {
        size: CdbSize,
        lba: u64,
        blocks: u32,
    },
    Unmap {
        lba: u64,
        blocks: u32,
    },
}

/// A small unit (three 64 KiB chunks and a bit) so that ranges cross
/// chunk boundaries and the end of the medium often.
const MODEL_BLOCKS: u64 = 3 * 128 + 40;

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        Just(CdbSize::Six),
        Just(CdbSize::Ten),
        Just(CdbSize::Twelve),
        Just(CdbSize::Sixteen)
    ];
    let lba = 0..MODEL_BLOCKS + 8;
    prop_oneof![
        (size.clone(), lba.clone(), 1u32..200, any::<u8>()).prop_map(
            |(size, lba, blocks, seed)| Op::Write {
                size,
                lba,
                blocks,
                seed
            }
        ),
        (size, lba.clone(), 1u32..200).prop_map(|(size, lba, blocks)| Op::Read {
            size,
            lba,
            blocks
        }),
        (lba, 0u32..200).prop_map(|(lba, blocks)| Op::Unmap { lba, blocks }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    /// Any sequence of writes, reads and unmaps through the device server
    /// behaves like a plain byte array: in-range commands succeed and read
    /// back what was written, out-of-range ones fail and change nothing.
    #[test]
    fn the_unit_behaves_like_a_byte_array(ops in prop::collection::vec(op(), 1..24)) {
        let target = ScsiTarget::single(7, LunConfig::new(BlockSize::B512, MODEL_BLOCKS)).unwrap();
        let mut model = vec![0u8; MODEL_BLOCKS as usize * 512];
        for op in ops {
            match op {
                Op::Write { size, lba, blocks, seed } => {
                    let rw = ReadWriteCdb { size, ..ReadWriteCdb::new(lba, blocks) };
                    let data = pattern(seed, blocks as usize * 512);
                    let response = run_out(&target, 0, CdbRepr::Write(rw), &data);
                    if lba + u64::from(blocks) <= MODEL_BLOCKS {
                        good(&response);
                        let at = lba as usize * 512;
                        model[at..at + data.len()].copy_from_slice(&data);
                    } else {
                        prop_assert_eq!(response.status, Status::CHECK_CONDITION);
                    }
                }
                Op::Read { size, lba, blocks } => {
                    let rw = ReadWriteCdb { size, ..ReadWriteCdb::new(lba, blocks) };
                    let (response, data) = run(&target, 0, CdbRepr::Read(rw), blocks * 512);
                    if lba + u64::from(blocks) <= MODEL_BLOCKS {
                        good(&response);
                        let at = lba as usize * 512;
                        prop_assert!(data == model[at..at + data.len()], "read differs at LBA {}", lba);
                    } else {
                        prop_assert_eq!(response.status, Status::CHECK_CONDITION);
                        prop_assert!(data.is_empty());
                    }
                }
                Op::Unmap { lba, blocks } => {
                    let list = unmap_list(&[(lba, blocks)]);
                    let response = run_out(&target, 0, unmap(list.len()), &list);
                    if lba + u64::from(blocks) <= MODEL_BLOCKS {
                        good(&response);
                        let at = lba as usize * 512;
                        model[at..at + blocks as usize * 512].fill(0);
                    } else {
                        prop_assert_eq!(response.status, Status::CHECK_CONDITION);
                    }
                }
            }
        }
        let mut medium = Vec::new();
        target.lun(0).unwrap().read_blocks(0, MODEL_BLOCKS, &mut |piece| medium.extend_from_slice(piece)).unwrap();
        prop_assert!(medium == model, "final medium differs from the model");
    }

    /// Arbitrary CDBs never panic the device server, and every answer is
    /// consistent: GOOD without sense, CHECK CONDITION with parseable sense,
    /// never more data-in than the buffer.
    #[test]
    fn arbitrary_cdbs_get_a_defined_answer(
        cdb in prop::collection::vec(any::<u8>(), 0..20),
        index in prop_oneof![Just(0u16), Just(5), Just(1)],
        capacity in 0u32..70_000,
        data_out in prop::collection::vec(any::<u8>(), 0..600),
    ) {
        let target = target();
        let request = Request {
            lun: lun(index),
            cdb: &cdb,
            data_out: Some(DataOut::Bytes(&data_out)),
            data_in_capacity: capacity,
        };
        let (response, data) = target.execute_to_vec(&request);
        prop_assert!(data.len() as u64 <= u64::from(capacity));
        prop_assert_eq!(data.len() as u32, response.data_in_len);
        match response.status {
            Status::GOOD => prop_assert!(response.sense.is_none()),
            Status::CHECK_CONDITION => {
                let bytes = response.sense_bytes().unwrap();
                prop_assert_eq!(SenseRepr::parse(&bytes), Ok(response.sense.unwrap()));
            }
            other => prop_assert!(false, "unexpected status {:?}", other),
        }
    }
}
