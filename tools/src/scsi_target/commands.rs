//! The device server: one function per command, and the order of checks
//! described in the module documentation of [`super`].

use storport_srp::scsi::cdb::{
    InquiryCdb, ModeSenseCdb, ReadWriteCdb, ReportLunsCdb, RequestSenseCdb, SynchronizeCacheCdb,
    UnmapCdb, VerifyCdb,
};
use storport_srp::scsi::data::{
    ReadCapacity10Data, ReadCapacity10Repr, ReadCapacity16Data, ReadCapacity16Repr,
    emit_report_luns, report_luns_len,
};
use storport_srp::scsi::{
    AdditionalSense, Cdb, CdbError, CdbRepr, CdbSize, FieldPointer, SenseFormat, SenseKey,
    SenseRepr, Status,
};
use storport_srp::wire::Residual;

use super::fault::FaultAction;
use super::lu::LogicalUnit;
use super::pages::{self, MAX_UNMAP_DESCRIPTORS, ModeSenseError};
use super::{DataInSink, DataOut, Request, Response, ScsiTarget};

/// A command that did not complete with GOOD.
#[derive(Debug, Clone, Copy)]
struct Failure {
    status: Status,
    sense: Option<SenseRepr>,
    /// Set when the failure is about the data-out length itself.
    data_out_residual: Option<Residual>,
}

impl Failure {
    fn check(key: SenseKey, code: AdditionalSense) -> Self {
        Self {
            status: Status::CHECK_CONDITION,
            sense: Some(SenseRepr::new(key, code)),
            data_out_residual: None,
        }
    }

    fn illegal(code: AdditionalSense) -> Self {
        Self::check(SenseKey::IllegalRequest, code)
    }

    /// INVALID FIELD IN CDB pointing at `field`.
    fn invalid_field(field: FieldPointer) -> Self {
        Self::illegal(AdditionalSense::INVALID_FIELD_IN_CDB).pointing(true, field)
    }

    fn lba_out_of_range() -> Self {
        Self::illegal(AdditionalSense::LBA_OUT_OF_RANGE)
    }

    fn write_protected() -> Self {
        Self::check(SenseKey::DataProtect, AdditionalSense::WRITE_PROTECTED)
    }

    fn pointing(mut self, in_cdb: bool, field: FieldPointer) -> Self {
        self.sense = self.sense.map(|s| s.with_field_pointer(in_cdb, field));
        self
    }

    fn status(status: Status) -> Self {
        Self {
            status,
            sense: None,
            data_out_residual: None,
        }
    }
}

/// `Ok(data-out bytes consumed)` or the failure.
type Outcome = Result<u64, Failure>;

/// The data-in side of one command: what the command wanted to send, what
/// fitted the initiator's buffer.
struct DataIn<'s> {
    capacity: u64,
    wanted: u64,
    sent: u64,
    sink: &'s mut dyn DataInSink,
    /// Neither block nor allocate (see `ScsiTarget::try_execute`).
    nonblocking: bool,
    /// Set when a non-blocking command could not run to its end.
    declined: bool,
}

impl DataIn<'_> {
    /// Sends a built answer, truncated to the allocation length, then to the
    /// initiator's capacity.
    fn answer(&mut self, answer: &[u8], alloc_len: u64) {
        let wanted = (answer.len() as u64).min(alloc_len);
        let send = wanted.min(self.capacity);
        self.wanted = wanted;
        self.sent = send;
        if send > 0 {
            // CAST: send <= answer.len().
            self.sink.bytes(&answer[..send as usize]);
        }
    }

    /// Sends `len` bytes of the store at `offset`, as far as the initiator's
    /// buffer goes.
    fn send_from_store(&mut self, lu: &LogicalUnit, offset: u64, len: u64) {
        let send = len.min(self.capacity);
        self.wanted = len;
        self.sent = send;
        if send > 0 {
            self.declined = !self
                .sink
                .store_range(lu.store(), offset, send, self.nonblocking);
        }
    }
}

/// The residual of a buffer of `buffer` bytes for a command that wanted
/// `wanted` (counts saturate at `u32::MAX`).
fn residual(buffer: u64, wanted: u64) -> Residual {
    let narrow = |count: u64| u32::try_from(count).unwrap_or(u32::MAX);
    match wanted.cmp(&buffer) {
        std::cmp::Ordering::Greater => Residual::Overflow(narrow(wanted - buffer)),
        std::cmp::Ordering::Less => Residual::Underflow(narrow(buffer - wanted)),
        std::cmp::Ordering::Equal => Residual::None,
    }
}

pub(super) fn execute(
    target: &ScsiTarget,
    request: &Request<'_>,
    sink: &mut dyn DataInSink,
) -> Response {
    match execute_in(target, request, sink, false) {
        Some(response) => response,
        // Only a non-blocking run declines.
        None => Response {
            status: Status::BUSY,
            sense: None,
            data_in_len: 0,
            data_in_residual: Residual::None,
            data_out_residual: Residual::None,
        },
    }
}

/// `execute`, or with `nonblocking` its variant that declines (`None`)
/// instead of blocking or allocating.
pub(super) fn execute_in(
    target: &ScsiTarget,
    request: &Request<'_>,
    sink: &mut dyn DataInSink,
    nonblocking: bool,
) -> Option<Response> {
    if nonblocking && !runs_without_blocking(request.cdb) {
        return None;
    }
    let mut data_in = DataIn {
        capacity: u64::from(request.data_in_capacity),
        wanted: 0,
        sent: 0,
        sink,
        nonblocking,
        declined: false,
    };
    let data_out_len = request.data_out.map_or(0, |d| d.len()) as u64;
    let index = request.lun.index();
    let lu = index.and_then(|index| target.lun(index));
    let outcome = run(target, lu.map(AsRef::as_ref), request, &mut data_in);
    if data_in.declined {
        return None;
    }
    if let Some(lu) = lu {
        lu.count_command();
    }
    let (status, sense, data_out_residual) = match outcome {
        Ok(consumed) => (Status::GOOD, None, residual(data_out_len, consumed)),
        Err(failure) => {
            if failure.status == Status::CHECK_CONDITION {
                if let Some(lu) = lu {
                    lu.count_check_condition();
                }
            }
            (
                failure.status,
                failure.sense,
                failure
                    .data_out_residual
                    .unwrap_or(residual(data_out_len, 0)),
            )
        }
    };
    let format = match lu {
        Some(lu) if lu.config().descriptor_sense => SenseFormat::Descriptor,
        _ => SenseFormat::Fixed,
    };
    Some(Response {
        status,
        sense: sense.map(|sense| sense.in_format(format)),
        // CAST: sent <= capacity, a u32.
        data_in_len: data_in.sent as u32,
        data_in_residual: if status == Status::GOOD {
            residual(data_in.capacity, data_in.wanted)
        } else {
            residual(data_in.capacity, 0)
        },
        data_out_residual,
    })
}

/// Whether a command is one the non-blocking path runs: READ, WRITE and
/// TEST UNIT READY answer without building anything on the heap.
fn runs_without_blocking(cdb: &[u8]) -> bool {
    use storport_srp::scsi::Opcode;
    matches!(
        cdb.first().copied().map(Opcode),
        Some(
            Opcode::READ_6
                | Opcode::READ_10
                | Opcode::READ_12
                | Opcode::READ_16
                | Opcode::WRITE_6
                | Opcode::WRITE_10
                | Opcode::WRITE_12
                | Opcode::WRITE_16
                | Opcode::TEST_UNIT_READY
        )
    )
}

fn run(
    target: &ScsiTarget,
    lu: Option<&LogicalUnit>,
    request: &Request<'_>,
    data_in: &mut DataIn<'_>,
) -> Outcome {
    let view = Cdb::new_unchecked(request.cdb);
    if let Some(&opcode) = request.cdb.first() {
        let opcode = storport_srp::scsi::Opcode(opcode);
        if let Some((action, delay)) = target.faults().take(request.lun.index(), opcode) {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            match action {
                FaultAction::Sense(key, code) => return Err(Failure::check(key, code)),
                FaultAction::Status(status) => return Err(Failure::status(status)),
                FaultAction::Proceed => {}
            }
        }
    }
    match view.check_len() {
        Ok(()) => {}
        Err(CdbError::Empty) => return Err(Failure::invalid_field(FieldPointer::byte(0))),
        // The CDB is cut before its last byte: nothing to point at.
        Err(_) => return Err(Failure::illegal(AdditionalSense::INVALID_FIELD_IN_CDB)),
    }
    let Some(lu) = lu else {
        return absent_lun(target, &view, data_in);
    };
    let repr = match CdbRepr::parse(&view) {
        Ok(repr) => repr,
        Err(CdbError::InvalidField(field)) => return Err(Failure::invalid_field(field)),
        Err(_) => {
            return Err(
                Failure::illegal(AdditionalSense::INVALID_COMMAND_OPERATION_CODE)
                    .pointing(true, FieldPointer::byte(0)),
            );
        }
    };
    if view.naca() {
        return Err(Failure::invalid_field(view.naca_field()));
    }
    if view.control() & 0x01 != 0 {
        // LINK: linked commands are obsolete (SAM-5) and not supported.
        let last = view.naca_field().byte;
        return Err(Failure::invalid_field(FieldPointer::bit(last, 0)));
    }
    match repr {
        CdbRepr::TestUnitReady => Ok(0),
        CdbRepr::RequestSense(c) => request_sense(
            c,
            SenseRepr::new(SenseKey::NoSense, AdditionalSense::NO_ADDITIONAL_SENSE),
            data_in,
        ),
        CdbRepr::Inquiry(c) => inquiry(lu, c, data_in),
        CdbRepr::ModeSense(c) => mode_sense(lu, c, data_in),
        CdbRepr::ReadCapacity10(c) => {
            if !c.pmi && c.lba != 0 {
                return Err(Failure::invalid_field(FieldPointer::byte(2)));
            }
            let repr = ReadCapacity10Repr::for_capacity(lu.blocks(), lu.block_len());
            let mut out = [0u8; 8];
            emit_ok(repr.emit(&mut ReadCapacity10Data::new_unchecked(&mut out[..])));
            data_in.answer(&out, 8);
            Ok(0)
        }
        CdbRepr::ReadCapacity16(c) => {
            if !c.pmi && c.lba != 0 {
                return Err(Failure::invalid_field(FieldPointer::byte(2)));
            }
            let thin = lu.config().thin_provisioning;
            let repr = ReadCapacity16Repr {
                last_lba: lu.blocks() - 1,
                block_len: lu.block_len(),
                lbpme: thin,
                lbprz: thin,
                ..Default::default()
            };
            let mut out = [0u8; 32];
            emit_ok(repr.emit(&mut ReadCapacity16Data::new_unchecked(&mut out[..])));
            data_in.answer(&out, u64::from(c.alloc_len));
            Ok(0)
        }
        CdbRepr::Read(c) => {
            let (offset, len) = check_read_write(lu, &c)?;
            data_in.send_from_store(lu, offset, len);
            if !data_in.declined {
                lu.count_read(data_in.sent);
            }
            Ok(0)
        }
        CdbRepr::Write(c) => {
            let (offset, len) = check_read_write(lu, &c)?;
            if lu.config().read_only {
                return Err(Failure::write_protected());
            }
            let data = data_out(request, len)?;
            if data_in.nonblocking {
                if !lu.store().try_write_from(offset, data) {
                    data_in.declined = true;
                    return Ok(0);
                }
            } else {
                lu.store().write_from(offset, data);
            }
            lu.count_write(len);
            Ok(len)
        }
        CdbRepr::Verify(c) => verify(lu, c, request),
        CdbRepr::SynchronizeCache(c) => synchronize_cache(lu, c),
        CdbRepr::ReportLuns(c) => report_luns(target, c, data_in),
        CdbRepr::Unmap(c) => unmap(lu, c, request),
    }
}

/// The parameter-data emitters above only fail on a short buffer, and the
/// buffers are their exact size.
fn emit_ok<E: std::fmt::Debug>(result: Result<(), E>) {
    result.expect("parameter data buffer has its exact size");
}

/// The commands an absent LUN still answers (SPC-4 4.5.1, 6.4.2, 6.33).
fn absent_lun(target: &ScsiTarget, view: &Cdb<&[u8]>, data_in: &mut DataIn<'_>) -> Outcome {
    let not_supported = || Failure::illegal(AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED);
    match CdbRepr::parse(view) {
        Ok(CdbRepr::ReportLuns(c)) => report_luns(target, c, data_in),
        Ok(CdbRepr::Inquiry(c)) if !c.evpd && !c.cmddt && c.page_code == 0 => {
            let config = target.config();
            let answer =
                pages::standard_inquiry(&config.vendor, &config.product, &config.revision, false);
            data_in.answer(&answer, u64::from(c.alloc_len));
            Ok(0)
        }
        Ok(CdbRepr::RequestSense(c)) => request_sense(
            c,
            SenseRepr::new(
                SenseKey::IllegalRequest,
                AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED,
            ),
            data_in,
        ),
        _ => Err(not_supported()),
    }
}

/// REQUEST SENSE: autosense is always used, so there is never a pending
/// condition; `sense` says what to report, in the format DESC asks for.
fn request_sense(c: RequestSenseCdb, sense: SenseRepr, data_in: &mut DataIn<'_>) -> Outcome {
    let format = if c.desc {
        SenseFormat::Descriptor
    } else {
        SenseFormat::Fixed
    };
    let mut out = [0u8; 64];
    let len = sense
        .in_format(format)
        .emit(&mut out)
        .expect("sense without INFORMATION fits");
    data_in.answer(&out[..len], u64::from(c.alloc_len));
    Ok(0)
}

fn inquiry(lu: &LogicalUnit, c: InquiryCdb, data_in: &mut DataIn<'_>) -> Outcome {
    if c.cmddt {
        return Err(Failure::invalid_field(FieldPointer::bit(1, 1)));
    }
    let answer = if c.evpd {
        pages::vpd_page_for(lu, c.page_code)
            .ok_or_else(|| Failure::invalid_field(FieldPointer::byte(2)))?
    } else if c.page_code != 0 {
        return Err(Failure::invalid_field(FieldPointer::byte(2)));
    } else {
        let config = lu.config();
        pages::standard_inquiry(&config.vendor, &config.product, &config.revision, true)
    };
    data_in.answer(&answer, u64::from(c.alloc_len));
    Ok(0)
}

fn mode_sense(lu: &LogicalUnit, c: ModeSenseCdb, data_in: &mut DataIn<'_>) -> Outcome {
    let answer = pages::mode_sense(
        lu,
        c.size,
        c.dbd,
        c.llbaa,
        c.page_control,
        c.page_code,
        c.subpage,
    )
    .map_err(|error| match error {
        ModeSenseError::SavedValues => {
            Failure::illegal(AdditionalSense::SAVING_PARAMETERS_NOT_SUPPORTED)
                .pointing(true, FieldPointer::bit(2, 7))
        }
        ModeSenseError::Page => Failure::invalid_field(FieldPointer::bit(2, 5)),
        ModeSenseError::Subpage => Failure::invalid_field(FieldPointer::byte(3)),
    })?;
    data_in.answer(&answer, u64::from(c.alloc_len));
    Ok(0)
}

/// Where the TRANSFER LENGTH field of a READ/WRITE CDB starts.
const fn length_field(size: CdbSize) -> FieldPointer {
    FieldPointer::byte(match size {
        CdbSize::Six => 4,
        CdbSize::Ten => 7,
        CdbSize::Twelve => 6,
        CdbSize::Sixteen => 10,
    })
}

/// Field, length and range checks of READ/WRITE; returns the byte offset
/// and length on the medium.
fn check_read_write(lu: &LogicalUnit, c: &ReadWriteCdb) -> Result<(u64, u64), Failure> {
    if c.protect != 0 {
        // No protection information: RDPROTECT/WRPROTECT must be zero.
        return Err(Failure::invalid_field(FieldPointer::bit(1, 7)));
    }
    if c.blocks > lu.config().max_transfer_blocks {
        return Err(Failure::invalid_field(length_field(c.size)));
    }
    let offset = lu
        .range(c.lba, u64::from(c.blocks))
        .map_err(|_| Failure::lba_out_of_range())?;
    Ok((offset, u64::from(c.blocks) * u64::from(lu.block_len())))
}

/// The first `need` bytes of the data-out, or the failure for data-out
/// that is too short.
fn data_out<'a>(request: &Request<'a>, need: u64) -> Result<DataOut<'a>, Failure> {
    let data = request.data_out.unwrap_or(DataOut::Bytes(&[]));
    match usize::try_from(need)
        .ok()
        .and_then(|need| data.prefix(need))
    {
        Some(data) => Ok(data),
        None => Err(Failure {
            data_out_residual: Some(residual(data.len() as u64, need)),
            ..Failure::illegal(AdditionalSense::INVALID_FIELD_IN_COMMAND_IU)
        }),
    }
}

/// VERIFY: BYTCHK 00b checks the range only (a RAM disk always reads back),
/// 01b compares the data-out with the blocks, 11b compares one block of
/// data-out with each block. A miscompare reports MISCOMPARE with the byte
/// offset of the first difference, counted from the start of the verified
/// range, in INFORMATION.
fn verify(lu: &LogicalUnit, c: VerifyCdb, request: &Request<'_>) -> Outcome {
    if c.protect != 0 {
        return Err(Failure::invalid_field(FieldPointer::bit(1, 7)));
    }
    if c.bytchk == 2 {
        return Err(Failure::invalid_field(FieldPointer::bit(1, 2)));
    }
    if c.bytchk == 1 && c.blocks > lu.config().max_transfer_blocks {
        return Err(Failure::invalid_field(length_field(c.size)));
    }
    let offset = lu
        .range(c.lba, u64::from(c.blocks))
        .map_err(|_| Failure::lba_out_of_range())?;
    let block_len = u64::from(lu.block_len());
    let miscompare = |at: u64| {
        Failure::check(
            SenseKey::Miscompare,
            AdditionalSense::MISCOMPARE_DURING_VERIFY,
        )
        .with_information(at)
    };
    match c.bytchk {
        0 => Ok(0),
        1 => {
            let len = u64::from(c.blocks) * block_len;
            let data = data_out(request, len)?.to_bytes();
            match lu.store().compare(offset, &data) {
                Some(at) => Err(miscompare(at)),
                None => Ok(len),
            }
        }
        _ => {
            let data = data_out(request, block_len)?.to_bytes();
            for block in 0..u64::from(c.blocks) {
                if let Some(at) = lu.store().compare(offset + block * block_len, &data) {
                    return Err(miscompare(block * block_len + at));
                }
            }
            Ok(block_len)
        }
    }
}

impl Failure {
    fn with_information(mut self, information: u64) -> Self {
        self.sense = self.sense.map(|s| s.with_information(information));
        self
    }
}

fn synchronize_cache(lu: &LogicalUnit, c: SynchronizeCacheCdb) -> Outcome {
    // NUMBER OF LOGICAL BLOCKS 0: from the LBA to the end, which must then
    // be on the medium itself.
    let in_range = if c.blocks == 0 {
        c.lba < lu.blocks()
    } else {
        lu.range(c.lba, u64::from(c.blocks)).is_ok()
    };
    if !in_range {
        return Err(Failure::lba_out_of_range());
    }
    // The store is RAM: there is nothing to flush, only to count.
    lu.count_sync();
    Ok(0)
}

fn report_luns(target: &ScsiTarget, c: ReportLunsCdb, data_in: &mut DataIn<'_>) -> Outcome {
    let luns: Vec<_> = match c.select_report {
        // All logical units (0x00), or those plus the well-known ones
        // (0x02, of which there are none).
        0x00 | 0x02 => target
            .lun_indices()
            .filter_map(storport_srp::scsi::Lun::from_index)
            .collect(),
        // Well-known logical units only: none.
        0x01 => Vec::new(),
        _ => return Err(Failure::invalid_field(FieldPointer::byte(2))),
    };
    let mut answer = vec![0u8; report_luns_len(luns.len())];
    emit_report_luns(&luns, &mut answer).expect("at most 16384 LUNs");
    data_in.answer(&answer, u64::from(c.alloc_len));
    Ok(0)
}

/// UNMAP (SBC-3 5.28): the parameter list is an 8-byte header and 16-byte
/// block descriptors. Every descriptor is checked before any is applied,
/// so a bad list changes nothing.
fn unmap(lu: &LogicalUnit, c: UnmapCdb, request: &Request<'_>) -> Outcome {
    if !lu.config().thin_provisioning {
        return Err(
            Failure::illegal(AdditionalSense::INVALID_COMMAND_OPERATION_CODE)
                .pointing(true, FieldPointer::byte(0)),
        );
    }
    if c.anchor {
        return Err(Failure::invalid_field(FieldPointer::bit(1, 0)));
    }
    if lu.config().read_only {
        return Err(Failure::write_protected());
    }
    let len = u64::from(c.param_list_len);
    if len == 0 {
        return Ok(0); // Not an error: nothing to unmap.
    }
    let list = data_out(request, len)?.to_bytes();
    if list.len() < 8 {
        return Err(Failure::illegal(
            AdditionalSense::PARAMETER_LIST_LENGTH_ERROR,
        ));
    }
    let field = |at: usize| u16::from_be_bytes([list[at], list[at + 1]]) as usize;
    // UNMAP BLOCK DESCRIPTOR DATA LENGTH, bounded by what was sent; an
    // incomplete last descriptor is ignored.
    let descriptors_len = field(2).min(list.len() - 8) / 16 * 16;
    let descriptors = &list[8..8 + descriptors_len];
    if descriptors.len() / 16 > MAX_UNMAP_DESCRIPTORS as usize {
        return Err(
            Failure::illegal(AdditionalSense::INVALID_FIELD_IN_PARAMETER_LIST)
                .pointing(false, FieldPointer::byte(2)),
        );
    }
    let mut ranges = Vec::with_capacity(descriptors.len() / 16);
    for descriptor in descriptors.chunks_exact(16) {
        let lba = u64::from_be_bytes(descriptor[..8].try_into().expect("8 bytes"));
        let blocks = u64::from(u32::from_be_bytes(
            descriptor[8..12].try_into().expect("4 bytes"),
        ));
        let offset = lu
            .range(lba, blocks)
            .map_err(|_| Failure::lba_out_of_range())?;
        ranges.push((offset, blocks));
    }
    let block_len = u64::from(lu.block_len());
    for (offset, blocks) in ranges {
        lu.store().discard(offset, blocks * block_len);
        lu.count_unmap(blocks);
    }
    Ok(len)
}
