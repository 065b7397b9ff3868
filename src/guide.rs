//! Guides: what the README leaves out, with examples that compile.
//!
//! | guide | for |
//! |---|---|
//! | [`tour`] | the demo, step by step: contention, waiting, replay, several keys, PostgreSQL, three nodes, a cluster |
//! | [`keys`] | where keys come from; several keys per request; the lock inside the handler; many resources in one lease |
//! | [`modes`] | readers and writers; at most `n` holders at once |
//! | [`replay`] | idempotent replay: what is recorded, scoped and replayed, and when the outcome is unknown |
//! | [`operations`] | every option of the layer and the locker, what `connect` checks, features, metrics and logs |
//! | [`stores`] | one server, Redlock over several, Cluster, Sentinel, etcd: what a lease rests on |
//! | [`safety`] | the guarantees under each persistence mode and failure; other Redlock libraries |
//! | `testing` | driving your handlers into every path without Redis (feature `test-util`) |

#[doc = include_str!("../docs/tour.md")]
pub mod tour {}

#[doc = include_str!("../docs/keys.md")]
pub mod keys {}

#[doc = include_str!("../docs/modes.md")]
pub mod modes {}

#[doc = include_str!("../docs/replay.md")]
pub mod replay {}

#[doc = include_str!("../docs/operations.md")]
pub mod operations {}

#[doc = include_str!("../docs/stores.md")]
pub mod stores {}

#[doc = include_str!("../docs/safety.md")]
pub mod safety {}

#[cfg(feature = "test-util")]
#[doc = include_str!("../docs/testing.md")]
pub mod testing {}
