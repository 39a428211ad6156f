//! Protection domains.

use alloc::sync::Arc;
use core::fmt;

use hca_lowlevel::device::Pdn;

use crate::device::{Device, DeviceInner};
use crate::error::VerbsError;
use crate::irql::Passive;
use crate::platform::Platform;
use crate::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct PdInner<P: Platform> {
    pub(crate) device: Arc<DeviceInner<P>>,
    pub(crate) pdn: Pdn,
    freed: AtomicBool,
}

/// A protection domain (cheap to clone; clones share it). QPs and MRs
/// belong to one; a key of one PD is refused on a QP of another.
pub struct Pd<P: Platform> {
    pub(crate) inner: Arc<PdInner<P>>,
}

impl<P: Platform> Clone for Pd<P> {
    fn clone(&self) -> Self {
        Pd {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P: Platform> fmt::Debug for Pd<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Pd").field(&self.inner.pdn).finish()
    }
}

impl<P: Platform> Device<P> {
    /// Allocates a protection domain.
    ///
    /// # Errors
    ///
    /// [`VerbsError::Hca`] (`OutOfResources`).
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn alloc_pd(&self, _irql: &Passive<'_>) -> Result<Pd<P>, VerbsError> {
        let pdn = self.inner.hca.alloc_pd()?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                device: Arc::clone(&self.inner),
                pdn,
                freed: AtomicBool::new(false),
            }),
        })
    }
}

impl<P: Platform> Pd<P> {
    /// The PD number.
    pub fn pdn(&self) -> Pdn {
        self.inner.pdn
    }

    /// The device.
    pub fn device(&self) -> Device<P> {
        Device {
            inner: Arc::clone(&self.inner.device),
        }
    }

    /// Frees the PD on the device.
    ///
    /// # Errors
    ///
    /// [`VerbsError::InUse`] while QPs or MRs use it; [`VerbsError::Closed`]
    /// if already freed.
    ///
    /// # IRQL
    ///
    /// `PASSIVE_LEVEL` only.
    pub fn dealloc(&self, _irql: &Passive<'_>) -> Result<(), VerbsError> {
        if self.inner.freed.load(Ordering::Acquire) {
            return Err(VerbsError::Closed);
        }
        self.inner.device.hca.dealloc_pd(self.inner.pdn)?;
        self.inner.freed.store(true, Ordering::Release);
        Ok(())
    }
}
