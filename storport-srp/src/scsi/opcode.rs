//! SCSI operation codes (SPC-4 annex D, SBC-3), the CDB length each opcode
//! group implies, and the data direction of the commands a block device
//! uses.

use core::fmt;

use super::DataDirection;

/// A SCSI operation code: the first byte of every CDB.
///
/// A newtype rather than an enum because an initiator passes any opcode
/// through and a target must answer unknown ones; the constants name the
/// ones this crate knows.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

impl Opcode {
    /// TEST UNIT READY.
    pub const TEST_UNIT_READY: Self = Self(0x00);
    /// REQUEST SENSE.
    pub const REQUEST_SENSE: Self = Self(0x03);
    /// FORMAT UNIT.
    pub const FORMAT_UNIT: Self = Self(0x04);
    /// READ(6).
    pub const READ_6: Self = Self(0x08);
    /// WRITE(6).
    pub const WRITE_6: Self = Self(0x0A);
    /// INQUIRY.
    pub const INQUIRY: Self = Self(0x12);
    /// MODE SELECT(6).
    pub const MODE_SELECT_6: Self = Self(0x15);
    /// RESERVE(6) (obsolete).
    pub const RESERVE_6: Self = Self(0x16);
    /// RELEASE(6) (obsolete).
    pub const RELEASE_6: Self = Self(0x17);
    /// MODE SENSE(6).
    pub const MODE_SENSE_6: Self = Self(0x1A);
    /// START STOP UNIT.
    pub const START_STOP_UNIT: Self = Self(0x1B);
    /// SEND DIAGNOSTIC.
    pub const SEND_DIAGNOSTIC: Self = Self(0x1D);
    /// PREVENT ALLOW MEDIUM REMOVAL.
    pub const PREVENT_ALLOW_MEDIUM_REMOVAL: Self = Self(0x1E);
    /// READ CAPACITY(10).
    pub const READ_CAPACITY_10: Self = Self(0x25);
    /// READ(10).
    pub const READ_10: Self = Self(0x28);
    /// WRITE(10).
    pub const WRITE_10: Self = Self(0x2A);
    /// WRITE AND VERIFY(10).
    pub const WRITE_AND_VERIFY_10: Self = Self(0x2E);
    /// VERIFY(10).
    pub const VERIFY_10: Self = Self(0x2F);
    /// SYNCHRONIZE CACHE(10).
    pub const SYNCHRONIZE_CACHE_10: Self = Self(0x35);
    /// WRITE BUFFER.
    pub const WRITE_BUFFER: Self = Self(0x3B);
    /// READ BUFFER.
    pub const READ_BUFFER: Self = Self(0x3C);
    /// WRITE SAME(10).
    pub const WRITE_SAME_10: Self = Self(0x41);
    /// UNMAP.
    pub const UNMAP: Self = Self(0x42);
    /// LOG SELECT.
    pub const LOG_SELECT: Self = Self(0x4C);
    /// LOG SENSE.
    pub const LOG_SENSE: Self = Self(0x4D);
    /// MODE SELECT(10).
    pub const MODE_SELECT_10: Self = Self(0x55);
    /// MODE SENSE(10).
    pub const MODE_SENSE_10: Self = Self(0x5A);
    /// PERSISTENT RESERVE IN.
    pub const PERSISTENT_RESERVE_IN: Self = Self(0x5E);
    /// PERSISTENT RESERVE OUT.
    pub const PERSISTENT_RESERVE_OUT: Self = Self(0x5F);
    /// Variable-length CDB (32-byte READ/WRITE and friends).
    pub const VARIABLE_LENGTH: Self = Self(0x7F);
    /// READ(16).
    pub const READ_16: Self = Self(0x88);
    /// COMPARE AND WRITE.
    pub const COMPARE_AND_WRITE: Self = Self(0x89);
    /// WRITE(16).
    pub const WRITE_16: Self = Self(0x8A);
    /// WRITE AND VERIFY(16).
    pub const WRITE_AND_VERIFY_16: Self = Self(0x8E);
    /// VERIFY(16).
    pub const VERIFY_16: Self = Self(0x8F);
    /// SYNCHRONIZE CACHE(16).
    pub const SYNCHRONIZE_CACHE_16: Self = Self(0x91);
    /// WRITE SAME(16).
    pub const WRITE_SAME_16: Self = Self(0x93);
    /// SERVICE ACTION IN(16): READ CAPACITY(16) is service action 0x10.
    pub const SERVICE_ACTION_IN_16: Self = Self(0x9E);
    /// REPORT LUNS.
    pub const REPORT_LUNS: Self = Self(0xA0);
    /// SECURITY PROTOCOL IN.
    pub const SECURITY_PROTOCOL_IN: Self = Self(0xA2);
    /// MAINTENANCE IN (REPORT TARGET PORT GROUPS, REPORT SUPPORTED
    /// OPERATION CODES...).
    pub const MAINTENANCE_IN: Self = Self(0xA3);
    /// MAINTENANCE OUT.
    pub const MAINTENANCE_OUT: Self = Self(0xA4);
    /// READ(12).
    pub const READ_12: Self = Self(0xA8);
    /// WRITE(12).
    pub const WRITE_12: Self = Self(0xAA);
    /// WRITE AND VERIFY(12).
    pub const WRITE_AND_VERIFY_12: Self = Self(0xAE);
    /// VERIFY(12).
    pub const VERIFY_12: Self = Self(0xAF);
    /// SECURITY PROTOCOL OUT.
    pub const SECURITY_PROTOCOL_OUT: Self = Self(0xB5);

    /// The service action of READ CAPACITY(16) under SERVICE ACTION IN(16).
    pub const SA_READ_CAPACITY_16: u8 = 0x10;

    /// The CDB length the opcode's group implies (SPC-4 4.2.5.1): 6 bytes
    /// for group 0, 10 for groups 1 and 2, 16 for group 4, 12 for group 5.
    /// `None` for group 3 (reserved, and the variable-length 0x7F whose
    /// length is in the CDB) and the vendor-specific groups 6 and 7.
    pub const fn cdb_len(self) -> Option<usize> {
        match self.0 >> 5 {
            0 => Some(6),
            1 | 2 => Some(10),
            4 => Some(16),
            5 => Some(12),
            _ => None,
        }
    }

    /// The data direction of this command when it does not depend on CDB
    /// fields, `None` when it does (VERIFY with BYTCHK, SEND DIAGNOSTIC,
    /// FORMAT UNIT) or the opcode is not one this crate knows. Use
    /// [`super::CdbRepr::data_direction`] for a decoded CDB.
    pub const fn fixed_data_direction(self) -> Option<DataDirection> {
        Some(match self {
            Self::TEST_UNIT_READY
            | Self::START_STOP_UNIT
            | Self::PREVENT_ALLOW_MEDIUM_REMOVAL
            | Self::SYNCHRONIZE_CACHE_10
            | Self::SYNCHRONIZE_CACHE_16
            | Self::RESERVE_6
            | Self::RELEASE_6 => DataDirection::None,
            Self::REQUEST_SENSE
            | Self::READ_6
            | Self::INQUIRY
            | Self::MODE_SENSE_6
            | Self::READ_CAPACITY_10
            | Self::READ_10
            | Self::READ_BUFFER
            | Self::LOG_SENSE
            | Self::MODE_SENSE_10
            | Self::PERSISTENT_RESERVE_IN
            | Self::READ_16
            | Self::SERVICE_ACTION_IN_16
            | Self::REPORT_LUNS
            | Self::SECURITY_PROTOCOL_IN
            | Self::MAINTENANCE_IN
            | Self::READ_12 => DataDirection::In,
            Self::WRITE_6
            | Self::MODE_SELECT_6
            | Self::WRITE_10
            | Self::WRITE_AND_VERIFY_10
            | Self::WRITE_BUFFER
            | Self::WRITE_SAME_10
            | Self::UNMAP
            | Self::LOG_SELECT
            | Self::MODE_SELECT_10
            | Self::PERSISTENT_RESERVE_OUT
            | Self::COMPARE_AND_WRITE
            | Self::WRITE_16
            | Self::WRITE_AND_VERIFY_16
            | Self::WRITE_SAME_16
            | Self::MAINTENANCE_OUT
            | Self::WRITE_12
            | Self::WRITE_AND_VERIFY_12
            | Self::SECURITY_PROTOCOL_OUT => DataDirection::Out,
            _ => return None,
        })
    }

    /// The command's name, `None` for an opcode without a constant here.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::TEST_UNIT_READY => "TEST UNIT READY",
            Self::REQUEST_SENSE => "REQUEST SENSE",
            Self::FORMAT_UNIT => "FORMAT UNIT",
            Self::READ_6 => "READ(6)",
            Self::WRITE_6 => "WRITE(6)",
            Self::INQUIRY => "INQUIRY",
            Self::MODE_SELECT_6 => "MODE SELECT(6)",
            Self::RESERVE_6 => "RESERVE(6)",
            Self::RELEASE_6 => "RELEASE(6)",
            Self::MODE_SENSE_6 => "MODE SENSE(6)",
            Self::START_STOP_UNIT => "START STOP UNIT",
            Self::SEND_DIAGNOSTIC => "SEND DIAGNOSTIC",
            Self::PREVENT_ALLOW_MEDIUM_REMOVAL => "PREVENT ALLOW MEDIUM REMOVAL",
            Self::READ_CAPACITY_10 => "READ CAPACITY(10)",
            Self::READ_10 => "READ(10)",
            Self::WRITE_10 => "WRITE(10)",
            Self::WRITE_AND_VERIFY_10 => "WRITE AND VERIFY(10)",
            Self::VERIFY_10 => "VERIFY(10)",
            Self::SYNCHRONIZE_CACHE_10 => "SYNCHRONIZE CACHE(10)",
            Self::WRITE_BUFFER => "WRITE BUFFER",
            Self::READ_BUFFER => "READ BUFFER",
            Self::WRITE_SAME_10 => "WRITE SAME(10)",
            Self::UNMAP => "UNMAP",
            Self::LOG_SELECT => "LOG SELECT",
            Self::LOG_SENSE => "LOG SENSE",
            Self::MODE_SELECT_10 => "MODE SELECT(10)",
            Self::MODE_SENSE_10 => "MODE SENSE(10)",
            Self::PERSISTENT_RESERVE_IN => "PERSISTENT RESERVE IN",
            Self::PERSISTENT_RESERVE_OUT => "PERSISTENT RESERVE OUT",
            Self::VARIABLE_LENGTH => "VARIABLE LENGTH",
            Self::READ_16 => "READ(16)",
            Self::COMPARE_AND_WRITE => "COMPARE AND WRITE",
            Self::WRITE_16 => "WRITE(16)",
            Self::WRITE_AND_VERIFY_16 => "WRITE AND VERIFY(16)",
            Self::VERIFY_16 => "VERIFY(16)",
            Self::SYNCHRONIZE_CACHE_16 => "SYNCHRONIZE CACHE(16)",
            Self::WRITE_SAME_16 => "WRITE SAME(16)",
            Self::SERVICE_ACTION_IN_16 => "SERVICE ACTION IN(16)",
            Self::REPORT_LUNS => "REPORT LUNS",
            Self::SECURITY_PROTOCOL_IN => "SECURITY PROTOCOL IN",
            Self::MAINTENANCE_IN => "MAINTENANCE IN",
            Self::MAINTENANCE_OUT => "MAINTENANCE OUT",
            Self::READ_12 => "READ(12)",
            Self::WRITE_12 => "WRITE(12)",
            Self::WRITE_AND_VERIFY_12 => "WRITE AND VERIFY(12)",
            Self::VERIFY_12 => "VERIFY(12)",
            Self::SECURITY_PROTOCOL_OUT => "SECURITY PROTOCOL OUT",
            _ => return None,
        })
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "Opcode({:#04x} {name})", self.0),
            None => write!(f, "Opcode({:#04x})", self.0),
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "opcode {:#04x}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_lengths() {
        assert_eq!(Opcode::TEST_UNIT_READY.cdb_len(), Some(6));
        assert_eq!(Opcode::READ_6.cdb_len(), Some(6));
        assert_eq!(Opcode::READ_10.cdb_len(), Some(10));
        assert_eq!(Opcode::MODE_SENSE_10.cdb_len(), Some(10));
        assert_eq!(Opcode::VARIABLE_LENGTH.cdb_len(), None);
        assert_eq!(Opcode(0x60).cdb_len(), None);
        assert_eq!(Opcode::READ_16.cdb_len(), Some(16));
        assert_eq!(Opcode::SERVICE_ACTION_IN_16.cdb_len(), Some(16));
        assert_eq!(Opcode::REPORT_LUNS.cdb_len(), Some(12));
        assert_eq!(Opcode::READ_12.cdb_len(), Some(12));
        assert_eq!(Opcode(0xC0).cdb_len(), None);
        assert_eq!(Opcode(0xFF).cdb_len(), None);
    }

    #[test]
    fn every_named_opcode_has_a_length_except_variable() {
        for byte in 0..=255u8 {
            let op = Opcode(byte);
            if op.name().is_some() && op != Opcode::VARIABLE_LENGTH {
                assert!(op.cdb_len().is_some(), "{op:?}");
            }
            if op.fixed_data_direction().is_some() {
                assert!(op.name().is_some(), "{op:?} has a direction but no name");
            }
        }
    }

    #[test]
    fn directions() {
        assert_eq!(
            Opcode::READ_10.fixed_data_direction(),
            Some(DataDirection::In)
        );
        assert_eq!(
            Opcode::WRITE_16.fixed_data_direction(),
            Some(DataDirection::Out)
        );
        assert_eq!(
            Opcode::TEST_UNIT_READY.fixed_data_direction(),
            Some(DataDirection::None)
        );
        assert_eq!(Opcode::VERIFY_10.fixed_data_direction(), None);
        assert_eq!(Opcode(0xC5).fixed_data_direction(), None);
    }

    #[test]
    fn formatting() {
        assert_eq!(format!("{:?}", Opcode::READ_10), "Opcode(0x28 READ(10))");
        assert_eq!(format!("{}", Opcode(0xC5)), "opcode 0xc5");
        assert_eq!(format!("{}", Opcode::INQUIRY), "INQUIRY");
    }
}
