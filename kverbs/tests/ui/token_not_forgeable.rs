// Tokens cannot be built by hand: their fields are private.
use kverbs::irql::Passive;

fn main() {
    let forged = Passive { _marker: std::marker::PhantomData };
    let _ = forged;
}
