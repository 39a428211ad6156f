// A blocking function cannot be called with a Dispatch token.
use kverbs::irql::Dispatch;
use kverbs::platform::host::HostEvent;
use kverbs::platform::{EventKind, RawEvent};

fn in_a_dpc(event: &HostEvent, irql: &Dispatch<'_>) {
    event.wait(irql);
}

fn main() {
    let event = HostEvent::new(EventKind::Notification, true);
    let _ = (event, in_a_dpc);
}
