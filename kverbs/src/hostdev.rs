//! The software HCA as the host verifier sees it (feature `host`).
//!
//! [`VerifiedHca`] wraps any [`HcaDevice`] — in practice
//! `hca_lowlevel::sim::SoftHca` — so the verifier can tell the driver from
//! the device model:
//!
//! * every doorbell write runs inside [`host::as_device`]: a stepped
//!   HCA executing posted work inline in the doorbell write (on a DPC
//!   thread, at `DISPATCH_LEVEL`) allocates and locks as silicon would,
//!   not as the driver. kverbs rings every doorbell through
//!   [`Platform::write_doorbell`](crate::platform::Platform::write_doorbell),
//!   which on the host enters that scope, so the registers are handed on
//!   unwrapped: a wrapper register cost a second indirect call and a frame
//!   per ring — once per DPC round for the arm doorbell;
//! * every event handler kverbs gives the device runs inside
//!   [`host::as_driver`]: the driver's own code in a completion or
//!   asynchronous event is checked in full, even inside a doorbell write;
//! * every control command first checks the caller's IRQL
//!   ([`host::check_blocking_call`]): firmware commands block, so issuing
//!   one above `PASSIVE_LEVEL` is a violation.

use alloc::sync::Arc;

use hca_lowlevel::device::{
    AsyncEvent, AsyncEventHandler, CqEventHandler, CqResources, DeviceAttr, Gid, HcaDevice,
    HcaError, MrKeys, MrRegistration, Pdn, PortAttr, QpAttr, QpAttrMask, QpInit, QpResources,
};
use hca_lowlevel::dma::{DmaAllocator, DmaBuffer};
use hca_lowlevel::ring::CqRing;

use crate::platform::host;

/// An [`HcaDevice`] whose device-model work the host verifier ignores and
/// whose driver callbacks it checks (see the [module docs](self)).
pub struct VerifiedHca {
    inner: Arc<dyn HcaDevice>,
}

impl VerifiedHca {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn HcaDevice>) -> Arc<Self> {
        Arc::new(VerifiedHca { inner })
    }
}

struct DriverCqEvents(Arc<dyn CqEventHandler>);

impl CqEventHandler for DriverCqEvents {
    fn completion_event(&self, cqn: u32) {
        host::as_driver(|| self.0.completion_event(cqn));
    }
}

struct DriverAsyncEvents(Arc<dyn AsyncEventHandler>);

impl AsyncEventHandler for DriverAsyncEvents {
    fn async_event(&self, event: AsyncEvent) {
        host::as_driver(|| self.0.async_event(event));
    }
}

fn firmware<R>(f: impl FnOnce() -> R) -> R {
    host::check_blocking_call();
    host::as_device(f)
}

impl HcaDevice for VerifiedHca {
    fn query_device(&self) -> DeviceAttr {
        firmware(|| self.inner.query_device())
    }

    fn query_port(&self, port: u8) -> Result<PortAttr, HcaError> {
        firmware(|| self.inner.query_port(port))
    }

    fn query_gid(&self, port: u8, index: u16) -> Result<Gid, HcaError> {
        firmware(|| self.inner.query_gid(port, index))
    }

    fn dma_allocator(&self) -> Arc<dyn DmaAllocator> {
        firmware(|| self.inner.dma_allocator())
    }

    fn set_async_event_handler(&self, handler: Option<Arc<dyn AsyncEventHandler>>) {
        let wrapped = handler.map(|h| Arc::new(DriverAsyncEvents(h)) as Arc<dyn AsyncEventHandler>);
        firmware(|| self.inner.set_async_event_handler(wrapped));
    }

    fn alloc_pd(&self) -> Result<Pdn, HcaError> {
        firmware(|| self.inner.alloc_pd())
    }

    fn dealloc_pd(&self, pd: Pdn) -> Result<(), HcaError> {
        firmware(|| self.inner.dealloc_pd(pd))
    }

    fn create_cq(
        &self,
        entries: u32,
        handler: Arc<dyn CqEventHandler>,
    ) -> Result<CqResources, HcaError> {
        let handler: Arc<dyn CqEventHandler> = Arc::new(DriverCqEvents(handler));
        firmware(|| self.inner.create_cq(entries, handler))
    }

    fn resize_cq(&self, cqn: u32, entries: u32) -> Result<CqRing<DmaBuffer>, HcaError> {
        firmware(|| self.inner.resize_cq(cqn, entries))
    }

    fn destroy_cq(&self, cqn: u32) -> Result<(), HcaError> {
        firmware(|| self.inner.destroy_cq(cqn))
    }

    fn create_qp(&self, init: &QpInit) -> Result<QpResources, HcaError> {
        firmware(|| self.inner.create_qp(init))
    }

    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: QpAttrMask) -> Result<(), HcaError> {
        firmware(|| self.inner.modify_qp(qpn, attr, mask))
    }

    fn query_qp(&self, qpn: u32) -> Result<QpAttr, HcaError> {
        firmware(|| self.inner.query_qp(qpn))
    }

    fn destroy_qp(&self, qpn: u32) -> Result<(), HcaError> {
        firmware(|| self.inner.destroy_qp(qpn))
    }

    fn reg_mr(&self, reg: &MrRegistration<'_>) -> Result<MrKeys, HcaError> {
        firmware(|| self.inner.reg_mr(reg))
    }

    fn dereg_mr(&self, lkey: u32) -> Result<(), HcaError> {
        firmware(|| self.inner.dereg_mr(lkey))
    }

    fn alloc_mkey(&self, pd: Pdn, max_pages: u32) -> Result<u32, HcaError> {
        firmware(|| self.inner.alloc_mkey(pd, max_pages))
    }

    fn free_mkey(&self, mkey: u32) -> Result<(), HcaError> {
        firmware(|| self.inner.free_mkey(mkey))
    }
}
