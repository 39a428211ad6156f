//! Unit tests of the CM engine.
