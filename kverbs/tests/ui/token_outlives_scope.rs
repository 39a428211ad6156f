// A token cannot outlive the scope its trampoline vouches for.
use kverbs::irql::Passive;
use kverbs::platform::host::HostPlatform;

fn main() {
    let platform = HostPlatform::new();
    let mut saved: Option<&Passive<'_>> = None;
    platform.run_passive(|p| {
        saved = Some(p);
    });
    let _ = saved;
}
