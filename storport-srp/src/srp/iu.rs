//! Building the `SRP_CMD` of a command: its data buffer descriptors and
//! the IU bytes.
//!
//! * No data: no descriptor.
//! * One registered run, and the target takes direct descriptors: one
//!   direct descriptor (`va`, `rkey`, `len`).
//! * Several runs (or a target that takes indirect descriptors only): an
//!   indirect descriptor whose list is carried *whole* inline, so no
//!   target has to fetch it (Linux `ib_srpt` never does). Its table
//!   descriptor names where the list sits in the IU, with key 0: there is
//!   nothing to fetch, and nothing a target could fetch with it.
//! * Immediate data (a small write, granted at login): the 4-byte
//!   immediate descriptor, the data at the negotiated offset.
//!
//! # IRQL
//! Pure computation into the caller's buffer: any IRQL.

#![forbid(unsafe_code)]

use crate::storport::DataDirection;
use crate::wire::Lun;
use crate::wire::srp::{
    self, BufFormats, Cmd, CmdRepr, DataIn, DataOut, DirectDesc, IndirectDesc, SolNot, TaskAttr,
    cmd, desc,
};

/// A command's fixed parts.
#[derive(Debug, Clone, Copy)]
pub struct CommandHeader<'a> {
    /// The wire tag.
    pub tag: u64,
    /// The LUN.
    pub lun: Lun,
    /// The task attribute.
    pub task_attr: TaskAttr,
    /// The CDB (1 to 32 bytes).
    pub cdb: &'a [u8],
    /// Which way the data moves.
    pub direction: DataDirection,
}

/// Where the descriptor list of an indirect descriptor starts in the IU.
#[must_use]
pub const fn desc_list_offset(cdb_len: usize) -> usize {
    cmd::LEN + additional_cdb_len(cdb_len) + desc::INDIRECT_LEN
}

/// The additional CDB bytes a CDB of `cdb_len` takes (padded to 4).
#[must_use]
pub const fn additional_cdb_len(cdb_len: usize) -> usize {
    cdb_len.saturating_sub(cmd::CDB_LEN).next_multiple_of(4)
}

/// The IU length of a command with `runs` data buffer descriptors.
#[must_use]
pub const fn command_len(cdb_len: usize, runs: usize, formats: BufFormats) -> usize {
    let fixed = cmd::LEN + additional_cdb_len(cdb_len);
    if runs == 0 {
        fixed
    } else if runs == 1 && formats.contains(BufFormats::DIRECT) {
        fixed + desc::DIRECT_LEN
    } else {
        fixed + desc::INDIRECT_LEN + runs * desc::DIRECT_LEN
    }
}

/// Writes the `SRP_CMD` of `header` with the descriptors `descs` into
/// `out`; `iu_va` is the I/O virtual address the IU is sent from (for the
/// table descriptor). Returns the IU length.
///
/// # Errors
/// [`srp::Error`]: the CDB too long, more than 255 descriptors, `out` too
/// small, several descriptors for a target without indirect ones.
pub fn emit_command(
    header: &CommandHeader<'_>,
    descs: &[DirectDesc],
    formats: BufFormats,
    iu_va: u64,
    out: &mut [u8],
) -> Result<usize, srp::Error> {
    let n = descs.len();
    let direct = n == 1 && formats.contains(BufFormats::DIRECT);
    if n > 0 && !direct && !formats.contains(BufFormats::INDIRECT) {
        return Err(srp::Error::TooManyDescriptors);
    }
    let table_va = iu_va.wrapping_add(desc_list_offset(header.cdb.len()) as u64);
    let indirect = if n > 0 && !direct {
        Some(IndirectDesc::inline(table_va, 0, descs)?)
    } else {
        None
    };
    let (data_out, data_in) = match (header.direction, descs.first(), indirect) {
        (DataDirection::In, Some(d), None) => (DataOut::None, DataIn::Direct(*d)),
        (DataDirection::In, _, Some(ind)) => (DataOut::None, DataIn::Indirect(ind)),
        (DataDirection::Out, Some(d), None) => (DataOut::Direct(*d), DataIn::None),
        (DataDirection::Out, _, Some(ind)) => (DataOut::Indirect(ind), DataIn::None),
        _ => (DataOut::None, DataIn::None),
    };
    let repr = CmdRepr {
        sol_not: SolNot::empty(),
        tag: header.tag,
        lun: header.lun,
        task_attr: header.task_attr,
        cdb: header.cdb,
        data_out,
        data_in,
    };
    let len = repr.buffer_len()?;
    repr.emit(&mut Cmd::new_unchecked(&mut *out))?;
    Ok(len)
}

/// Writes the header of an `SRP_CMD` carrying `len` bytes of immediate
/// data at `offset` (the bytes up to `offset`; the data follows). Returns
/// `offset`.
///
/// # Errors
/// As [`emit_command`]; [`srp::Error::ImmediateOffsetOverlap`] if the
/// CDB does not leave room before `offset`.
pub fn emit_immediate_header(
    header: &CommandHeader<'_>,
    offset: u16,
    len: u32,
    out: &mut [u8],
) -> Result<usize, srp::Error> {
    let repr = CmdRepr {
        sol_not: SolNot::empty(),
        tag: header.tag,
        lun: header.lun,
        task_attr: header.task_attr,
        cdb: header.cdb,
        data_out: DataOut::ImmediateExternal { offset, len },
        data_in: DataIn::None,
    };
    repr.emit(&mut Cmd::new_unchecked(&mut *out))?;
    Ok(usize::from(offset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::srp::{SrpIu, TaskAttr};

    const READ10: [u8; 10] = [0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0];

    fn header(direction: DataDirection, cdb: &[u8]) -> CommandHeader<'_> {
        CommandHeader {
            tag: 0x0001_0002_dead_beef,
            lun: Lun([0, 3, 0, 0, 0, 0, 0, 0]),
            task_attr: TaskAttr::Ordered,
            cdb,
            direction,
        }
    }

    fn d(i: u64, len: u32) -> DirectDesc {
        DirectDesc {
            va: 0x1000 * i + 7,
            rkey: 0x100 + i as u32,
            len,
        }
    }

    fn parse(buf: &[u8]) -> srp::CmdRepr<'_> {
        match SrpIu::parse(buf, Some(68)).unwrap() {
            SrpIu::Cmd(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_data() {
        let mut buf = [0u8; 512];
        let both = BufFormats::DIRECT | BufFormats::INDIRECT;
        let n = emit_command(
            &header(DataDirection::None, &[0, 0, 0, 0, 0, 0]),
            &[],
            both,
            0,
            &mut buf,
        )
        .unwrap();
        assert_eq!(n, 48);
        assert_eq!(n, command_len(6, 0, both));
        let c = parse(&buf[..n]);
        assert_eq!(c.data_in, DataIn::None);
        assert_eq!(c.data_out, DataOut::None);
        assert_eq!(c.tag, 0x0001_0002_dead_beef);
        assert_eq!(c.task_attr, TaskAttr::Ordered);
        assert_eq!(c.lun, Lun([0, 3, 0, 0, 0, 0, 0, 0]));
    }

    #[test]
    fn one_run_is_direct() {
        let mut buf = [0u8; 512];
        let both = BufFormats::DIRECT | BufFormats::INDIRECT;
        let n = emit_command(
            &header(DataDirection::In, &READ10),
            &[d(1, 4096)],
            both,
            0,
            &mut buf,
        )
        .unwrap();
        assert_eq!(n, 64);
        assert_eq!(n, command_len(10, 1, both));
        assert_eq!(buf[5], 0x01, "DATA-IN direct, DATA-OUT none");
        assert_eq!(parse(&buf[..n]).data_in, DataIn::Direct(d(1, 4096)));
        let n = emit_command(
            &header(DataDirection::Out, &READ10),
            &[d(2, 512)],
            both,
            0,
            &mut buf,
        )
        .unwrap();
        assert_eq!(buf[5], 0x10);
        assert_eq!(parse(&buf[..n]).data_out, DataOut::Direct(d(2, 512)));
    }

    #[test]
    fn several_runs_are_indirect_with_the_whole_list_inline() {
        let mut buf = [0u8; 1024];
        let both = BufFormats::DIRECT | BufFormats::INDIRECT;
        let descs = [d(1, 100), d(2, 4096), d(3, 7)];
        let iu_va = 0x0100_0000_0000_4000;
        let n = emit_command(
            &header(DataDirection::Out, &READ10),
            &descs,
            both,
            iu_va,
            &mut buf,
        )
        .unwrap();
        assert_eq!(n, 48 + 20 + 3 * 16);
        assert_eq!(n, command_len(10, 3, both));
        assert_eq!(buf[5], 0x20, "DATA-OUT indirect");
        assert_eq!(buf[6], 3, "data_out_desc_cnt");
        assert_eq!(buf[7], 0);
        let c = parse(&buf[..n]);
        let DataOut::Indirect(ind) = c.data_out else {
            panic!("{:?}", c.data_out)
        };
        assert_eq!(ind.total_len, 4203);
        assert_eq!(ind.table.len, 48, "table = the inline list");
        assert_eq!(ind.table.rkey, 0, "no key to fetch it with");
        assert_eq!(ind.table.va, iu_va + desc_list_offset(10) as u64);
        assert_eq!(ind.descs.iter().collect::<Vec<_>>(), descs);
        // A target without direct descriptors gets one run indirect too.
        let n = emit_command(
            &header(DataDirection::In, &READ10),
            &descs[..1],
            BufFormats::INDIRECT,
            0,
            &mut buf,
        )
        .unwrap();
        assert_eq!(n, command_len(10, 1, BufFormats::INDIRECT));
        assert!(matches!(parse(&buf[..n]).data_in, DataIn::Indirect(_)));
        // Several runs and no indirect format: refused.
        assert_eq!(
            emit_command(
                &header(DataDirection::In, &READ10),
                &descs,
                BufFormats::DIRECT,
                0,
                &mut buf
            ),
            Err(srp::Error::TooManyDescriptors)
        );
    }

    #[test]
    fn long_cdbs_move_the_descriptors() {
        let mut buf = [0u8; 1024];
        let cdb = [0x7fu8; 32];
        let both = BufFormats::DIRECT | BufFormats::INDIRECT;
        let descs = [d(1, 10), d(2, 20)];
        let n = emit_command(&header(DataDirection::In, &cdb), &descs, both, 0, &mut buf).unwrap();
        assert_eq!(n, 48 + 16 + 20 + 32);
        assert_eq!(buf[31], 16, "additional CDB length");
        let c = parse(&buf[..n]);
        assert_eq!(c.cdb, &cdb[..]);
        assert!(matches!(c.data_in, DataIn::Indirect(_)));
        assert_eq!(desc_list_offset(32), 84);
        assert_eq!(additional_cdb_len(17), 4);
        assert_eq!(additional_cdb_len(16), 0);
    }

    #[test]
    fn immediate_header() {
        let mut buf = [0u8; 2048];
        let cdb = [0x2au8, 0, 0, 0, 0, 9, 0, 0, 2, 0];
        let at =
            emit_immediate_header(&header(DataDirection::Out, &cdb), 68, 1024, &mut buf).unwrap();
        assert_eq!(at, 68);
        assert_eq!(buf[5], 0x30, "DATA-OUT immediate");
        buf[68..68 + 1024].fill(0x5a);
        let c = parse(&buf[..68 + 1024]);
        let DataOut::Immediate { offset, data } = c.data_out else {
            panic!("{:?}", c.data_out)
        };
        assert_eq!(offset, 68);
        assert_eq!(data.len(), 1024);
        assert!(data.iter().all(|b| *b == 0x5a));
        // A 32-byte CDB still fits before offset 68; a 33rd byte cannot.
        assert!(
            emit_immediate_header(&header(DataDirection::Out, &[0; 32]), 68, 8, &mut buf).is_ok()
        );
        assert_eq!(
            emit_immediate_header(&header(DataDirection::Out, &[0; 33]), 68, 8, &mut buf),
            Err(srp::Error::ImmediateOffsetOverlap)
        );
    }

    #[test]
    fn short_buffers_are_refused() {
        let mut buf = [0u8; 60];
        assert_eq!(
            emit_command(
                &header(DataDirection::In, &READ10),
                &[d(1, 1)],
                BufFormats::DIRECT,
                0,
                &mut buf
            ),
            Err(srp::Error::BufferTooSmall)
        );
    }
}
