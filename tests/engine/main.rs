//! The lock engine (`tower_redlock::lock`, the nodes, the test kit and the metrics), one
//! module per concern. Modules that need more than the library alone are gated on their
//! features, so this binary builds under every feature combination (the in-process
//! quorum tests run with none).
//!
//! Every Redis server is spawned by `support` on a free 127.0.0.1 port.

#[path = "../support/mod.rs"]
mod support;

mod quorum_memory;
mod support_selftest;
mod values;

#[cfg(feature = "redis")]
mod acquire_script;
#[cfg(feature = "redis")]
mod batch;
#[cfg(feature = "redis")]
mod command_batches;
#[cfg(all(feature = "redis", feature = "test-util"))]
mod conformance;
#[cfg(feature = "redis")]
mod engine;
#[cfg(feature = "redis")]
mod fair;
#[cfg(feature = "redis")]
mod modes;
#[cfg(feature = "redis")]
mod operators;
#[cfg(feature = "redis")]
mod persistence;
#[cfg(feature = "redis")]
mod reconnect;
#[cfg(feature = "redis")]
mod sets;
#[cfg(feature = "redis")]
mod smoke;
#[cfg(feature = "redis")]
mod ttls;
#[cfg(feature = "redis")]
mod urls;
#[cfg(feature = "redis")]
mod watchdog;

#[cfg(all(feature = "test-util", feature = "axum"))]
mod kit;
#[cfg(all(feature = "metrics", feature = "test-util", feature = "axum"))]
mod metrics;
