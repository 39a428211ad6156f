// The Dispatch token of a spin-lock guard cannot outlive the guard.
use kverbs::irql::Dispatch;
use kverbs::platform::host::HostPlatform;
use kverbs::sync::SpinLock;

fn keep(_: &Dispatch<'_>) {}

fn main() {
    let platform = HostPlatform::new();
    let lock: SpinLock<u32, HostPlatform> = SpinLock::new(0);
    platform.run_passive(|p| {
        let token;
        {
            let guard = lock.lock(p);
            token = guard.irql();
        }
        keep(token);
    });
}
