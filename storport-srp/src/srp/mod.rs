//! The SRP initiator engine (placeholder docs; filled in below).

pub mod params;
