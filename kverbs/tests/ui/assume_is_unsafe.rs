// The assume constructors are unsafe: the caller vouches for the IRQL.
use kverbs::irql::Dispatch;
use kverbs::platform::host::HostPlatform;

fn main() {
    let assumed = Dispatch::assume::<HostPlatform>();
    let _ = assumed;
}
