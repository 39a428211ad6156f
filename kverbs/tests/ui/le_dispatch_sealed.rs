// LeDispatch is sealed: no other type can claim to prove an IRQL.
use kverbs::irql::{Irql, LeDispatch};

struct HighIrql;

impl LeDispatch for HighIrql {
    const IRQL: Irql = Irql::DISPATCH;
}

fn main() {}
