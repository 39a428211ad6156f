//! The transport the driver runs until an HCA backend exists on Windows:
//! [`NoHca`] reaches no target, and says so.
//!
//! kverbs has no NT HCA backend in this project, so on Windows nothing can
//! reach a target. The driver still registers the real miniport core
//! ([`Adapter`]) — its request tracking, status mapping, task management,
//! resets and stop/restart — over this transport, so SCSI requests get the
//! core's truthful answers:
//!
//! * when the core starts the transport (`passive_initialize` → the kverbs
//!   passive worker), every attached target is reported
//!   [`TargetState::FailFast`]: "not reachable on this path now, and the
//!   engine has given up waiting". The core then answers commands to it
//!   `SRB_STATUS_SELECTION_TIMEOUT` — the target was addressed and nothing
//!   answered, which is what StorPort's bus scan expects of an empty target
//!   id — and resets of its LUNs the same way. (`Lost` would make every
//!   command `SRB_STATUS_NO_DEVICE`, "the device is gone", claiming it had
//!   existed.) Before the report arrives a target is `Connecting`, which the
//!   core answers the same way;
//! * addresses outside the attached targets get the core's `INVALID_*`
//!   statuses; aborts find nothing outstanding (`ABORT_FAILED`);
//! * nothing is ever posted, so no scatter/gather list is ever asked for.
//!
//! [`NoHcaDriver`] is the [`NtDriver`](super::miniport::NtDriver) the
//! driver crate registers: the core over this transport, shaped by the
//! registry ([`super::params`]).

use alloc::boxed::Box;
use core::convert::Infallible;

use kverbs::irql::{LeDispatch, Passive};
use kverbs::sync::with_dispatch;

use super::params::Settings;
use crate::miniport::transport::{
    FailureKind, Lun, PostFailed, PrepareError, ScsiCommand, StartFailed, Tag, TargetState,
    TmfRefused, Transport, Upcalls,
};
use crate::miniport::{Adapter, CoreContext};
use crate::storport::{FindAdapterError, StorPort};

/// A transport with no HCA behind it: every attached target is unreachable.
pub struct NoHca<P> {
    upcalls: Upcalls,
    targets: u8,
    _platform: core::marker::PhantomData<fn() -> P>,
}

impl<P> core::fmt::Debug for NoHca<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NoHca")
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

impl<P: kverbs::platform::Platform> NoHca<P> {
    /// The transport for `targets` attached targets, reporting through
    /// `upcalls`.
    #[must_use]
    pub fn new(upcalls: Upcalls, targets: u8) -> Self {
        NoHca {
            upcalls,
            targets,
            _platform: core::marker::PhantomData,
        }
    }
}

impl<P: kverbs::platform::Platform> Transport for NoHca<P> {
    /// Nothing is ever prepared.
    type Prepared = Infallible;

    fn prepare(
        &self,
        _command: &ScsiCommand<'_>,
        _irql: &impl LeDispatch,
    ) -> Result<Infallible, PrepareError> {
        Err(PrepareError::Failed(FailureKind::FailFast))
    }

    fn post(&self, prepared: Infallible, _irql: &impl LeDispatch) -> Result<(), PostFailed> {
        match prepared {}
    }

    fn discard(&self, prepared: Infallible, _irql: &impl LeDispatch) {
        match prepared {}
    }

    fn abort_task(
        &self,
        _target: u8,
        _lun: Lun,
        _victim: Tag,
        _tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        Err(TmfRefused::NotConnected)
    }

    fn reset_lun(
        &self,
        _target: u8,
        _lun: Lun,
        _tmf: Tag,
        _irql: &impl LeDispatch,
    ) -> Result<(), TmfRefused> {
        Err(TmfRefused::NotConnected)
    }

    fn reset(&self, _irql: &impl LeDispatch) {
        // Nothing is outstanding: nothing to terminate.
    }

    fn start(&self, irql: &Passive<'_>) -> Result<(), StartFailed> {
        for target in 0..self.targets {
            with_dispatch::<P, _, _>(irql, |d| {
                self.upcalls.target_state(target, TargetState::FailFast, d);
            });
        }
        Ok(())
    }

    fn stop(&self, _irql: &Passive<'_>) {
        // No connection, no command, no upcall to come.
    }
}

/// The core's context for an adapter over [`NoHca`], shaped by `settings`.
#[must_use]
pub fn core_context<S: StorPort>(settings: &Settings) -> CoreContext<NoHca<S::Platform>> {
    let config = settings.adapter_config();
    let targets = config.targets;
    CoreContext {
        config,
        make_transport: Box::new(move |upcalls, _irql| Ok(NoHca::new(upcalls, targets))),
    }
}

/// The driver the `kvsrp.sys` crate registers: the miniport core over
/// [`NoHca`].
pub struct NoHcaDriver;

impl super::miniport::NtDriver for NoHcaDriver {
    type Miniport = Adapter<super::port::NtStorPort, NoHca<kverbs::platform::nt::NtPlatform>>;

    fn context(
        settings: &Settings,
        _irql: &Passive<'_>,
    ) -> Result<CoreContext<NoHca<kverbs::platform::nt::NtPlatform>>, FindAdapterError> {
        Ok(core_context::<super::port::NtStorPort>(settings))
    }
}

#[cfg(all(test, feature = "host"))]
mod tests {
    use super::*;
    use crate::nt::params::{Attachment, Protocol, Tunables};
    use crate::storport::host::{HostPort, ModelConfig, RequestSpec, RequestState, StorPortModel};
    use crate::storport::{Address, SrbFunction, SrbStatus};
    use kverbs::platform::host::HostPlatform;

    type Model = StorPortModel<Adapter<HostPort, NoHca<HostPlatform>>>;

    fn settings(targets: usize, driver_parameter: &[u8]) -> Settings {
        let mut tunables = Tunables::default();
        tunables.apply_driver_parameter(driver_parameter).unwrap();
        let targets = (0..targets)
            .map(|i| Attachment {
                name: alloc::format!("t{i}"),
                protocol: Protocol::Srp {
                    add_target: "id_ext=1".into(),
                },
            })
            .collect();
        Settings::new(tunables, targets).unwrap()
    }

    fn status(model: &Model, spec: &RequestSpec, p: &Passive<'_>) -> SrbStatus {
        let id = model.submit(spec, p).unwrap();
        model.settle();
        let outcome = model.outcome(id).unwrap();
        assert_eq!(outcome.state, RequestState::Completed, "{spec:?}");
        outcome.status.base()
    }

    /// The core over NoHca, under the StorPort model: every request gets a
    /// truthful, final status; nothing is transferred; the model's checks
    /// (exactly-once, IRQL, no allocation at DISPATCH) pass.
    #[test]
    fn the_core_over_no_hca_answers_truthfully() {
        let platform = HostPlatform::manual();
        platform.run_passive(|p| {
            let mut model = Model::new(&platform, ModelConfig::default(), p);
            let context = core_context::<HostPort>(&settings(2, b"QueueSize=16"));
            model.start(&context, p).unwrap();
            model.settle();
            let inquiry = [0x12, 0, 0, 0, 36, 0];
            for target in 0..2 {
                let spec = RequestSpec::scsi_in(Address::new(0, target, 0), &inquiry, 36);
                assert_eq!(status(&model, &spec, p), SrbStatus::SELECTION_TIMEOUT);
            }
            let beyond = RequestSpec::scsi_in(Address::new(0, 2, 0), &inquiry, 36);
            assert_eq!(status(&model, &beyond, p), SrbStatus::INVALID_TARGET_ID);
            let lun = RequestSpec::scsi_in(Address::new(0, 0, 9), &inquiry, 36);
            assert_eq!(status(&model, &lun, p), SrbStatus::INVALID_LUN);
            let bus = RequestSpec::scsi_in(Address::new(1, 0, 0), &inquiry, 36);
            assert_eq!(status(&model, &bus, p), SrbStatus::INVALID_PATH_ID);
            let reset = RequestSpec::function(SrbFunction::ResetLogicalUnit, Address::new(0, 1, 0));
            assert_eq!(status(&model, &reset, p), SrbStatus::SELECTION_TIMEOUT);
            let abort = RequestSpec::abort(Address::new(0, 0, 0), 0);
            assert_eq!(status(&model, &abort, p), SrbStatus::ABORT_FAILED);
            let flush = RequestSpec::function(SrbFunction::Flush, Address::new(0, 0, 0));
            assert_eq!(status(&model, &flush, p), SrbStatus::SUCCESS);
            let ioctl = RequestSpec::function(SrbFunction::IoControl, Address::new(0, 0, 0));
            assert_eq!(status(&model, &ioctl, p), SrbStatus::INVALID_REQUEST);
            model.reset_bus(p);
            assert!(model.stop_adapter(p));
            model.settle();
            assert!(model.restart_adapter(p));
            model.settle();
            let again = RequestSpec::scsi_in(Address::new(0, 1, 3), &inquiry, 36);
            assert_eq!(status(&model, &again, p), SrbStatus::SELECTION_TIMEOUT);
            for id in 0..model.created() {
                assert_eq!(model.data(id).map(|d| d.iter().all(|&b| b == 0)), Ok(true));
            }
            model.free_adapter(p);
            model.finish();
        });
        platform.finish();
    }

    #[test]
    fn the_transport_refuses_everything_it_cannot_carry() {
        let platform = HostPlatform::manual();
        let recorded = alloc::sync::Arc::new(Recorder::default());
        let t: NoHca<HostPlatform> = NoHca::new(Upcalls::new(recorded.clone()), 3);
        platform.run_passive(|p| {
            let lun = Lun::from_index(0).unwrap();
            assert_eq!(
                t.abort_task(0, lun, Tag(1), Tag(2), p),
                Err(TmfRefused::NotConnected)
            );
            assert_eq!(
                t.reset_lun(0, lun, Tag(2), p),
                Err(TmfRefused::NotConnected)
            );
            t.reset(p);
            assert_eq!(t.start(p), Ok(()));
            t.stop(p);
        });
        assert_eq!(
            *recorded.states.lock().unwrap(),
            [0, 1, 2].map(|t| (t, TargetState::FailFast))
        );
        platform.finish();
    }

    #[derive(Default)]
    struct Recorder {
        states: std::sync::Mutex<Vec<(u8, TargetState)>>,
    }

    impl crate::miniport::transport::TransportEvents for Recorder {
        fn command_done(
            &self,
            _: Tag,
            _: &crate::miniport::transport::CommandResult<'_>,
            _: &kverbs::irql::Dispatch<'_>,
        ) {
            unreachable!("nothing is posted");
        }
        fn tmf_done(
            &self,
            _: Tag,
            _: crate::miniport::transport::TmfResponse,
            _: &kverbs::irql::Dispatch<'_>,
        ) {
            unreachable!("no TMF is accepted");
        }
        fn target_state(&self, target: u8, state: TargetState, _: &kverbs::irql::Dispatch<'_>) {
            self.states.lock().unwrap().push((target, state));
        }
        fn credits_available(&self, _: u8, _: &kverbs::irql::Dispatch<'_>) {}
    }
}
