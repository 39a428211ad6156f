//! Checks a kernel image the way a loader and a reviewer would: PE headers,
//! sections, imports against the allowlists, the checksum, and every
//! function's stack frame (from the `.pdata`/`.xdata` unwind data the x64
//! ABI requires for every non-leaf function — the real frames of the final,
//! LTO-optimised image).

use anyhow::{Context, Result, bail};
use object::LittleEndian as LE;
use object::pe;
use object::read::pe::{ImageNtHeaders, ImageOptionalHeader, PeFile64};
use object::{Object, ObjectSection};
use std::collections::BTreeMap;

use super::allowlist::DefFile;

/// Sections a Rust kernel image may have.
pub const ALLOWED_SECTIONS: &[&str] = &[".text", ".rdata", ".data", ".pdata", ".reloc"];

/// Default largest stack frame accepted: x64 kernel stacks are 24 KiB
/// (`KERNEL_STACK_SIZE`) and a miniport runs deep inside StorPort's and the
/// storage stack's frames, so one frame may take at most a twelfth of it.
pub const DEFAULT_MAX_FRAME: u32 = 2048;

/// Offset of `CheckSum` in the optional header (PE32+ and PE32 alike).
const CHECKSUM_IN_OPTIONAL_HEADER: usize = 64;

/// File offset of the PE `CheckSum` field.
fn checksum_offset(data: &[u8]) -> Result<usize> {
    let lfanew = data.get(0x3c..0x40).context("no DOS header")?;
    let lfanew = u32::from_le_bytes(lfanew.try_into()?) as usize;
    // "PE\0\0" + IMAGE_FILE_HEADER (20 bytes) precede the optional header.
    let at = lfanew + 4 + 20 + CHECKSUM_IN_OPTIONAL_HEADER;
    if at + 4 > data.len() {
        bail!("truncated PE header");
    }
    Ok(at)
}

/// The PE image checksum (as `CheckSumMappedFile` computes it): the
/// one's-complement-style 16-bit sum of the file with the checksum field
/// taken as zero, folded, plus the file length.
///
/// # Errors
/// Not a PE file.
pub fn pe_checksum(data: &[u8]) -> Result<u32> {
    let skip = checksum_offset(data)?;
    let mut sum: u64 = 0;
    let mut i = 0;
    while i < data.len() {
        let word = if i == skip || i == skip + 2 {
            0
        } else {
            let lo = u64::from(data[i]);
            let hi = data.get(i + 1).map_or(0, |&b| u64::from(b));
            lo | (hi << 8)
        };
        sum += word;
        sum = (sum & 0xffff) + (sum >> 16);
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    Ok((sum as u32).wrapping_add(data.len() as u32))
}

/// Writes the correct checksum into `data`.
///
/// # Errors
/// Not a PE file.
pub fn fix_checksum(data: &mut [u8]) -> Result<u32> {
    let sum = pe_checksum(data)?;
    let at = checksum_offset(data)?;
    data[at..at + 4].copy_from_slice(&sum.to_le_bytes());
    Ok(sum)
}

/// One function's frame, from its unwind information.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// RVA of the function.
    pub rva: u32,
    /// Bytes of stack it takes, return address included.
    pub bytes: u32,
    /// Its name from the linker map, if known.
    pub name: Option<String>,
}

/// What `check` found.
#[derive(Debug, Clone)]
pub struct Report {
    /// module -> imported names.
    pub imports: BTreeMap<String, Vec<String>>,
    /// Sections present.
    pub sections: Vec<String>,
    /// Every function's frame, biggest first.
    pub frames: Vec<Frame>,
    /// The checksum in the header.
    pub checksum: u32,
    /// Preferred load address.
    pub image_base: u64,
    /// Problems; empty means the image passed.
    pub problems: Vec<String>,
}

/// Stack bytes described by one `UNWIND_INFO`, following chained entries.
fn unwind_frame_bytes(file: &PeFile64<'_>, data: &[u8], info_rva: u32, depth: u32) -> Result<u32> {
    if depth > 8 {
        bail!("unwind chain too long at {info_rva:#x}");
    }
    let sections = file.section_table();
    let info = sections
        .pe_data_at(data, info_rva)
        .context("unwind info outside the image")?;
    let (&head, rest) = info.split_first().context("empty unwind info")?;
    let flags = head >> 3;
    let count = usize::from(*rest.get(1).context("short unwind info")?);
    let codes = info
        .get(4..4 + 2 * count)
        .context("unwind codes past the image")?;
    let slot = |i: usize| -> Result<(u8, u8)> {
        let c = codes
            .get(2 * i..2 * i + 2)
            .context("truncated unwind code")?;
        Ok((c[1] & 0x0f, c[1] >> 4))
    };
    let u16_at = |i: usize| -> Result<u32> {
        let c = codes
            .get(2 * i..2 * i + 2)
            .context("truncated unwind code")?;
        Ok(u32::from(u16::from_le_bytes([c[0], c[1]])))
    };
    let mut bytes: u32 = 0;
    let mut i = 0;
    while i < count {
        let (op, op_info) = slot(i)?;
        i += match op {
            0 => {
                bytes += 8; // UWOP_PUSH_NONVOL
                1
            }
            1 if op_info == 0 => {
                bytes += u16_at(i + 1)? * 8; // UWOP_ALLOC_LARGE, scaled
                2
            }
            1 => {
                bytes += u16_at(i + 1)? | (u16_at(i + 2)? << 16); // unscaled
                3
            }
            2 => {
                bytes += u32::from(op_info) * 8 + 8; // UWOP_ALLOC_SMALL
                1
            }
            3 => 1,     // UWOP_SET_FPREG
            4 | 8 => 2, // UWOP_SAVE_NONVOL, UWOP_SAVE_XMM128 (inside the allocation)
            5 | 9 => 3, // the _FAR forms
            6 => 2,     // UWOP_EPILOG (version 2)
            10 => {
                bytes += if op_info == 0 { 40 } else { 48 }; // UWOP_PUSH_MACHFRAME
                1
            }
            other => bail!("unknown unwind op {other} at {info_rva:#x}"),
        };
    }
    if flags & 0x4 != 0 {
        // UNW_FLAG_CHAININFO: a RUNTIME_FUNCTION follows the (even-padded) codes.
        let at = 4 + 2 * (count + (count & 1));
        let chained = info.get(at + 8..at + 12).context("truncated chain")?;
        let parent = u32::from_le_bytes(chained.try_into()?);
        bytes += unwind_frame_bytes(file, data, parent, depth + 1)?;
    }
    Ok(bytes)
}

/// Every function's frame from `.pdata`.
fn frames(file: &PeFile64<'_>, data: &[u8]) -> Result<Vec<Frame>> {
    let Some(pdata) = file.section_by_name(".pdata") else {
        return Ok(Vec::new());
    };
    let table = pdata.data()?;
    let mut out = Vec::new();
    for entry in table.chunks_exact(12) {
        let rva = u32::from_le_bytes(entry[0..4].try_into()?);
        let info = u32::from_le_bytes(entry[8..12].try_into()?);
        if rva == 0 && info == 0 {
            continue;
        }
        let bytes = unwind_frame_bytes(file, data, info, 0)? + 8; // + return address
        out.push(Frame {
            rva,
            bytes,
            name: None,
        });
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.rva.cmp(&b.rva)));
    Ok(out)
}

/// Names frames from an lld-link `/MAP` file (MSVC layout: rows of
/// `SSSS:OOOOOOOO  Name  Rva+Base  Lib:Object`).
pub fn name_frames(frames: &mut [Frame], map: &str, image_base: u64) {
    let mut symbols = BTreeMap::new();
    for line in map.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if let [addr, name, va, ..] = cols.as_slice() {
            let Ok(va) = u64::from_str_radix(va, 16) else {
                continue;
            };
            if addr.contains(':') && va >= image_base {
                symbols.insert(va - image_base, (*name).to_owned());
            }
        }
    }
    for f in frames {
        f.name = symbols.get(&u64::from(f.rva)).cloned();
    }
}

/// Checks `data` as a StorPort miniport image.
///
/// # Errors
/// The file cannot be parsed as PE32+.
pub fn check(data: &[u8], allow: &BTreeMap<String, DefFile>, max_frame: u32) -> Result<Report> {
    let file = PeFile64::parse(data).context("not a PE32+ image")?;
    let nt = file.nt_headers();
    let fh = nt.file_header();
    let oh = nt.optional_header();
    let mut problems = Vec::new();
    let mut need = |ok: bool, what: &str| {
        if !ok {
            problems.push(what.to_owned());
        }
    };
    need(
        fh.machine.get(LE) == pe::IMAGE_FILE_MACHINE_AMD64,
        "machine is not AMD64",
    );
    need(
        fh.characteristics.get(LE) & pe::IMAGE_FILE_EXECUTABLE_IMAGE != 0,
        "not an executable image",
    );
    need(
        oh.subsystem() == pe::IMAGE_SUBSYSTEM_NATIVE,
        "subsystem is not NATIVE",
    );
    let dll = oh.dll_characteristics();
    need(
        dll & pe::IMAGE_DLLCHARACTERISTICS_NX_COMPAT != 0,
        "not NX_COMPAT",
    );
    need(
        dll & pe::IMAGE_DLLCHARACTERISTICS_DYNAMIC_BASE != 0,
        "not DYNAMIC_BASE",
    );
    let checksum = oh.check_sum();
    need(checksum == pe_checksum(data)?, "PE checksum is wrong");
    let entry = oh.address_of_entry_point();
    let base = oh.image_base();
    let driver_entry = file
        .exports()?
        .into_iter()
        .find(|e| e.name() == b"DriverEntry")
        .map(|e| e.address() - base);
    need(
        driver_entry == Some(u64::from(entry)),
        "entry point is not the DriverEntry export",
    );
    let dirs = file.data_directories();
    for (index, what) in [
        (
            pe::IMAGE_DIRECTORY_ENTRY_TLS,
            "TLS directory (drivers cannot have TLS)",
        ),
        (pe::IMAGE_DIRECTORY_ENTRY_DELAY_IMPORT, "delay-load imports"),
    ] {
        let present = dirs
            .get(index)
            .is_some_and(|d| d.virtual_address.get(LE) != 0);
        need(!present, what);
    }

    let mut sections = Vec::new();
    for s in file.sections() {
        let name = s.name()?.to_owned();
        if !ALLOWED_SECTIONS.contains(&name.as_str()) {
            problems.push(format!("unexpected section {name}"));
        }
        if let object::SectionFlags::Coff { characteristics } = s.flags() {
            if characteristics & pe::IMAGE_SCN_MEM_WRITE != 0
                && characteristics & pe::IMAGE_SCN_MEM_EXECUTE != 0
            {
                problems.push(format!("section {name} is writable and executable"));
            }
        }
        sections.push(name);
    }

    let mut imports: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for import in file.imports()? {
        let module = String::from_utf8_lossy(import.library()).to_ascii_lowercase();
        let name = String::from_utf8_lossy(import.name()).into_owned();
        match allow.get(&module) {
            None => problems.push(format!("imports from {module}, which is not allowed")),
            Some(def) if !def.exports.contains_key(&name) => {
                problems.push(format!("{module}!{name} is not in the export allowlist"));
            }
            Some(_) => {}
        }
        imports.entry(module).or_default().push(name);
    }

    let frames = frames(&file, data)?;
    if let Some(big) = frames.first() {
        if big.bytes > max_frame {
            problems.push(format!(
                "function at RVA {:#x} takes {} bytes of stack (limit {max_frame})",
                big.rva, big.bytes
            ));
        }
    }
    Ok(Report {
        imports,
        sections,
        frames,
        checksum,
        image_base: base,
        problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal PE-shaped buffer: `e_lfanew` = 0x40, nothing else.
    fn pe_like(len: usize) -> Vec<u8> {
        let mut d = vec![0u8; len];
        d[0x3c] = 0x40;
        d
    }

    #[test]
    fn checksum_ignores_its_own_field_and_adds_the_length() {
        let mut d = pe_like(0x200);
        let at = checksum_offset(&d).unwrap();
        assert_eq!(at, 0x40 + 24 + 64);
        let empty = pe_checksum(&d).unwrap();
        // 0x3c holds 0x40: one word of 0x0040, plus the length.
        assert_eq!(empty, 0x40 + 0x200);
        d[at..at + 4].copy_from_slice(&[0xff; 4]);
        assert_eq!(
            pe_checksum(&d).unwrap(),
            empty,
            "the field itself is skipped"
        );
        d[0x100] = 0x01;
        assert_eq!(pe_checksum(&d).unwrap(), empty + 1);
    }

    #[test]
    fn checksum_folds_carries() {
        let mut d = pe_like(0x100);
        for b in &mut d[0x100 - 0x20..] {
            *b = 0xff;
        }
        // 16 words of 0xffff fold to 0xffff (end-around carry), plus 0x40.
        let sum = pe_checksum(&d).unwrap();
        assert_eq!(
            sum,
            ((0xffff_u32 + 0x40) & 0xffff) + ((0xffff + 0x40) >> 16) + 0x100
        );
        let written = fix_checksum(&mut d).unwrap();
        assert_eq!(pe_checksum(&d).unwrap(), written);
    }

    #[test]
    fn truncated_headers_are_refused() {
        assert!(pe_checksum(&[0u8; 16]).is_err());
        let mut d = pe_like(0x80);
        d[0x3c] = 0x7f;
        assert!(pe_checksum(&d).is_err());
    }
}
