// A Dispatch token cannot be sent to another thread either.
use kverbs::irql::Dispatch;

fn send<T: Send>(_: T) {}

fn in_a_dpc(irql: &Dispatch<'_>) {
    send(irql);
}

fn main() {
    let _ = in_a_dpc;
}
