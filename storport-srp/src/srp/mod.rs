//! The SRP initiator engine (placeholder docs; filled in below).

pub mod credits;
pub mod login;
pub mod mapping;
pub mod params;
pub mod recovery;
pub mod tags;
