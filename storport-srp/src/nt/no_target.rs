//! The adapter until the miniport core lands: it initialises, reports one
//! bus, and completes every request truthfully for a fabric on which no
//! target is reachable.
//!
//! # Which status, and why
//! A SCSI command to a target ID within the reported range completes with
//! `SRB_STATUS_SELECTION_TIMEOUT`, zero bytes transferred and no SCSI
//! status: the initiator tried to reach the target and nothing answered,
//! which is what selection timeout means on a SCSI bus ("the SCSI device
//! selection timed out", ns-storport-_storage_request_block) and what
//! StorPort's bus scan expects from an empty target ID. `SRB_STATUS_NO_DEVICE`
//! ("the device did not respond") would claim a device exists; the
//! `INVALID_*` statuses are kept for addresses outside what the adapter
//! reported, where they are the literal truth. Resets succeed (there is
//! nothing outstanding to reset), an abort fails as the page prescribes
//! when "the specified request cannot be located", and flush, shutdown,
//! power and PnP requests succeed because there is no state to act on.

use super::ffi::{
    SRB_FUNCTION_ABORT_COMMAND, SRB_FUNCTION_EXECUTE_SCSI, SRB_FUNCTION_FLUSH, SRB_FUNCTION_PNP,
    SRB_FUNCTION_POWER, SRB_FUNCTION_RESET_BUS, SRB_FUNCTION_RESET_DEVICE,
    SRB_FUNCTION_RESET_LOGICAL_UNIT, SRB_FUNCTION_SHUTDOWN, SRB_STATUS_ABORT_FAILED,
    SRB_STATUS_INVALID_LUN, SRB_STATUS_INVALID_PATH_ID, SRB_STATUS_INVALID_REQUEST,
    SRB_STATUS_INVALID_TARGET_ID, SRB_STATUS_SELECTION_TIMEOUT, SRB_STATUS_SUCCESS,
};
use super::miniport::{AdapterLimits, FindAdapterArgs, FindAdapterError, Miniport, StartIo};
use super::srb::{Address, Srb};

/// Target IDs the adapter reports on its one bus.
pub const TARGETS: u8 = 8;
/// LUNs per target it reports.
pub const LUNS: u8 = 8;

/// An initiator adapter with no reachable target.
#[derive(Debug, Default)]
pub struct NoTargetAdapter;

/// The truthful `SRB_STATUS_*` for `function` addressed to `address`, on an
/// adapter reporting one bus of [`TARGETS`] x [`LUNS`] with nothing reachable.
#[must_use]
pub fn status_for(function: u32, address: Address) -> u8 {
    let in_range = || -> Result<(), u32> {
        if address.path != 0 {
            Err(SRB_STATUS_INVALID_PATH_ID)
        } else if address.target >= TARGETS {
            Err(SRB_STATUS_INVALID_TARGET_ID)
        } else if address.lun >= LUNS {
            Err(SRB_STATUS_INVALID_LUN)
        } else {
            Ok(())
        }
    };
    let status = match function {
        SRB_FUNCTION_EXECUTE_SCSI => {
            in_range().map_or_else(|e| e, |()| SRB_STATUS_SELECTION_TIMEOUT)
        }
        SRB_FUNCTION_RESET_DEVICE | SRB_FUNCTION_RESET_LOGICAL_UNIT => {
            in_range().map_or_else(|e| e, |()| SRB_STATUS_SUCCESS)
        }
        SRB_FUNCTION_ABORT_COMMAND => SRB_STATUS_ABORT_FAILED,
        SRB_FUNCTION_RESET_BUS
        | SRB_FUNCTION_FLUSH
        | SRB_FUNCTION_SHUTDOWN
        | SRB_FUNCTION_POWER
        | SRB_FUNCTION_PNP => SRB_STATUS_SUCCESS,
        // IO_CONTROL and WMI included: the adapter has no such interface.
        _ => SRB_STATUS_INVALID_REQUEST,
    };
    // Every SRB_STATUS_* value is below 0x40.
    u8::try_from(status).unwrap_or(SRB_STATUS_INVALID_REQUEST as u8)
}

impl Miniport for NoTargetAdapter {
    fn find_adapter(
        _args: &FindAdapterArgs<'_>,
    ) -> Result<(Self, AdapterLimits), FindAdapterError> {
        Ok((
            Self,
            AdapterLimits {
                buses: 1,
                targets_per_bus: TARGETS,
                luns_per_target: LUNS,
                max_transfer_bytes: 1 << 20,
                physical_breaks: 255,
                max_io: 1024,
                max_io_per_lun: 64,
            },
        ))
    }

    fn start_io(&self, srb: &mut Srb<'_>) -> StartIo {
        let status = status_for(srb.function(), srb.address());
        if srb.function() == SRB_FUNCTION_EXECUTE_SCSI {
            // No data moved and no target status to report.
            srb.set_data_transfer_length(0);
            srb.set_scsi_status(0);
        }
        srb.set_srb_status(status);
        StartIo::Complete
    }

    fn reset_bus(&self, _path: u32) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nt::ffi::{SCSI_REQUEST_BLOCK, SRB_FUNCTION_IO_CONTROL};

    const HERE: Address = Address {
        path: 0,
        target: 0,
        lun: 0,
    };

    #[test]
    fn scsi_commands_to_reported_targets_time_out_in_selection() {
        for target in 0..TARGETS {
            for lun in 0..LUNS {
                let a = Address {
                    path: 0,
                    target,
                    lun,
                };
                assert_eq!(
                    u32::from(status_for(SRB_FUNCTION_EXECUTE_SCSI, a)),
                    SRB_STATUS_SELECTION_TIMEOUT
                );
            }
        }
    }

    #[test]
    fn addresses_outside_the_reported_bus_are_invalid() {
        let f = SRB_FUNCTION_EXECUTE_SCSI;
        assert_eq!(
            u32::from(status_for(f, Address { path: 1, ..HERE })),
            SRB_STATUS_INVALID_PATH_ID
        );
        assert_eq!(
            u32::from(status_for(
                f,
                Address {
                    target: TARGETS,
                    ..HERE
                }
            )),
            SRB_STATUS_INVALID_TARGET_ID
        );
        assert_eq!(
            u32::from(status_for(f, Address { lun: LUNS, ..HERE })),
            SRB_STATUS_INVALID_LUN
        );
    }

    #[test]
    fn management_functions() {
        let s = |f| u32::from(status_for(f, HERE));
        assert_eq!(s(SRB_FUNCTION_ABORT_COMMAND), SRB_STATUS_ABORT_FAILED);
        assert_eq!(s(SRB_FUNCTION_RESET_BUS), SRB_STATUS_SUCCESS);
        assert_eq!(s(SRB_FUNCTION_RESET_DEVICE), SRB_STATUS_SUCCESS);
        assert_eq!(s(SRB_FUNCTION_FLUSH), SRB_STATUS_SUCCESS);
        assert_eq!(s(SRB_FUNCTION_IO_CONTROL), SRB_STATUS_INVALID_REQUEST);
        assert_eq!(s(0x7f), SRB_STATUS_INVALID_REQUEST);
    }

    #[test]
    fn start_io_completes_an_inquiry_with_nothing_transferred() {
        let mut raw = SCSI_REQUEST_BLOCK::default();
        raw.Function = SRB_FUNCTION_EXECUTE_SCSI as u8;
        raw.CdbLength = 6;
        raw.Cdb[0] = 0x12;
        raw.DataTransferLength = 96;
        raw.ScsiStatus = 0xff;
        // SAFETY: a live local SRB.
        let mut srb = unsafe { Srb::from_raw((&raw mut raw).cast()) }.unwrap();
        assert_eq!(NoTargetAdapter.start_io(&mut srb), StartIo::Complete);
        assert_eq!(u32::from(raw.SrbStatus), SRB_STATUS_SELECTION_TIMEOUT);
        assert_eq!((raw.DataTransferLength, raw.ScsiStatus), (0, 0));
    }
}
