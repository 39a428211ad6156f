// Under a spin lock the guard hands out a Dispatch token, and a blocking
// call does not accept it.
use kverbs::platform::host::{HostEvent, HostPlatform};
use kverbs::platform::{EventKind, RawEvent};
use kverbs::sync::SpinLock;

fn main() {
    let platform = HostPlatform::new();
    let lock: SpinLock<u32, HostPlatform> = SpinLock::new(0);
    let event = HostEvent::new(EventKind::Notification, true);
    platform.run_passive(|p| {
        let guard = lock.lock(p);
        event.wait(guard.irql());
    });
}
