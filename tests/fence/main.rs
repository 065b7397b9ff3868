//! Guarded writes (`tower_redlock::fence`) against real servers: PostgreSQL (a database
//! of its own per test, `support::postgres`) and Redis (`redis-server`s spawned by
//! `support`). Kleppmann's paused holder end to end, and many transactions advancing
//! one fence at once.

#[path = "../support/mod.rs"]
mod support;

mod concurrency;
#[cfg(feature = "axum")]
mod handlers;
mod kleppmann;
mod modes;
mod postgres;
mod redis;

use tower_redlock::{FencingToken, Resource};

/// A resource with a token, the smallest thing a guarded write takes.
pub fn held(resource: &str, token: u64) -> (Resource, FencingToken) {
    (Resource::from(resource), FencingToken::new(token))
}
