//! Contended hand-off (issue 3): how long after a holder starts `release()` does the
//! next waiter's `acquire()` return?
//!
//! `cargo bench --bench handoff` spawns its own redis-server nodes on free loopback
//! ports (the `tests/support` helper) and prints a markdown table: 16 contenders on one
//! resource, 1,000 acquisitions per row, ~1 ms hold, strict hand-off (a task that just
//! released does not compete again until another task acquired), over 1 and 3 nodes,
//! for three placements of the contenders:
//!
//! - `1×16`: one process (one `Redlock`), 16 tasks: hand-off through the local FIFO;
//! - `2×8`: two processes (two `Redlock`s, own connections), 8 tasks each;
//! - `16×1`: sixteen processes of one task each: every hand-off crosses processes,
//!   so it rides on the release notification (pub/sub).
//!
//! Each row is measured with the engine's waiting `acquire` and with a plain polling
//! loop (`try_acquire`, then 50 ms sleep) in the same run. Redis commands per
//! acquisition come from `INFO commandstats` deltas summed over all nodes.
//!
//! Options: `-- --acquisitions N` (default 1000), `-- --quick` (200, for a smoke run).

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::RedisServer;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tower_redlock::{LockError, LockOptions, Redlock};

const CONTENDERS: usize = 16;
const HOLD: Duration = Duration::from_millis(1);
const POLL_EVERY: Duration = Duration::from_millis(50);
const PLACEMENTS: [usize; 3] = [1, 2, 16];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// `acquire(resource, timeout)`: local FIFO, wake-up on release, fallback backoff.
    WakeUp,
    /// `try_acquire` in a loop with a fixed 50 ms sleep.
    Polling,
}

impl Waiting {
    fn name(self) -> &'static str {
        match self {
            Waiting::WakeUp => "acquire (wake-up)",
            Waiting::Polling => "poll: try_acquire + 50 ms",
        }
    }
}

struct Row {
    nodes: usize,
    lockers: usize,
    waiting: Waiting,
    acquisitions: usize,
    /// Hand-off latencies, ascending.
    handoffs: Vec<Duration>,
    commands: u64,
    elapsed: Duration,
}

#[derive(Default)]
struct Shared {
    count: usize,
    last_release: Option<Instant>,
    handoffs: Vec<Duration>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let acquisitions = if args.iter().any(|a| a == "--quick") {
        200
    } else {
        args.iter()
            .position(|a| a == "--acquisitions")
            .and_then(|i| args.get(i + 1))
            .map_or(1000, |n| n.parse().expect("--acquisitions N"))
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(acquisitions));
}

async fn run(acquisitions: usize) {
    let mut rows = Vec::new();
    let mut rounds = Vec::new();
    for nodes in [1, 3] {
        let servers = RedisServer::start_many(nodes);
        rounds.push((nodes, two_rounds(&servers).await));
        for (i, lockers) in PLACEMENTS.into_iter().enumerate() {
            for waiting in [Waiting::WakeUp, Waiting::Polling] {
                let resource = format!("handoff:{i}:{}", waiting as u8);
                let row = scenario(&servers, lockers, waiting, &resource, acquisitions).await;
                eprintln!(
                    "{} node(s) {}×{} {}: p50 {:?}",
                    row.nodes,
                    row.lockers,
                    CONTENDERS / row.lockers,
                    row.waiting.name(),
                    percentile(&row.handoffs, 50.0)
                );
                rows.push(row);
            }
        }
    }
    print_table(&rows, &rounds);
}

/// One row: fresh lockers (own connections), warmed up, then `acquisitions` strict
/// hand-offs among 16 tasks spread over `lockers` lockers.
async fn scenario(
    servers: &[RedisServer],
    lockers: usize,
    waiting: Waiting,
    resource: &str,
    acquisitions: usize,
) -> Row {
    // A generous per-node timeout: on a shared machine a node may stall for more than the
    // default 50 ms, which would turn into `Unavailable` rather than into latency.
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .node_timeout(Duration::from_millis(500));
    let lockers: Vec<Redlock> = (0..lockers)
        .map(|_| Redlock::from_urls(servers.iter().map(|s| s.url()), options.clone()).unwrap())
        .collect();
    for locker in &lockers {
        // Connections up and scripts loaded before anything is measured.
        let lease = locker
            .try_acquire(format!("{resource}:warm"))
            .await
            .unwrap();
        lease.release().await;
    }
    for s in servers {
        s.reset_stats();
    }

    let shared = Arc::new(Mutex::new(Shared::default()));
    let (acquired_tx, acquired_rx) = watch::channel(0usize);
    let acquired_tx = Arc::new(acquired_tx);
    let done = Arc::new(Notify::new());
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for task in 0..CONTENDERS {
        let locker = lockers[task % lockers.len()].clone();
        let (shared, done, resource) = (shared.clone(), done.clone(), resource.to_owned());
        let (acquired_tx, mut acquired_rx) = (acquired_tx.clone(), acquired_rx.clone());
        tasks.spawn(async move {
            loop {
                let lease = loop {
                    let attempt = match waiting {
                        Waiting::WakeUp => {
                            locker
                                .acquire(resource.as_str(), Duration::from_secs(600))
                                .await
                        }
                        Waiting::Polling => locker.try_acquire(resource.as_str()).await,
                    };
                    match attempt {
                        Ok(lease) => break lease,
                        Err(LockError::Held { .. }) => tokio::time::sleep(POLL_EVERY).await,
                        Err(e) => {
                            // A stalled node (shared machine): report it, go on.
                            eprintln!("  {e}");
                            tokio::time::sleep(POLL_EVERY).await;
                        }
                    }
                };
                let acquired_at = Instant::now();
                let mine = {
                    let mut s = shared.lock().unwrap();
                    if s.count < acquisitions {
                        s.count += 1;
                        if let Some(released) = s.last_release.take() {
                            s.handoffs.push(acquired_at - released);
                        }
                        acquired_tx.send_replace(s.count);
                        Some(s.count)
                    } else {
                        None
                    }
                };
                let Some(mine) = mine else {
                    lease.release().await; // past the target, while the row ends
                    return;
                };
                tokio::time::sleep(HOLD).await; // the critical section
                shared.lock().unwrap().last_release = Some(Instant::now());
                lease.release().await;
                if mine == acquisitions {
                    done.notify_one();
                    return;
                }
                // Strict hand-off: compete again only once another task acquired.
                let _ = acquired_rx.wait_for(|count| *count > mine).await;
            }
        });
    }
    done.notified().await;
    let elapsed = started.elapsed();
    let mut by_command = std::collections::BTreeMap::<String, u64>::new();
    for (name, calls) in servers.iter().flat_map(|s| s.info_commandstats()) {
        if !matches!(name.as_str(), "info" | "config|resetstat") {
            *by_command.entry(name).or_default() += calls;
        }
    }
    let commands = by_command.values().sum();
    eprintln!("  commands: {by_command:?}");
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}

    let mut handoffs = std::mem::take(&mut shared.lock().unwrap().handoffs);
    handoffs.sort();
    Row {
        nodes: servers.len(),
        lockers: lockers.len(),
        waiting,
        acquisitions,
        handoffs,
        commands,
        elapsed,
    }
}

/// The floor of a hand-off: one release round plus one acquire round, uncontended
/// (medians of 1,000 each, over the same nodes, on fresh keys).
async fn two_rounds(servers: &[RedisServer]) -> (Duration, Duration, Duration) {
    let locker = Redlock::connect(
        servers.iter().map(|s| s.url()),
        LockOptions::default().ttl(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let mut acquires = Vec::with_capacity(1000);
    let mut releases = Vec::with_capacity(1000);
    for i in 0..1100 {
        let start = Instant::now();
        let lease = locker.try_acquire(format!("rounds:{i}")).await.unwrap();
        let acquired = Instant::now();
        lease.release().await;
        if i >= 100 {
            // The first hundred warm up connections and scripts.
            acquires.push(acquired - start);
            releases.push(acquired.elapsed());
        }
    }
    acquires.sort();
    releases.sort();
    let (acquire, release) = (percentile(&acquires, 50.0), percentile(&releases, 50.0));
    (acquire, release, acquire + release)
}

/// Nearest-rank percentile of an ascending slice.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn print_table(rows: &[Row], rounds: &[(usize, (Duration, Duration, Duration))]) {
    println!();
    println!("| nodes | uncontended acquire p50 (ms) | release p50 (ms) | sum: two rounds (ms) |");
    println!("|---|---|---|---|");
    for (nodes, (acquire, release, both)) in rounds {
        println!(
            "| {nodes} | {} | {} | {} |",
            ms(*acquire),
            ms(*release),
            ms(*both)
        );
    }
    println!();
    println!(
        "| nodes | processes × tasks | waiting | acquisitions | hand-off p50 (ms) | hand-off p99 (ms) | p50 / two rounds | polling p50 / wake-up p50 | Redis commands per acquisition | acquisitions/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let rtt = rounds
            .iter()
            .find(|(n, _)| *n == row.nodes)
            .map_or(Duration::ZERO, |(_, (_, _, both))| *both);
        let p50 = percentile(&row.handoffs, 50.0);
        let p99 = percentile(&row.handoffs, 99.0);
        let speedup = match row.waiting {
            Waiting::WakeUp => rows
                .iter()
                .find(|r| {
                    r.nodes == row.nodes
                        && r.lockers == row.lockers
                        && r.waiting == Waiting::Polling
                })
                .map_or("".into(), |polling| {
                    let polling = percentile(&polling.handoffs, 50.0);
                    format!("{:.0}×", polling.as_secs_f64() / p50.as_secs_f64())
                }),
            Waiting::Polling => String::new(),
        };
        println!(
            "| {} | {}×{} | {} | {} | {} | {} | {:.1}× | {} | {:.1} | {:.0} |",
            row.nodes,
            row.lockers,
            CONTENDERS / row.lockers,
            row.waiting.name(),
            row.acquisitions,
            ms(p50),
            ms(p99),
            p50.as_secs_f64() / rtt.as_secs_f64(),
            speedup,
            row.commands as f64 / row.acquisitions as f64,
            row.acquisitions as f64 / row.elapsed.as_secs_f64(),
        );
    }
}
