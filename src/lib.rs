//! A Redlock distributed lock around HTTP handlers.
#![warn(missing_docs, rust_2018_idioms)]
#![deny(unsafe_code)]

mod error;
pub mod lock;

pub use error::{ConfigError, LockError, NodeError, NodeFailure};
pub use lock::fencing::{self, FencingToken};
#[cfg(feature = "redis")]
pub use lock::RedisNode;
pub use lock::{
    Backoff, Lease, LeaseHandle, LockOptions, LostCause, MemoryNode, MetricsSnapshot, Node,
    Redlock, ReleaseOutcome, Resource, RetryPolicy,
};
