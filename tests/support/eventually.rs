//! Bounded polling: wait for a condition on real processes without fixed sleeps.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often the condition is polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// Polls `f` every few milliseconds (with `tokio::time::sleep`) until it returns
/// `true`; panics naming `what` if that has not happened within `limit`.
///
/// `limit` is measured in real time, because `f` usually observes a real
/// `redis-server`. Should the tokio clock be paused (`start_paused`), its
/// sleeps return at once, so a short real pause is added to keep the polling
/// rate bounded.
///
/// `f` runs on the async task: keep it short (one Redis round trip is fine).
pub async fn eventually<F: FnMut() -> bool>(what: &str, limit: Duration, mut f: F) {
    let start = Instant::now();
    loop {
        if f() {
            return;
        }
        check_deadline(what, limit, start);
        async_pause().await;
    }
}

/// Like [`eventually`], with a condition that is itself async.
pub async fn eventually_async<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if f().await {
            return;
        }
        check_deadline(what, limit, start);
        async_pause().await;
    }
}

/// Blocking variant of [`eventually`] for plain `#[test]` functions.
pub fn eventually_blocking<F: FnMut() -> bool>(what: &str, limit: Duration, mut f: F) {
    let start = Instant::now();
    loop {
        if f() {
            return;
        }
        check_deadline(what, limit, start);
        std::thread::sleep(POLL_INTERVAL);
    }
}

fn check_deadline(what: &str, limit: Duration, start: Instant) {
    if start.elapsed() >= limit {
        panic!("timed out after {limit:?} waiting for: {what}");
    }
}

async fn async_pause() {
    let before = Instant::now();
    tokio::time::sleep(POLL_INTERVAL).await;
    if before.elapsed() < POLL_INTERVAL / 5 {
        // The tokio clock is paused and auto-advanced: do not spin.
        std::thread::sleep(Duration::from_millis(1));
    }
}
