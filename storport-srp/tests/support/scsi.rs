//! The little SCSI the tests need: CDB builders and a RAM disk that
//! executes a handful of commands, moving data through caller-supplied
//! functions (so the fake transport can move it by physical address, as an
//! RDMA target would).

use std::sync::Mutex;

/// Block size of the RAM disk.
pub const BLOCK: usize = 512;

pub fn test_unit_ready() -> [u8; 6] {
    [0; 6]
}

pub fn inquiry(allocation: u16) -> [u8; 6] {
    let a = allocation.to_be_bytes();
    [0x12, 0, 0, a[0], a[1], 0]
}

pub fn read_capacity10() -> [u8; 10] {
    [0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0]
}

pub fn report_luns(allocation: u32) -> [u8; 12] {
    let a = allocation.to_be_bytes();
    [0xA0, 0, 0, 0, 0, 0, a[0], a[1], a[2], a[3], 0, 0]
}

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let l = lba.to_be_bytes();
    let b = blocks.to_be_bytes();
    [op, 0, l[0], l[1], l[2], l[3], 0, b[0], b[1], 0]
}

pub fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    rw10(0x28, lba, blocks)
}

pub fn write10(lba: u32, blocks: u16) -> [u8; 10] {
    rw10(0x2A, lba, blocks)
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(0x88, lba, blocks)
}

pub fn write16(lba: u64, blocks: u32) -> [u8; 16] {
    rw16(0x8A, lba, blocks)
}

/// Fixed-format sense data.
pub fn sense(key: u8, asc: u8, ascq: u8) -> [u8; 18] {
    let mut s = [0u8; 18];
    s[0] = 0x70;
    s[2] = key & 0x0F;
    s[7] = 10;
    s[12] = asc;
    s[13] = ascq;
    s
}

/// ILLEGAL REQUEST.
pub const ILLEGAL_REQUEST: u8 = 0x05;

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

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
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
            return Executed::Check(sense(ILLEGAL_REQUEST, 0x25, 0));
        };
        let Some(&op) = cdb.first() else {
            return Executed::Check(sense(ILLEGAL_REQUEST, 0x20, 0));
        };
        let mut rw = |lba: u64, blocks: u64, write: bool| -> Executed {
            if lba.checked_add(blocks).is_none_or(|end| end > self.blocks) {
                return Executed::Check(sense(ILLEGAL_REQUEST, 0x21, 0));
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
            Executed::Good {
                wanted: len as u64,
            }
        };
        match (op, cdb.len()) {
            (0x28 | 0x2A, 10..) => {
                return rw(
                    u64::from(be32(&cdb[2..6])),
                    u64::from(u16::from_be_bytes([cdb[7], cdb[8]])),
                    op == 0x2A,
                );
            }
            (0x88 | 0x8A, 16..) => {
                return rw(
                    u64::from_be_bytes(cdb[2..10].try_into().unwrap()),
                    u64::from(be32(&cdb[10..14])),
                    op == 0x8A,
                );
            }
            _ => {}
        }
        match (op, cdb.len()) {
            (0x00, 6..) | (0x35, 10..) => Executed::Good { wanted: 0 },
            (0x12, 6..) => {
                let allocation = u16::from_be_bytes([cdb[3], cdb[4]]) as usize;
                let mut r = [0u8; 36];
                r[2] = 0x05;
                r[3] = 0x02;
                r[4] = 31;
                r[7] = 0x02;
                r[8..16].copy_from_slice(b"KVERBS  ");
                r[16..32].copy_from_slice(b"RAMDISK         ");
                r[32..36].copy_from_slice(b"0001");
                let n = allocation.min(r.len());
                data_in(0, &r[..n]);
                Executed::Good { wanted: n as u64 }
            }
            (0x25, 10..) => {
                let mut r = [0u8; 8];
                r[..4].copy_from_slice(&((self.blocks - 1) as u32).to_be_bytes());
                r[4..].copy_from_slice(&(BLOCK as u32).to_be_bytes());
                data_in(0, &r);
                Executed::Good { wanted: 8 }
            }
            (0xA0, 12..) => {
                let allocation = be32(&cdb[6..10]) as usize;
                let mut r = [0u8; 8 + 8 * 8];
                let n = self.luns.len().min(8);
                r[..4].copy_from_slice(&((n * 8) as u32).to_be_bytes());
                for i in 0..n {
                    r[8 + i * 8 + 1] = i as u8;
                }
                let len = (8 + n * 8).min(allocation);
                data_in(0, &r[..len]);
                Executed::Good {
                    wanted: len as u64,
                }
            }
            _ => Executed::Check(sense(ILLEGAL_REQUEST, 0x20, 0)),
        }
    }
}
