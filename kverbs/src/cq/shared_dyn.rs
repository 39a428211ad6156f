//! An `Arc<dyn Trait>` whose object address is worked out once.
//!
//! Dereferencing an `Arc<dyn Trait>` finds the object behind the counts at
//! an offset that depends on the object's alignment, which only the vtable
//! knows: every deref loads the alignment and rounds (some five
//! instructions). The CQ's DPC makes two such calls every round (the arm
//! doorbell and the consumer's handler), a per-round cost a QD 1 read pays
//! twice. [`SharedDyn`] keeps the `Arc` for ownership and the object's
//! (fat) address beside it, so a deref is the two loads of a reference.

// UNSAFETY: the cached pointer is `Arc::as_ptr` of the `Arc` held beside
// it, turned back into a reference only while that `Arc` is alive.
#![expect(unsafe_code, reason = "a cached Arc::as_ptr dereferenced")]

use alloc::sync::Arc;
use core::fmt;
use core::ops::Deref;
use core::ptr::NonNull;

/// An `Arc<T>` with the address of its `T` cached (see the
/// [module docs](self)).
///
/// # Invariants
///
/// `object` is `Arc::as_ptr(&_owner)`: valid for shared access for as long
/// as `_owner` holds its reference, which is as long as `self` lives.
pub(crate) struct SharedDyn<T: ?Sized> {
    /// Held only for ownership: it keeps `object` alive.
    _owner: Arc<T>,
    object: NonNull<T>,
}

impl<T: ?Sized> SharedDyn<T> {
    /// Takes `owner` over and caches the address of its object.
    pub(crate) fn new(owner: Arc<T>) -> Self {
        let object = NonNull::from(&*owner);
        SharedDyn {
            _owner: owner,
            object,
        }
    }
}

impl<T: ?Sized> Deref for SharedDyn<T> {
    type Target = T;

    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: `object` points at `_owner`'s object (type invariant),
        // which `_owner` keeps alive and never hands out mutably (an `Arc` is
        // shared) while `self` — and so this borrow — lives.
        unsafe { self.object.as_ref() }
    }
}

// SAFETY: a `SharedDyn<T>` is an `Arc<T>` plus a pointer that only reads the
// same object: it may cross or be shared between threads exactly when the
// `Arc<T>` may (`T: Send + Sync`).
unsafe impl<T: ?Sized + Send + Sync> Send for SharedDyn<T> {}
// SAFETY: as for `Send` above.
unsafe impl<T: ?Sized + Send + Sync> Sync for SharedDyn<T> {}

impl<T: ?Sized> fmt::Debug for SharedDyn<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedDyn")
            .field("object", &self.object.as_ptr().cast::<()>())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use core::sync::atomic::{AtomicUsize, Ordering};

    trait Count: Send + Sync {
        fn bump(&self) -> usize;
    }

    /// Aligned beyond the counts, so the object sits at a padded offset.
    #[repr(align(64))]
    struct Wide(AtomicUsize);

    impl Count for Wide {
        fn bump(&self) -> usize {
            self.0.fetch_add(1, Ordering::Relaxed) + 1
        }
    }

    #[test]
    fn derefs_to_the_arcs_object_and_keeps_it_alive() {
        let arc: Arc<dyn Count> = Arc::new(Wide(AtomicUsize::new(0)));
        let shared = SharedDyn::new(Arc::clone(&arc));
        assert_eq!(Arc::strong_count(&arc), 2);
        assert!(core::ptr::addr_eq(&*shared, Arc::as_ptr(&arc)));
        assert_eq!(shared.bump(), 1);
        let weak = Arc::downgrade(&arc);
        drop(arc);
        // The cached address stays valid on the one reference left.
        assert_eq!(shared.bump(), 2);
        assert_eq!(weak.strong_count(), 1);
        let moved = std::thread::spawn(move || shared.bump()).join().unwrap();
        assert_eq!(moved, 3);
        assert_eq!(weak.strong_count(), 0, "dropping it dropped the Arc");
    }
}
