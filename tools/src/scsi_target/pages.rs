//! The parameter data the device server builds: standard INQUIRY data, the
//! vital product data pages, and the mode pages with their headers and
//! block descriptors. Each builder returns the whole answer; the caller
//! truncates it to the allocation length.

use storport_srp::scsi::data::{StandardInquiry, StandardInquiryRepr, ascii_field};
use storport_srp::scsi::{CdbSize, PageControl};

use super::lu::LogicalUnit;

/// VPD page codes served (SPC-4 7.8, SBC-3 6.5).
pub mod vpd {
    /// Supported VPD pages.
    pub const SUPPORTED_PAGES: u8 = 0x00;
    /// Unit serial number.
    pub const UNIT_SERIAL: u8 = 0x80;
    /// Device identification.
    pub const DEVICE_IDENTIFICATION: u8 = 0x83;
    /// Block limits.
    pub const BLOCK_LIMITS: u8 = 0xB0;
    /// Block device characteristics.
    pub const BLOCK_CHARACTERISTICS: u8 = 0xB1;
    /// Logical block provisioning.
    pub const LOGICAL_BLOCK_PROVISIONING: u8 = 0xB2;
}

/// Mode page codes served.
pub mod mode_page {
    /// Caching mode page.
    pub const CACHING: u8 = 0x08;
    /// Control mode page.
    pub const CONTROL: u8 = 0x0A;
    /// "Return all pages".
    pub const ALL: u8 = 0x3F;
}

/// Most UNMAP block descriptors one command may carry (VPD 0xB0).
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;

/// Peripheral device type: direct access block device.
const DIRECT_ACCESS: u8 = 0x00;

/// The standard INQUIRY answer (36 bytes): SPC-4, HISUP (hierarchical LUN
/// addressing), CMDQUE (Windows needs it for tagged queuing).
pub fn standard_inquiry(vendor: &str, product: &str, revision: &str, present: bool) -> Vec<u8> {
    let repr = StandardInquiryRepr {
        qualifier: if present { 0 } else { 3 },
        device_type: if present { DIRECT_ACCESS } else { 0x1F },
        version: 0x06,
        hisup: true,
        response_format: 2,
        cmdque: true,
        vendor: ascii_field(vendor),
        product: ascii_field(product),
        revision: ascii_field(revision),
        ..Default::default()
    };
    let mut out = vec![0u8; repr.buffer_len()];
    // The buffer is buffer_len() bytes and every field is in range.
    repr.emit(&mut StandardInquiry::new_unchecked(&mut out[..]))
        .expect("standard INQUIRY fits its own length");
    out
}

/// The VPD pages a unit offers, ascending.
pub fn supported_vpd_pages(lu: &LogicalUnit) -> Vec<u8> {
    let mut pages = vec![
        vpd::SUPPORTED_PAGES,
        vpd::UNIT_SERIAL,
        vpd::DEVICE_IDENTIFICATION,
        vpd::BLOCK_LIMITS,
        vpd::BLOCK_CHARACTERISTICS,
    ];
    if lu.config().thin_provisioning {
        pages.push(vpd::LOGICAL_BLOCK_PROVISIONING);
    }
    pages
}

/// A VPD page: the 4-byte header (device type, page code, 16-bit page
/// length) then `body`.
fn vpd_page(page: u8, body: &[u8]) -> Vec<u8> {
    let len = u16::try_from(body.len()).expect("VPD pages here are short");
    let mut out = vec![DIRECT_ACCESS, page];
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// VPD page `page` of `lu`, `None` when it is not offered.
pub fn vpd_page_for(lu: &LogicalUnit, page: u8) -> Option<Vec<u8>> {
    if !supported_vpd_pages(lu).contains(&page) {
        return None;
    }
    Some(match page {
        vpd::SUPPORTED_PAGES => vpd_page(page, &supported_vpd_pages(lu)),
        vpd::UNIT_SERIAL => vpd_page(page, lu.serial().as_bytes()),
        vpd::DEVICE_IDENTIFICATION => vpd_page(page, &device_identification(lu)),
        vpd::BLOCK_LIMITS => vpd_page(page, &block_limits(lu)),
        vpd::BLOCK_CHARACTERISTICS => {
            let mut body = [0u8; 0x3C];
            // MEDIUM ROTATION RATE 0001h: non-rotating (solid state).
            body[..2].copy_from_slice(&1u16.to_be_bytes());
            vpd_page(page, &body)
        }
        vpd::LOGICAL_BLOCK_PROVISIONING => {
            // Byte 5: LBPU (UNMAP supported) and LBPRZ (unmapped blocks
            // read as zeros); byte 6: provisioning type 2 (thin).
            vpd_page(page, &[0x00, 0x84, 0x02, 0x00])
        }
        _ => return None,
    })
}

/// VPD 0x83: an NAA designator and a T10 vendor ID designator, both
/// associated with the logical unit.
fn device_identification(lu: &LogicalUnit) -> Vec<u8> {
    let mut body = Vec::new();
    // NAA: code set 1 (binary), association 0 (LU), type 3 (NAA), 8 bytes.
    body.extend_from_slice(&[0x01, 0x03, 0x00, 0x08]);
    body.extend_from_slice(&lu.naa_id().to_be_bytes());
    // T10 vendor ID: code set 2 (ASCII), association 0, type 1; the
    // 8-byte vendor then a vendor-specific part (the serial number).
    let vendor: [u8; 8] = ascii_field(&lu.config().vendor);
    let id_len = vendor.len() + lu.serial().len();
    let id_len = u8::try_from(id_len).expect("serial length is validated");
    body.extend_from_slice(&[0x02, 0x01, 0x00, id_len]);
    body.extend_from_slice(&vendor);
    body.extend_from_slice(lu.serial().as_bytes());
    body
}

/// VPD 0xB0 body (60 bytes, SBC-3 6.5.3).
fn block_limits(lu: &LogicalUnit) -> [u8; 0x3C] {
    let config = lu.config();
    let mut body = [0u8; 0x3C];
    let mut put = |at: usize, bytes: &[u8]| body[at..at + bytes.len()].copy_from_slice(bytes);
    // Offsets below are page offsets minus the 4-byte header.
    // OPTIMAL TRANSFER LENGTH GRANULARITY: one block.
    put(2, &1u16.to_be_bytes());
    // MAXIMUM TRANSFER LENGTH and OPTIMAL TRANSFER LENGTH.
    put(4, &config.max_transfer_blocks.to_be_bytes());
    put(8, &config.max_transfer_blocks.to_be_bytes());
    if config.thin_provisioning {
        // MAXIMUM UNMAP LBA COUNT, MAXIMUM UNMAP BLOCK DESCRIPTOR COUNT,
        // OPTIMAL UNMAP GRANULARITY (one block).
        put(16, &u32::MAX.to_be_bytes());
        put(20, &MAX_UNMAP_DESCRIPTORS.to_be_bytes());
        put(24, &1u32.to_be_bytes());
    }
    body
}

/// Why MODE SENSE cannot be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeSenseError {
    /// PC = saved values: SAVING PARAMETERS NOT SUPPORTED.
    SavedValues,
    /// An unsupported page code.
    Page,
    /// An unsupported subpage code.
    Subpage,
}

/// The caching mode page (0x08, 20 bytes).
fn caching_page(lu: &LogicalUnit, control: PageControl) -> Vec<u8> {
    let mut page = vec![0u8; 20];
    page[0] = mode_page::CACHING;
    page[1] = 0x12;
    if control != PageControl::Changeable && lu.config().write_cache {
        page[2] = 0x04; // WCE
    }
    page
}

/// The control mode page (0x0A, 12 bytes).
fn control_page(lu: &LogicalUnit, control: PageControl) -> Vec<u8> {
    let mut page = vec![0u8; 12];
    page[0] = mode_page::CONTROL;
    page[1] = 0x0A;
    if control != PageControl::Changeable {
        if lu.config().descriptor_sense {
            page[2] = 0x04; // D_SENSE
        }
        page[3] = 0x10; // QUEUE ALGORITHM MODIFIER 1: unrestricted reordering
    }
    page
}

/// The MODE SENSE(6/10) answer: header, block descriptor (unless DBD), and
/// the requested page(s). Nothing is changeable (there is no MODE SELECT),
/// so the changeable-values mask is all zeros; default values equal the
/// current ones.
pub fn mode_sense(
    lu: &LogicalUnit,
    size: CdbSize,
    dbd: bool,
    llbaa: bool,
    control: PageControl,
    page_code: u8,
    subpage: u8,
) -> Result<Vec<u8>, ModeSenseError> {
    if control == PageControl::Saved {
        return Err(ModeSenseError::SavedValues);
    }
    // Subpage 0 is the page itself, 0xFF "the page and all its subpages"
    // (none here).
    if subpage != 0 && subpage != 0xFF {
        return Err(ModeSenseError::Subpage);
    }
    let mut pages = Vec::new();
    match page_code {
        mode_page::CACHING => pages.extend(caching_page(lu, control)),
        mode_page::CONTROL => pages.extend(control_page(lu, control)),
        mode_page::ALL => {
            pages.extend(caching_page(lu, control));
            pages.extend(control_page(lu, control));
        }
        _ => return Err(ModeSenseError::Page),
    }
    let long = size == CdbSize::Ten && llbaa;
    let block_len = lu.block_len();
    let descriptor = if dbd {
        Vec::new()
    } else if long {
        let mut d = vec![0u8; 16];
        d[..8].copy_from_slice(&lu.blocks().to_be_bytes());
        d[12..].copy_from_slice(&block_len.to_be_bytes());
        d
    } else {
        // Short block descriptor: 0xFFFFFFFF when the count needs more.
        let blocks = u32::try_from(lu.blocks()).unwrap_or(u32::MAX);
        let mut d = vec![0u8; 8];
        d[..4].copy_from_slice(&blocks.to_be_bytes());
        d[5..].copy_from_slice(&block_len.to_be_bytes()[1..]);
        d
    };
    // Device-specific parameter: WP (bit 7), DPOFUA (bit 4).
    let device_specific = if lu.config().read_only { 0x90 } else { 0x10 };
    let mut out = Vec::new();
    match size {
        CdbSize::Six => {
            let total = 4 + descriptor.len() + pages.len();
            out.push(u8::try_from(total - 1).expect("mode data is short"));
            out.push(0); // medium type
            out.push(device_specific);
            out.push(u8::try_from(descriptor.len()).expect("8 or 0"));
        }
        _ => {
            let total = 8 + descriptor.len() + pages.len();
            out.extend_from_slice(&u16::try_from(total - 2).expect("short").to_be_bytes());
            out.push(0);
            out.push(device_specific);
            out.push(u8::from(long)); // LONGLBA
            out.push(0);
            out.extend_from_slice(
                &u16::try_from(descriptor.len())
                    .expect("short")
                    .to_be_bytes(),
            );
        }
    }
    out.extend(descriptor);
    out.extend(pages);
    Ok(out)
}
