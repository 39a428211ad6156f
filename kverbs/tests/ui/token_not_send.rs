// A token cannot be sent to another thread: the IRQL belongs to this one.
use kverbs::platform::host::HostPlatform;

fn main() {
    let platform = HostPlatform::new();
    platform.run_passive(|p| {
        std::thread::scope(|s| {
            s.spawn(move || {
                std::hint::black_box(p);
            });
        });
    });
}
