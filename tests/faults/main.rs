//! Fault injection (issue 7): mutual exclusion and fencing under node crashes, pauses,
//! restarts, slow and partitioned networks, aborted holders and server errors.
//!
//! Every scenario runs against real `redis-server` processes on 127.0.0.1 (spawned by
//! `tests/support`), often behind the test proxy (`tests/support/proxy.rs`), with several
//! `Redlock` instances standing in for several application instances. Every critical
//! section is recorded in a [`History`] whose fenced storage accepts a write only with
//! a newer fencing token; the checker fails on two overlapping critical sections whose
//! writes were both accepted, and on tokens that do not increase. Each scenario stops by
//! itself (cycle targets, every wait bounded) and prints a summary line (`--nocapture`).
//!
//! - `SOAK=1` multiplies cycle counts, rounds and bounds by 20.
//! - `BROKEN=1` swaps the paused holder's nodes in `s06_paused_holder_is_fenced` for a
//!   node that releases by plain `DEL` (no owner check), and gives the two routes of
//!   `s07_http_duplicate_requests_under_faults` one lock each (`Scope::Route`) although
//!   both change the same order: the checker must then fail. In the persistence
//!   scenarios (s10–s12) it restores today's fence rule
//!   (`LockOptions::unsafe_fence_seed_only_when_missing`: a counter seeded from the
//!   clock only when missing, so one that comes back behind is trusted): tokens then
//!   repeat and the checker must fail.
//!   s15–s17 (PostgreSQL, feature `postgres`): see their modules (`postgres`, `app_killed`).
//!
//! Scenarios 10–12 bring nodes back with *older* state under contention: three RDB
//! nodes restored from stale snapshots one at a time (s10), one AOF `everysec` node that
//! loses the tail of its log in a crash (s11), and a Sentinel failover to a replica that
//! missed the latest writes (s12, needs `redis-server --sentinel`). Each asserts
//! increasing tokens; s10 and s12 also assert exclusion (restarts delayed by a ttl,
//! failover slower than the ttl), s11 does not (see [`History::without_exclusion`]).
//!
//! ```text
//! cargo test --all-features --test faults -- --nocapture              # everything
//! cargo test --all-features --test faults s1 -- --nocapture           # s10, s11, s12
//! BROKEN=1 cargo test --all-features --test faults s10 -- --nocapture # must FAIL
//! ```
//!
//! Scenarios 7 and 8c are at the HTTP level (feature `axum`): duplicate requests through
//! two `LockLayer` routers while nodes fail, and clients that go away mid-request over
//! real TCP connections to `axum::serve`.
//!
//! See FAULTS.md for what each scenario proves and the figures of the last run.
//!
//! This file holds the knobs and the helpers every scenario shares (lockers and nodes,
//! the contending load, the end-of-scenario checks); each scenario group is a module
//! that takes them with `use super::*`, the HTTP ones over the `web` module.

#[cfg(feature = "axum")]
#[path = "../support/http_client.rs"]
mod http_client;
#[path = "../support/mod.rs"]
mod support;

#[cfg(all(feature = "axum", feature = "postgres"))]
mod app_killed;
mod cancellation;
mod contention;
mod crashes;
mod modes;
mod network;
#[cfg(feature = "axum")]
mod over_http;
mod paused_holder;
mod persistence;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "axum")]
mod records;
mod server_errors;
mod tools;
#[cfg(feature = "axum")]
mod web;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::cluster::SentinelGroup;
use support::history::{History, Summary};
use support::node_calls::Forwarding;
use support::proxy::{Latency, Proxy};
use support::{AppendFsync, RedisServer};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_redlock::node::HANDOFF_TTL;
use tower_redlock::{
    node::Node, Lease, LockError, LockOptions, LostCause, NodeError, RedisNode, Redlock,
    ReleaseOutcome, Resource,
};

// ---------------------------------------------------------------------------------------
// Knobs
// ---------------------------------------------------------------------------------------

/// Fault scenarios are sensitive to CPU starvation: run them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PREFIX: &str = "redlock:";

/// Eight hot resources: contention without a single hot spot.
const HOT8: [&str; 8] = [
    "hot:a", "hot:b", "hot:c", "hot:d", "hot:e", "hot:f", "hot:g", "hot:h",
];

/// 20 with `SOAK=1`, else 1.
fn soak() -> u32 {
    match std::env::var("SOAK") {
        Ok(v) if !v.is_empty() && v != "0" => 20,
        _ => 1,
    }
}

/// A cycle count or a number of rounds, multiplied in soak mode.
fn n(count: u64) -> u64 {
    count * u64::from(soak())
}

/// An upper bound on a phase, multiplied in soak mode. Bounds only stop a hung
/// scenario; they are far above the normal duration.
fn bound(secs: u64) -> Duration {
    Duration::from_secs(secs) * soak()
}

/// `FAULTS_VERBOSE=1` prints the duration of every phase.
fn verbose() -> bool {
    matches!(std::env::var("FAULTS_VERBOSE").as_deref(), Ok("1"))
}

fn broken() -> bool {
    matches!(std::env::var("BROKEN").as_deref(), Ok("1"))
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

// ---------------------------------------------------------------------------------------
// Lockers and nodes
// ---------------------------------------------------------------------------------------

fn urls(servers: &[RedisServer]) -> Vec<String> {
    servers.iter().map(RedisServer::url).collect()
}

fn proxy_urls(proxies: &[Proxy]) -> Vec<String> {
    proxies.iter().map(Proxy::url).collect()
}

/// `count` independent lockers (each with its own connections), like app instances.
fn lockers(count: usize, urls: &[String], options: &LockOptions) -> Vec<Redlock> {
    (0..count)
        .map(|_| Redlock::from_urls(urls, options.clone()).expect("locker"))
        .collect()
}

/// The deliberately broken node of `BROKEN=1`: a real node whose release ignores the
/// owner and deletes the lock key with a plain `DEL` — the classic bug of a home-made
/// lock. It exists only here; the library is untouched.
async fn del_on_release(url: &str) -> Forwarding<RedisNode> {
    let client = redis::Client::open(url).expect("url");
    let conn = client
        .get_connection_manager()
        .await
        .expect("DEL connection");
    Forwarding::new(RedisNode::open(url).expect("node")).release_with(move |hold| {
        let mut conn = conn.clone();
        let key = hold.keys[0].lock.clone();
        Box::pin(async move {
            let deleted: i64 = redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .map_err(|e| NodeError::Connection(e.to_string().into()))?;
            Ok(deleted == 1)
        })
    })
}

/// The locker of the holder that gets paused in s06: correct, or with `BROKEN=1` over
/// [`del_on_release`] nodes.
async fn paused_holder_locker(urls: &[String], options: &LockOptions) -> Redlock {
    if broken() {
        eprintln!("BROKEN=1: the paused holder releases by plain DEL (no owner check)");
        let mut nodes: Vec<Arc<dyn Node>> = Vec::new();
        for url in urls {
            nodes.push(Arc::new(del_on_release(url).await));
        }
        Redlock::from_nodes(nodes, options.clone()).expect("broken locker")
    } else {
        Redlock::connect(urls, options.clone())
            .await
            .expect("locker")
    }
}

// ---------------------------------------------------------------------------------------
// The load: workers that contend for a few hot resources and record every section
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
struct Load {
    resources: Arc<Vec<String>>,
    /// Acquire deadline of one attempt.
    wait: Duration,
    /// A careful holder writes only with more validity left than this.
    margin: Duration,
    /// Pause after a "no quorum" answer, so an outage does not become a busy loop.
    unavailable_pause: Duration,
    /// While set, every attempt must be refused with `Unavailable` (see s03).
    outage: Arc<AtomicBool>,
    /// One error message of each kind, for the report.
    samples: Arc<Mutex<Vec<String>>>,
}

impl Load {
    fn new(resources: &[&str], ttl: Duration) -> Load {
        Load {
            resources: Arc::new(resources.iter().map(|r| (*r).to_owned()).collect()),
            wait: Duration::from_secs(5),
            margin: ttl / 10,
            unavailable_pause: ms(5),
            outage: Arc::new(AtomicBool::new(false)),
            samples: Arc::default(),
        }
    }

    fn sample(&self, error: &LockError) {
        let text = error.to_string();
        let kind = text
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if samples.len() < 8 && !samples.iter().any(|s| s.starts_with(&kind)) {
            samples.push(text);
        }
    }
}

/// Running workers; stopped (and awaited) with [`Workers::stop`].
struct Workers {
    stop: watch::Sender<bool>,
    handles: Vec<JoinHandle<()>>,
}

impl Workers {
    fn spawn(load: &Load, lockers: &[Redlock], per_locker: usize, history: &History) -> Workers {
        let (stop, _) = watch::channel(false);
        let mut handles = Vec::new();
        for (l, locker) in lockers.iter().enumerate() {
            for w in 0..per_locker {
                handles.push(tokio::spawn(worker(
                    load.clone(),
                    locker.clone(),
                    history.clone(),
                    format!("locker {l} worker {w}"),
                    stop.subscribe(),
                )));
            }
        }
        Workers { stop, handles }
    }

    /// Lets every worker finish its current attempt, then joins them (bounded).
    async fn stop(self) {
        self.stop.send_replace(true);
        for handle in self.handles {
            match tokio::time::timeout(bound(20), handle).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("worker failed: {e}"),
                Err(_) => panic!("worker did not stop within {:?}", bound(20)),
            }
        }
    }
}

async fn worker(
    load: Load,
    locker: Redlock,
    history: History,
    label: String,
    stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let resource = &load.resources[rand::random_range(0..load.resources.len())];
        let outage_before = load.outage.load(Ordering::SeqCst);
        let result = locker.acquire(resource.as_str(), load.wait).await;
        // Strict only for attempts that ran entirely inside the outage.
        let in_outage = outage_before && load.outage.load(Ordering::SeqCst);
        match result {
            Ok(lease) => {
                if in_outage {
                    history.fail(format!(
                        "{label}: lease on `{resource}` (token {}) granted while a majority of the nodes was down",
                        lease.fencing_token()
                    ));
                }
                let mut section =
                    history.begin(resource.clone(), lease.fencing_token().get(), label.clone());
                for _ in 0..rand::random_range(0..3u32) {
                    tokio::task::yield_now().await;
                }
                if lease.remaining() > load.margin {
                    section.write();
                } else {
                    history.skipped_write();
                }
                tokio::task::yield_now().await;
                section.end(lease.lost_cause().is_some());
                lease.release().await;
            }
            Err(e @ LockError::Unavailable { .. }) => {
                load.sample(&e);
                history.unavailable();
                tokio::time::sleep(load.unavailable_pause).await;
            }
            Err(e) => {
                load.sample(&e);
                if in_outage {
                    history.fail(format!(
                        "{label}: attempt during the outage answered `{e}` instead of Unavailable"
                    ));
                }
                if e.is_contention() {
                    history.contended();
                } else {
                    history.other_error();
                }
            }
        }
    }
}

/// A holder that keeps its lease for `hold` (long enough to need renewals), then writes
/// and releases; loops until stopped. Its lease must survive a minority failure.
fn spawn_long_holders(
    lockers: &[Redlock],
    hold: Duration,
    history: &History,
    stop: &watch::Sender<bool>,
) -> Vec<JoinHandle<()>> {
    lockers
        .iter()
        .enumerate()
        .map(|(i, locker)| {
            let locker = locker.clone();
            let history = history.clone();
            let stop = stop.subscribe();
            tokio::spawn(async move {
                let resource = format!("long:{i}");
                while !*stop.borrow() {
                    let lease = match locker
                        .acquire(resource.as_str(), Duration::from_secs(5))
                        .await
                    {
                        Ok(lease) => lease,
                        Err(_) => {
                            history.other_error();
                            continue;
                        }
                    };
                    let mut section = history.begin(
                        resource.clone(),
                        lease.fencing_token().get(),
                        format!("long holder {i}"),
                    );
                    // The work outlasts the ttl: only renewals keep the lease.
                    tokio::select! {
                        _ = lease.lost() => {}
                        () = tokio::time::sleep(hold) => {}
                    }
                    if lease.is_held() {
                        section.write();
                    } else {
                        history.skipped_write();
                    }
                    section.end(lease.lost_cause().is_some());
                    lease.release().await;
                }
            })
        })
        .collect()
}

async fn join_all(handles: Vec<JoinHandle<()>>) {
    for handle in handles {
        match tokio::time::timeout(bound(20), handle).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("task failed: {e}"),
            Err(_) => panic!("task did not stop within {:?}", bound(20)),
        }
    }
}

/// Waits until `more` critical sections completed; panics naming the phase after `limit`.
async fn progress(history: &History, more: u64, limit: Duration, phase: &str) {
    let target = history.cycles() + more;
    let started = Instant::now();
    let reached = tokio::time::timeout(limit, history.cycles_reached(target)).await;
    if verbose() {
        println!(
            "[faults]   phase `{phase}`: {more} sections in {:.2}s (unavailable so far: {})",
            started.elapsed().as_secs_f64(),
            history.unavailable_count()
        );
    }
    if reached.is_err() {
        panic!(
            "no progress during `{phase}`: {} of {target} critical sections after {limit:?}",
            history.cycles()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Observers and the end-of-scenario checks
// ---------------------------------------------------------------------------------------

/// The lock key of the resource `resource` spells (as `try_acquire` takes it).
fn key_of(resource: &str) -> String {
    format!("{PREFIX}{{{}}}", Resource::from(resource).as_str())
}

fn fence_of(resource: &str) -> String {
    format!("{}:fence", key_of(resource))
}

/// Lock keys (not fence counters) on one server.
fn lock_keys(server: &RedisServer) -> Vec<String> {
    server
        .keys(&format!("{PREFIX}*"))
        .into_iter()
        .filter(|k| !k.ends_with(":fence"))
        .collect()
}

/// Nothing held afterwards: no lock key on any node, no local holder or waiter in any
/// locker, within `limit` (callers pick a bound below the ttl where that matters).
async fn assert_nothing_held(servers: &[RedisServer], lockers: &[Redlock], limit: Duration) {
    let servers: Vec<&RedisServer> = servers.iter().collect();
    assert_nothing_held_on(&servers, lockers, limit).await;
}

/// [`assert_nothing_held`] on the servers still serving (e.g. not a killed old master).
async fn assert_nothing_held_on(servers: &[&RedisServer], lockers: &[Redlock], limit: Duration) {
    let limits = Limits {
        keys: limit,
        reservations: limit,
        queues: limit,
    };
    assert_nothing_held_within(servers, lockers, limits).await;
}

/// [`assert_nothing_held_on`] where a node came back with an older copy of its data (a
/// restored snapshot, a lagging replica promoted): lock keys and local state must still
/// go within `limit`, but a wait queue may keep entries until its own ttl (10 s, the
/// crate's `QUEUE_TTL`). The older copy lists waiters that have since been served or
/// have left, and nobody else removes them: a next hand-off skips such an entry when
/// nobody listens for it, and without one the queue expires. While the waiter's
/// subscription still lingers (2 s after it stopped waiting) a release hands it the key:
/// a reservation (`~id:ticket`) that nobody takes and that expires after the hand-off's
/// ttl (`HANDOFF_TTL`, 1 s), so reservations alone may stay that much longer.
async fn assert_nothing_held_after_restore(
    servers: &[&RedisServer],
    lockers: &[Redlock],
    limit: Duration,
) {
    assert_nothing_held_within(
        servers,
        lockers,
        Limits {
            keys: limit,
            reservations: HANDOFF_TTL + limit,
            queues: Duration::from_secs(10) + limit,
        },
    )
    .await;
}

/// How long [`assert_nothing_held_within`] waits: for anything (`keys`), for lock keys
/// that are reservations for a waiter, and wait queues (`reservations`), for wait-queue
/// keys alone (`queues`).
struct Limits {
    keys: Duration,
    reservations: Duration,
    queues: Duration,
}

/// No lock key on `servers` and no local holder or waiter in `lockers` within the
/// `limits`. On failure it names each key left with its value and ttl.
async fn assert_nothing_held_within(servers: &[&RedisServer], lockers: &[Redlock], limits: Limits) {
    let start = Instant::now();
    loop {
        let keys: Vec<(u16, Vec<String>)> = servers
            .iter()
            .map(|s| (s.port(), lock_keys(s)))
            .filter(|(_, k)| !k.is_empty())
            .collect();
        let local: Vec<usize> = lockers.iter().map(Redlock::local_resources).collect();
        let no_local = local.iter().all(|&n| n == 0);
        if keys.is_empty() && no_local {
            return;
        }
        let left: Vec<(u16, String, Option<String>, i64)> = keys
            .iter()
            .flat_map(|(port, k)| {
                let server = servers.iter().find(|s| s.port() == *port).unwrap();
                k.iter()
                    .map(|key| {
                        let value = (!key.ends_with(":queue"))
                            .then(|| server.get(key))
                            .flatten();
                        (*port, key.clone(), value, server.pttl(key))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let queues_only = left.iter().all(|(_, k, _, _)| k.ends_with(":queue"));
        let reserved_only = left.iter().all(|(_, k, value, _)| {
            k.ends_with(":queue") || value.as_deref().is_some_and(|v| v.starts_with('~'))
        });
        let bound = match (no_local, queues_only, reserved_only) {
            (true, true, _) => limits.queues,
            (true, false, true) => limits.reservations,
            _ => limits.keys,
        };
        assert!(
            start.elapsed() < bound,
            "still held after {bound:?}: keys (port, key, value, pttl ms) {left:?}, local resources per locker {local:?}"
        );
        tokio::time::sleep(support::POLL_INTERVAL).await;
    }
}

/// Whether a lock key's value belongs to the lease whose owner value is `owner`: each
/// node stores its own value (the lease's random part, then the node's index).
fn held_by(value: Option<String>, owner: &str) -> bool {
    value
        .is_some_and(|v| v.len() == owner.len() && v[..owner.len() - 2] == owner[..owner.len() - 2])
}

/// Checks the history (panics on a violation) and adds the lockers' figures.
fn finish(history: &History, lockers: &[Redlock]) -> Summary {
    let summary = history.check();
    let metrics = lockers.iter().map(Redlock::metrics);
    let (mut acquired, mut refused, mut lost, mut renewals, mut wakeups) = (0, 0, 0, 0, 0);
    for m in metrics {
        acquired += m.acquired;
        refused += m.contended + m.unavailable + m.too_slow;
        lost += m.lost;
        renewals += m.renewals;
        wakeups += m.wakeups;
    }
    summary
        .note("acquired", acquired)
        .note("failed_rounds", refused)
        .note("lost(metrics)", lost)
        .note("renewals", renewals)
        .note("wakeups", wakeups)
}

/// Prints the summary line of a scenario (visible with `--nocapture`).
fn report(summary: Summary) -> Summary {
    println!("{summary}");
    summary
}

fn print_samples(load: &Load) {
    for sample in load
        .samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        println!("[faults]   sample error: {sample}");
    }
}

/// `acquire` that rides out "no answer in time" on a loaded machine: retries
/// `Unavailable` and `ValidityExpired` until `limit`; any other error is a failure.
async fn acquire_patiently(locker: &Redlock, resource: &str, limit: Duration) -> Lease {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match locker.acquire(resource, left).await {
            Ok(lease) => return lease,
            Err(e @ (LockError::Unavailable { .. } | LockError::ValidityExpired { .. }))
                if Instant::now() < deadline =>
            {
                eprintln!("[faults]   retrying `{resource}` after: {e}");
                tokio::time::sleep(ms(10)).await;
            }
            Err(e) => panic!("acquiring `{resource}`: {e}"),
        }
    }
}

/// Repeats `attempt` while its answer is `Unavailable` only because nodes did not answer
/// in time (a loaded machine), so that the answer observed is the servers' own.
async fn answered<T, F, Fut>(mut attempt: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, LockError>>,
{
    for _ in 0..20 {
        match attempt().await {
            Err(LockError::Unavailable { failures, .. })
                if failures
                    .iter()
                    .all(|f| matches!(f.error, NodeError::Timeout(_))) =>
            {
                tokio::time::sleep(ms(10)).await;
            }
            other => return other,
        }
    }
    attempt().await
}

/// The options of the persistence scenarios (s10–s12): as given, or with `BROKEN=1`
/// today's rule (a node's fence counter seeded from the clock only when it is
/// missing, so a counter that comes back *behind* is trusted).
fn fence_rule(options: LockOptions) -> LockOptions {
    if broken() {
        eprintln!("BROKEN=1: fence counters seeded from the clock only when missing");
        options.unsafe_fence_seed_only_when_missing()
    } else {
        options
    }
}

/// A fence counter as a server stores it (`None` when missing).
fn counter(server: &RedisServer, resource: &str) -> Option<u64> {
    server
        .get(&fence_of(resource))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("fence counter {v:?}")))
}

/// Runs a blocking helper call (kill, restart, pause, resume) from the test body.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}
