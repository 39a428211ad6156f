//! The miniport core over the fake transport, under the StorPort model:
//! data paths, status mapping end to end, SRB functions.

mod support;

use storport_srp::miniport::transport::Residual;
use storport_srp::scsi::{AdditionalSense, SenseKey};
use storport_srp::storport::host::{
    ModelConfig, RequestSpec, RequestState, SgDelivery, SgShape, StartIoIrql, StartIoLocking,
};
use storport_srp::storport::{Address, DataDirection, PnpAction, SrbFunction, SrbStatus};

use support::fake::{Delivery, FakeConfig, Scripted};
use support::scsi::{self, BLOCK};
use support::{adapter_config, lun, manual, run, start, threaded};

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(u32::from(seed)) as u8
        })
        .collect()
}

/// Writes and reads back through every StartIo locking, scatter/gather
/// delivery and buffer shape: the data the target stored is the data
/// written, the data read is the data stored.
#[test]
fn data_round_trips_through_every_mode_and_shape() {
    let modes = [
        (
            StartIoLocking::Virtual,
            SgDelivery::Inline,
            StartIoIrql::Passive,
        ),
        (
            StartIoLocking::Virtual,
            SgDelivery::Deferred,
            StartIoIrql::Dispatch,
        ),
        (
            StartIoLocking::Virtual,
            SgDelivery::Alternate,
            StartIoIrql::Alternate,
        ),
        (
            StartIoLocking::FullDuplex,
            SgDelivery::Inline,
            StartIoIrql::Dispatch,
        ),
        (
            StartIoLocking::ConcurrentChannels,
            SgDelivery::Deferred,
            StartIoIrql::Dispatch,
        ),
    ];
    let shapes = [
        SgShape::Contiguous,
        SgShape::Pages,
        SgShape::Odd { seed: 11 },
        SgShape::Odd { seed: 12 },
    ];
    for (m, &(locking, sg_delivery, start_io_irql)) in modes.iter().enumerate() {
        for delivery in [Delivery::Synchronous, Delivery::Dpc] {
            let platform = manual();
            platform.run_passive(|p| {
                let config = ModelConfig {
                    locking,
                    sg_delivery,
                    start_io_irql,
                    ..ModelConfig::default()
                };
                let fake = FakeConfig {
                    delivery,
                    ..FakeConfig::default()
                };
                let model = start(&platform, config, adapter_config(), fake, p);
                for (s, &shape) in shapes.iter().enumerate() {
                    let blocks = 3 + 7 * s as u16;
                    let lba = 100 * s as u32 + m as u32;
                    let data = pattern((m * 10 + s) as u8, usize::from(blocks) * BLOCK);
                    let at = lun(1, (s % 2) as u8);
                    let write =
                        RequestSpec::scsi_out(at, &scsi::write10(lba, blocks), data.clone())
                            .shaped(shape);
                    let (_, w) = run(&model, &write, p);
                    assert_eq!(w.status, SrbStatus::SUCCESS, "{locking:?} {shape:?}");
                    assert_eq!(w.data_transfer_length, data.len() as u32);
                    let fake = model.miniport().transport();
                    assert_eq!(
                        fake.disk()
                            .peek(usize::from(at.lun), lba as usize * BLOCK, data.len()),
                        data
                    );
                    let read =
                        RequestSpec::scsi_in(at, &scsi::read10(lba, blocks), data.len() as u32)
                            .shaped(shape);
                    let (id, r) = run(&model, &read, p);
                    assert_eq!(r.status, SrbStatus::SUCCESS);
                    assert_eq!(r.completions, 1);
                    assert_eq!(model.data(id).unwrap(), data, "{locking:?} {shape:?}");
                }
                let fake = model.miniport().transport();
                assert_eq!(fake.errors(), 0);
                model.finish();
            });
        }
    }
}

/// Small writes go as immediate data, read through the request's CPU view.
#[test]
fn immediate_writes_use_the_cpu_view() {
    let platform = manual();
    platform.run_passive(|p| {
        let fake = FakeConfig {
            immediate_writes: true,
            ..FakeConfig::default()
        };
        let model = start(&platform, ModelConfig::default(), adapter_config(), fake, p);
        let data = pattern(5, 4 * BLOCK);
        let write = RequestSpec::scsi_out(lun(0, 0), &scsi::write16(7, 4), data.clone())
            .shaped(SgShape::Odd { seed: 5 });
        let (_, w) = run(&model, &write, p);
        assert_eq!(w.status, SrbStatus::SUCCESS);
        let fake = model.miniport().transport();
        assert_eq!(fake.stats().immediate, 1);
        assert_eq!(fake.disk().peek(0, 7 * BLOCK, data.len()), data);
        let (id, r) = run(
            &model,
            &RequestSpec::scsi_in(lun(0, 0), &scsi::read16(7, 4), data.len() as u32),
            p,
        );
        assert_eq!(r.status, SrbStatus::SUCCESS);
        assert_eq!(model.data(id).unwrap(), data);
        model.finish();
    });
}

/// CHECK CONDITION arrives with auto-sense; short transfers report what
/// moved; a target's BUSY is an error the class driver retries, not a
/// StorPort requeue.
#[test]
fn target_statuses_map_end_to_end() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = start(
            &platform,
            ModelConfig::default(),
            adapter_config(),
            FakeConfig::default(),
            p,
        );
        // Unknown opcode: ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE.
        let (_, o) = run(
            &model,
            &RequestSpec::scsi(lun(0, 0), &[0xE7, 0, 0, 0, 0, 0]),
            p,
        );
        assert_eq!(o.status, SrbStatus::ERROR.with_autosense());
        assert_eq!(o.scsi_status, 0x02);
        assert_eq!(
            o.sense,
            scsi::sense(
                SenseKey::IllegalRequest,
                AdditionalSense::INVALID_COMMAND_OPERATION_CODE
            )
            .to_vec()
        );
        // LBA out of range.
        let blocks = model.miniport().transport().disk().blocks();
        let (_, o) = run(
            &model,
            &RequestSpec::scsi_in(lun(0, 1), &scsi::read16(blocks - 1, 2), 2 * BLOCK as u32),
            p,
        );
        assert_eq!(o.status, SrbStatus::ERROR.with_autosense());
        assert_eq!(&o.sense[12..14], &[0x21, 0x00]);
        // A sense buffer of 8 bytes gets 8.
        let mut short = RequestSpec::scsi(lun(0, 0), &[0xE7, 0, 0, 0, 0, 0]);
        short.sense_len = 8;
        let (_, o) = run(&model, &short, p);
        assert_eq!(o.sense.len(), 8);
        // No sense buffer: no AUTOSENSE_VALID.
        short.sense_len = 0;
        let (_, o) = run(&model, &short, p);
        assert_eq!(o.status, SrbStatus::ERROR);
        // INQUIRY with a 96-byte buffer: 36 bytes moved, DATA_OVERRUN.
        let (id, o) = run(
            &model,
            &RequestSpec::scsi_in(lun(1, 0), &scsi::inquiry(96), 96),
            p,
        );
        assert_eq!(o.status, SrbStatus::DATA_OVERRUN);
        assert_eq!(o.data_transfer_length, 36);
        assert_eq!(&model.data(id).unwrap()[8..16], b"KVERBS  ");
        // READ CAPACITY into a 4-byte buffer: overrun, the buffer is full.
        let (_, o) = run(
            &model,
            &RequestSpec::scsi_in(lun(1, 0), &scsi::read_capacity10(), 4),
            p,
        );
        assert_eq!(o.status, SrbStatus::DATA_OVERRUN);
        assert_eq!(o.data_transfer_length, 4);
        let fake = model.miniport().transport();
        // Scripted: SCSI BUSY, TASK SET FULL, RESERVATION CONFLICT.
        for (status, want) in [
            (0x08, SrbStatus::ERROR),
            (0x28, SrbStatus::ERROR),
            (0x18, SrbStatus::ERROR),
            (0x40, SrbStatus::ABORTED),
        ] {
            fake.script(Scripted {
                status: Some(status),
                ..Scripted::default()
            });
            let (_, o) = run(
                &model,
                &RequestSpec::scsi_in(lun(0, 0), &scsi::read10(0, 1), BLOCK as u32),
                p,
            );
            assert_eq!((o.status, o.scsi_status), (want, status));
            assert_eq!(o.data_transfer_length, 0);
            assert_eq!(o.busy_requeues, 0);
        }
        // Scripted underrun: a quarter did not move.
        fake.script(Scripted {
            residual: Some(Residual::Underrun(1024)),
            ..Scripted::default()
        });
        let (_, o) = run(
            &model,
            &RequestSpec::scsi_in(lun(0, 0), &scsi::read10(0, 8), 8 * BLOCK as u32),
            p,
        );
        assert_eq!(o.status, SrbStatus::DATA_OVERRUN);
        assert_eq!(o.data_transfer_length, 3072);
        assert_eq!(fake.errors(), 0);
        model.finish();
    });
}

/// Addresses outside the map, unsupported functions, and the functions the
/// initiator answers itself.
#[test]
fn functions_and_addresses() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = start(
            &platform,
            ModelConfig {
                locking: StartIoLocking::FullDuplex,
                ..ModelConfig::default()
            },
            adapter_config(),
            FakeConfig::default(),
            p,
        );
        let tur = scsi::test_unit_ready();
        for (address, want) in [
            (Address::new(1, 0, 0), SrbStatus::INVALID_PATH_ID),
            (Address::new(0, 2, 0), SrbStatus::INVALID_TARGET_ID),
            (Address::new(0, 0, 2), SrbStatus::INVALID_LUN),
            (Address::new(0, 1, 1), SrbStatus::SUCCESS),
        ] {
            let (_, o) = run(&model, &RequestSpec::scsi(address, &tur), p);
            assert_eq!(o.status, want, "{address:?}");
        }
        for (function, want) in [
            (SrbFunction::Flush, SrbStatus::SUCCESS),
            (SrbFunction::Shutdown, SrbStatus::SUCCESS),
            (SrbFunction::Power, SrbStatus::SUCCESS),
            (SrbFunction::IoControl, SrbStatus::INVALID_REQUEST),
            (SrbFunction::Wmi, SrbStatus::INVALID_REQUEST),
            (SrbFunction::Other(0x7E), SrbStatus::INVALID_REQUEST),
            (SrbFunction::ResetBus, SrbStatus::SUCCESS),
        ] {
            let (_, o) = run(&model, &RequestSpec::function(function, lun(0, 0)), p);
            assert_eq!(o.status, want, "{function:?}");
        }
        for (action, want) in [
            (PnpAction::RemoveDevice, SrbStatus::SUCCESS),
            (PnpAction::SurpriseRemoval, SrbStatus::SUCCESS),
            (PnpAction::QueryCapabilities, SrbStatus::INVALID_REQUEST),
            (PnpAction::Other(77), SrbStatus::INVALID_REQUEST),
        ] {
            let mut spec = RequestSpec::function(SrbFunction::Pnp, lun(0, 1));
            spec.pnp_action = Some(action);
            let (_, o) = run(&model, &spec, p);
            assert_eq!(o.status, want, "{action:?}");
        }
        // A direction left unspecified is taken from the CDB.
        let mut spec = RequestSpec::scsi_in(lun(0, 0), &scsi::read10(0, 1), BLOCK as u32);
        spec.direction = DataDirection::Unspecified;
        let (_, o) = run(&model, &spec, p);
        assert_eq!(o.status, SrbStatus::SUCCESS);
        let mut spec = RequestSpec::scsi_in(lun(0, 0), &[0xE6, 0, 0, 0, 0, 0], 512);
        spec.direction = DataDirection::Unspecified;
        let (_, o) = run(&model, &spec, p);
        assert_eq!(o.status, SrbStatus::INVALID_REQUEST);
        // An empty CDB.
        let (_, o) = run(&model, &RequestSpec::scsi(lun(0, 0), &[]), p);
        assert_eq!(o.status, SrbStatus::INVALID_REQUEST);
        assert_eq!(model.miniport().transport().errors(), 0);
        model.finish();
    });
}

/// Scatter/gather lists refused for lack of map registers: the request is
/// answered BUSY, requeued, and goes through once lists are available.
#[test]
fn refused_sg_lists_are_retried() {
    let platform = manual();
    platform.run_passive(|p| {
        let model = start(
            &platform,
            ModelConfig::default(),
            adapter_config(),
            FakeConfig::default(),
            p,
        );
        model.refuse_sg_lists(2);
        let id = model
            .submit(
                &RequestSpec::scsi_in(lun(0, 0), &scsi::read10(0, 2), 2 * BLOCK as u32),
                p,
            )
            .unwrap();
        model.settle();
        // Held by the device pause until StorPort's clock moves.
        for _ in 0..3 {
            model.advance(support::SECOND, p);
            model.settle();
        }
        let o = model.outcome(id).unwrap();
        assert_eq!(o.state, RequestState::Completed);
        assert_eq!(o.status, SrbStatus::SUCCESS);
        assert_eq!(o.busy_requeues, 2);
        model.finish();
    });
}

/// Several threads call StartIo at once, with completions on the DPC
/// threads: every request completes once, with the right data.
#[test]
fn concurrent_start_io_callers() {
    for locking in [
        StartIoLocking::Virtual,
        StartIoLocking::ConcurrentChannels,
        StartIoLocking::FullDuplex,
    ] {
        let platform = threaded(2);
        let model = platform.run_passive(|p| {
            start(
                &platform,
                ModelConfig {
                    locking,
                    ..ModelConfig::default()
                },
                adapter_config(),
                FakeConfig {
                    out_of_order: true,
                    ..FakeConfig::default()
                },
                p,
            )
        });
        let per_thread = 24u32;
        std::thread::scope(|scope| {
            for t in 0..3u32 {
                let model = &model;
                let platform = &platform;
                scope.spawn(move || {
                    platform.run_passive(|p| {
                        let at = lun((t % 2) as u8, (t / 2) as u8);
                        for i in 0..per_thread {
                            let lba = t * 1000 + i * 4;
                            let data = pattern((t * 31 + i) as u8, 4 * BLOCK);
                            let spec =
                                RequestSpec::scsi_out(at, &scsi::write10(lba, 4), data.clone())
                                    .shaped(SgShape::Odd { seed: u64::from(i) });
                            model.submit(&spec, p).unwrap();
                        }
                    });
                });
            }
        });
        model.settle();
        // Every write completed once; read everything back.
        let writes = model.created();
        for id in 0..writes {
            let o = model.outcome(id).unwrap();
            assert_eq!(
                (o.state, o.status, o.completions),
                (RequestState::Completed, SrbStatus::SUCCESS, 1)
            );
        }
        platform.run_passive(|p| {
            for t in 0..3u32 {
                let at = lun((t % 2) as u8, (t / 2) as u8);
                for i in 0..per_thread {
                    let lba = t * 1000 + i * 4;
                    let (id, o) = run(
                        &model,
                        &RequestSpec::scsi_in(at, &scsi::read10(lba, 4), 4 * BLOCK as u32),
                        p,
                    );
                    assert_eq!(o.status, SrbStatus::SUCCESS);
                    assert_eq!(
                        model.data(id).unwrap(),
                        pattern((t * 31 + i) as u8, 4 * BLOCK)
                    );
                }
            }
        });
        assert_eq!(model.miniport().transport().errors(), 0);
        model.finish();
    }
}

/// `reissue` runs a completed request again with a new CDB, direction and
/// data in the same buffer (how a benchmark keeps one request per
/// outstanding I/O), with nothing left over from the last completion; the
/// completion hook hears of every completion once its outcome is final, and
/// an uncompleted request cannot be reissued.
#[test]
fn a_completed_request_is_reissued_and_every_completion_is_heard() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    let platform = manual();
    platform.run_passive(|p| {
        let model = start(
            &platform,
            ModelConfig::default(),
            adapter_config(),
            FakeConfig::default(),
            p,
        );
        let heard = Arc::new(AtomicU32::new(0));
        let last = Arc::new(AtomicU32::new(u32::MAX));
        {
            let (heard, last) = (heard.clone(), last.clone());
            assert!(model.on_complete(Box::new(move |id| {
                last.store(id, Ordering::Relaxed);
                heard.fetch_add(1, Ordering::Relaxed);
            })));
        }
        assert!(!model.on_complete(Box::new(|_| {})), "one hook only");
        let at = lun(0, 0);
        let first = pattern(1, 4 * BLOCK);
        let (id, w) = run(
            &model,
            &RequestSpec::scsi_out(at, &scsi::write10(8, 4), first.clone()),
            p,
        );
        assert_eq!(w.status, SrbStatus::SUCCESS);
        assert_eq!(heard.load(Ordering::Relaxed), 1);
        assert_eq!(last.load(Ordering::Relaxed), id);
        // The same request, now a READ elsewhere: the target's zeros come
        // back (the buffer is overwritten, not left holding the write).
        model
            .reissue(id, at, &scsi::read10(100, 4), DataDirection::In, None)
            .unwrap();
        model.pump(p);
        model.settle();
        let r = model.outcome(id).unwrap();
        assert_eq!(
            (r.state, r.status, r.completions),
            (RequestState::Completed, SrbStatus::SUCCESS, 1)
        );
        assert_eq!(model.data(id).unwrap(), vec![0u8; 4 * BLOCK]);
        // Again as a READ of what was written first.
        model
            .reissue(id, at, &scsi::read10(8, 4), DataDirection::In, None)
            .unwrap();
        model.pump(p);
        model.settle();
        assert_eq!(model.data(id).unwrap(), first);
        // As a WRITE with new data, then read back through a fresh request.
        let second = pattern(2, 4 * BLOCK);
        model
            .reissue(
                id,
                at,
                &scsi::write10(8, 4),
                DataDirection::Out,
                Some(&second),
            )
            .unwrap();
        model.pump(p);
        model.settle();
        let (_, r) = run(
            &model,
            &RequestSpec::scsi_in(at, &scsi::read10(8, 4), 4 * BLOCK as u32),
            p,
        );
        assert_eq!(r.status, SrbStatus::SUCCESS);
        assert_eq!(heard.load(Ordering::Relaxed), 5);
        // A status from the last completion does not stick: a failing
        // command, then a good one in the same request.
        model
            .reissue(
                id,
                at,
                &scsi::read10(u32::MAX - 1, 4),
                DataDirection::In,
                None,
            )
            .unwrap();
        model.pump(p);
        model.settle();
        assert_ne!(model.outcome(id).unwrap().status, SrbStatus::SUCCESS);
        model
            .reissue(id, at, &scsi::read10(8, 4), DataDirection::In, None)
            .unwrap();
        model.pump(p);
        model.settle();
        let r = model.outcome(id).unwrap();
        assert_eq!(
            (r.status, r.scsi_status, r.data_transfer_length),
            (SrbStatus::SUCCESS, 0, 4 * BLOCK as u32)
        );
        assert_eq!(model.data(id).unwrap(), second);
        // Not completed (queued, or never issued): refused. Too much data:
        // refused.
        let held = model
            .create(
                &RequestSpec::scsi_in(at, &scsi::read10(0, 1), BLOCK as u32),
                p,
            )
            .unwrap();
        assert!(
            model
                .reissue(held, at, &scsi::read10(0, 1), DataDirection::In, None)
                .is_err()
        );
        assert!(
            model
                .reissue(
                    id,
                    at,
                    &scsi::write10(8, 4),
                    DataDirection::Out,
                    Some(&[0; 8 * BLOCK])
                )
                .is_err()
        );
        assert!(
            model
                .reissue(9999, at, &scsi::read10(0, 1), DataDirection::In, None)
                .is_err()
        );
        model.issue(held).unwrap();
        model.pump(p);
        model.finish();
    });
    platform.finish();
}
