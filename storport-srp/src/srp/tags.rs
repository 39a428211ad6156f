//! Wire tags and the slot free list.
//!
//! Every IU the initiator sends carries a 64-bit tag the target echoes.
//! The engine packs into it everything it needs to find the request in
//! O(1) and to refuse a late or forged answer:
//!
//! ```text
//!  63 62 | 61 .. 48   | 47 .. 32 | 31 .. 0
//!  kind  | generation | slot     | the core's tag
//! ```
//!
//! * `kind`: 0 for a command, 1 for a task management function (Linux
//!   marks those with `SRP_TAG_TSK_MGMT`, bit 31; we use the top bits so
//!   the whole core tag fits).
//! * `slot`: the index in the channel's command or TMF table.
//! * `generation`: bumped every time the slot is freed, so an answer for
//!   an earlier use of the slot does not match.
//!
//! [`FreeSlots`] is the stack of free slot indices; it lives under the
//! channel lock, allocated once at `PASSIVE_LEVEL`.
//!
//! # IRQL
//! Pure computation: any IRQL.

#![forbid(unsafe_code)]

use alloc::boxed::Box;
use alloc::vec::Vec;

/// Bits of the generation.
pub const GENERATION_BITS: u32 = 14;
const GENERATION_MASK: u16 = (1 << GENERATION_BITS) - 1;

/// What an IU's tag names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TagKind {
    /// An `SRP_CMD`.
    Command,
    /// An `SRP_TSK_MGMT`.
    Tmf,
}

/// A decoded wire tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireTag {
    /// Command or TMF.
    pub kind: TagKind,
    /// The slot's generation when the IU was sent (14 bits).
    pub generation: u16,
    /// The slot index.
    pub slot: u16,
    /// The core's tag of the request.
    pub core: u32,
}

impl WireTag {
    /// The 64-bit wire value.
    #[must_use]
    pub const fn encode(self) -> u64 {
        let kind: u64 = match self.kind {
            TagKind::Command => 0,
            TagKind::Tmf => 1,
        };
        (kind << 62)
            | (((self.generation & GENERATION_MASK) as u64) << 48)
            | ((self.slot as u64) << 32)
            | self.core as u64
    }

    /// Decodes a wire value; `None` for a kind the engine never sends
    /// (a forged or corrupted tag).
    #[must_use]
    pub const fn decode(tag: u64) -> Option<Self> {
        let kind = match tag >> 62 {
            0 => TagKind::Command,
            1 => TagKind::Tmf,
            _ => return None,
        };
        Some(WireTag {
            kind,
            generation: ((tag >> 48) as u16) & GENERATION_MASK,
            slot: (tag >> 32) as u16,
            core: tag as u32,
        })
    }
}

/// The next generation of a slot (wraps within its 14 bits).
#[must_use]
pub const fn next_generation(generation: u16) -> u16 {
    generation.wrapping_add(1) & GENERATION_MASK
}

/// A stack of free slot indices.
#[derive(Debug)]
pub struct FreeSlots {
    stack: Box<[u16]>,
    len: usize,
}

impl FreeSlots {
    /// All of `0..count` free (count at most 65536).
    ///
    /// # IRQL
    /// `PASSIVE_LEVEL` (allocates).
    #[must_use]
    pub fn new(count: usize) -> Self {
        let count = count.min(1 << 16);
        let stack: Vec<u16> = (0..count)
            .rev()
            .map(|i| u16::try_from(i).unwrap_or(u16::MAX))
            .collect();
        FreeSlots {
            len: stack.len(),
            stack: stack.into_boxed_slice(),
        }
    }

    /// Takes a free index.
    pub fn pop(&mut self) -> Option<u16> {
        let len = self.len.checked_sub(1)?;
        let index = *self.stack.get(len)?;
        self.len = len;
        Some(index)
    }

    /// Returns an index; `false` (and nothing changes) if the stack is
    /// already full or the index is out of range — a double free, which
    /// the caller's slot state rules out.
    pub fn push(&mut self, index: u16) -> bool {
        if usize::from(index) >= self.stack.len() {
            return false;
        }
        match self.stack.get_mut(self.len) {
            Some(entry) => {
                *entry = index;
                self.len += 1;
                true
            }
            None => false,
        }
    }

    /// Free indices.
    #[must_use]
    pub const fn available(&self) -> usize {
        self.len
    }

    /// Total indices.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.stack.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout() {
        let t = WireTag {
            kind: TagKind::Tmf,
            generation: 0x3fff,
            slot: 0xabcd,
            core: 0x1234_5678,
        };
        assert_eq!(t.encode(), 0x7fff_abcd_1234_5678);
        assert_eq!(WireTag::decode(t.encode()), Some(t));
        assert_eq!(
            WireTag {
                kind: TagKind::Command,
                generation: 1,
                slot: 2,
                core: 3
            }
            .encode(),
            0x0001_0002_0000_0003
        );
        assert_eq!(WireTag::decode(0x8000_0000_0000_0000), None);
        assert_eq!(WireTag::decode(u64::MAX), None);
        assert_eq!(next_generation(0x3fff), 0);
        assert_eq!(next_generation(5), 6);
    }

    #[test]
    fn free_list() {
        let mut f = FreeSlots::new(3);
        assert_eq!(f.capacity(), 3);
        assert_eq!(f.pop(), Some(0));
        assert_eq!(f.pop(), Some(1));
        assert_eq!(f.pop(), Some(2));
        assert_eq!(f.pop(), None);
        assert!(f.push(1));
        assert!(!f.push(7), "out of range");
        assert!(f.push(0));
        assert!(f.push(2));
        assert!(!f.push(2), "full: a double free is refused");
        assert_eq!(f.available(), 3);
        let mut empty = FreeSlots::new(0);
        assert_eq!(empty.pop(), None);
        assert!(!empty.push(0));
    }

    proptest! {
        #[test]
        fn round_trip(kind in any::<bool>(), generation in 0u16..(1 << 14), slot in any::<u16>(), core in any::<u32>()) {
            let t = WireTag {
                kind: if kind { TagKind::Tmf } else { TagKind::Command },
                generation,
                slot,
                core,
            };
            prop_assert_eq!(WireTag::decode(t.encode()), Some(t));
        }

        #[test]
        fn decode_is_total(tag in any::<u64>()) {
            if let Some(t) = WireTag::decode(tag) {
                prop_assert_eq!(t.encode(), tag);
            } else {
                prop_assert!(tag >> 62 >= 2);
            }
        }
    }
}
