//! The little SCSI the tests need: CDB builders and a RAM disk that
//! executes a handful of commands, moving data through caller-supplied
//! functions (so the fake transport can move it by physical address, as an
//! RDMA target would).

use std::sync::Mutex;

/// Block size of the RAM disk.
pub const BLOCK: usize = 512;

use storport_srp::scsi::{
    AdditionalSense, CdbRepr, InquiryCdb, ReadCapacity10Cdb, ReadWriteCdb, ReportLunsCdb, SenseKey,
    SenseRepr,
};

fn bytes(cdb: CdbRepr) -> Vec<u8> {
    let full = cdb.to_cdb16().expect("representable CDB");
    full[..cdb.buffer_len()].to_vec()
}

pub fn test_unit_ready() -> Vec<u8> {
    bytes(CdbRepr::TestUnitReady)
}

pub fn inquiry(allocation: u16) -> Vec<u8> {
    bytes(CdbRepr::Inquiry(InquiryCdb {
        evpd: false,
        cmddt: false,
        page_code: 0,
        alloc_len: allocation,
    }))
}

pub fn read_capacity10() -> Vec<u8> {
    bytes(CdbRepr::ReadCapacity10(ReadCapacity10Cdb::default()))
}

pub fn report_luns(allocation: u32) -> Vec<u8> {
    bytes(CdbRepr::ReportLuns(ReportLunsCdb {
        select_report: 0,
        alloc_len: allocation,
    }))
}

/// READ of `blocks` at `lba` (10-byte CDB).
pub fn read10(lba: u32, blocks: u16) -> Vec<u8> {
    bytes(CdbRepr::Read(ReadWriteCdb::new(
        u64::from(lba),
        u32::from(blocks),
    )))
}

/// WRITE of `blocks` at `lba` (10-byte CDB).
pub fn write10(lba: u32, blocks: u16) -> Vec<u8> {
    bytes(CdbRepr::Write(ReadWriteCdb::new(
        u64::from(lba),
        u32::from(blocks),
    )))
}

fn sixteen(mut rw: ReadWriteCdb) -> ReadWriteCdb {
    rw.size = storport_srp::scsi::CdbSize::Sixteen;
    rw
}

/// READ(16).
pub fn read16(lba: u64, blocks: u32) -> Vec<u8> {
    bytes(CdbRepr::Read(sixteen(ReadWriteCdb::new(lba, blocks))))
}

/// WRITE(16).
pub fn write16(lba: u64, blocks: u32) -> Vec<u8> {
    bytes(CdbRepr::Write(sixteen(ReadWriteCdb::new(lba, blocks))))
}

/// Fixed-format sense data.
pub fn sense(key: SenseKey, code: AdditionalSense) -> [u8; 18] {
    let mut s = [0u8; 18];
    let n = SenseRepr::new(key, code)
        .emit(&mut s)
        .expect("18 bytes hold fixed sense");
    assert_eq!(n, 18);
    s
}

/// What a command did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    /// GOOD; `wanted` bytes of data the command described (moved up to the
    /// buffer's size).
    Good { wanted: u64 },
    /// CHECK CONDITION with this sense.
    Check([u8; 18]),
}

/// A RAM disk with a few LUNs.
pub struct RamDisk {
    luns: Vec<Mutex<Vec<u8>>>,
    blocks: u64,
}

impl RamDisk {
    pub fn new(luns: usize, blocks: u64) -> Self {
        Self {
            luns: (0..luns)
                .map(|_| Mutex::new(vec![0u8; blocks as usize * BLOCK]))
                .collect(),
            blocks,
        }
    }

    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Reads the disk directly (test checks).
    pub fn peek(&self, lun: usize, offset: usize, len: usize) -> Vec<u8> {
        self.luns[lun].lock().unwrap()[offset..offset + len].to_vec()
    }

    /// Executes `cdb` on `lun`. `data_in(offset, bytes)` delivers data to
    /// the initiator; `data_out(offset, buf)` fetches data from it. Neither
    /// allocates; nor does this.
    pub fn execute(
        &self,
        lun: usize,
        cdb: &[u8],
        data_in: &mut dyn FnMut(u64, &[u8]),
        data_out: &mut dyn FnMut(u64, &mut [u8]),
    ) -> Executed {
        let Some(disk) = self.luns.get(lun) else {
            return Executed::Check(sense(
                SenseKey::IllegalRequest,
                AdditionalSense::LOGICAL_UNIT_NOT_SUPPORTED,
            ));
        };
        let Ok(repr) = CdbRepr::parse_bytes(cdb) else {
            return Executed::Check(sense(
                SenseKey::IllegalRequest,
                AdditionalSense::INVALID_COMMAND_OPERATION_CODE,
            ));
        };
        let mut rw = |lba: u64, blocks: u64, write: bool| -> Executed {
            if lba.checked_add(blocks).is_none_or(|end| end > self.blocks) {
                return Executed::Check(sense(
                    SenseKey::IllegalRequest,
                    AdditionalSense::LBA_OUT_OF_RANGE,
                ));
            }
            let start = lba as usize * BLOCK;
            let len = blocks as usize * BLOCK;
            let mut d = disk.lock().unwrap();
            let range = &mut d[start..start + len];
            if write {
                data_out(0, range);
            } else {
                data_in(0, range);
            }
            Executed::Good { wanted: len as u64 }
        };
        match repr {
            CdbRepr::Read(c) => return rw(c.lba, u64::from(c.blocks), false),
            CdbRepr::Write(c) => return rw(c.lba, u64::from(c.blocks), true),
            _ => {}
        }
        match repr {
            CdbRepr::TestUnitReady | CdbRepr::SynchronizeCache(_) => Executed::Good { wanted: 0 },
            CdbRepr::Inquiry(c) if !c.evpd => {
                let mut r = [0u8; 36];
                r[2] = 0x05;
                r[3] = 0x02;
                r[4] = 31;
                r[7] = 0x02;
                r[8..16].copy_from_slice(b"KVERBS  ");
                r[16..32].copy_from_slice(b"RAMDISK         ");
                r[32..36].copy_from_slice(b"0001");
                let n = usize::from(c.alloc_len).min(r.len());
                data_in(0, &r[..n]);
                Executed::Good { wanted: n as u64 }
            }
            CdbRepr::ReadCapacity10(_) => {
                let mut r = [0u8; 8];
                r[..4].copy_from_slice(&((self.blocks - 1) as u32).to_be_bytes());
                r[4..].copy_from_slice(&(BLOCK as u32).to_be_bytes());
                data_in(0, &r);
                Executed::Good { wanted: 8 }
            }
            CdbRepr::ReportLuns(c) => {
                let mut r = [0u8; 8 + 8 * 8];
                let n = self.luns.len().min(8);
                r[..4].copy_from_slice(&((n * 8) as u32).to_be_bytes());
                for i in 0..n {
                    r[8 + i * 8 + 1] = i as u8;
                }
                let len = (8 + n * 8).min(c.alloc_len as usize);
                data_in(0, &r[..len]);
                Executed::Good { wanted: len as u64 }
            }
            _ => Executed::Check(sense(
                SenseKey::IllegalRequest,
                AdditionalSense::INVALID_FIELD_IN_CDB,
            )),
        }
    }
}
