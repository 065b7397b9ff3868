//! Many held leases (issue 6): 10,000 leases held at once with the watchdog on (ttl
//! 3 s, so every lease is renewed about once a second) for 30 s.
//!
//! `cargo bench --bench scale` spawns its own redis-server nodes on free loopback
//! ports (the `tests/support` helper) and prints markdown tables. Per node count and
//! repetition, with a fresh locker (tokio multi-thread runtime):
//!
//! 1. `connected_clients` of every node before the locker exists (the observer's own
//!    connection included), then a warm-up acquire + release;
//! 2. `leases` distinct resources acquired with `try_acquire` by 64 tasks;
//! 3. the hold: `secs` seconds during which a sampler walks all leases every 100 ms and
//!    keeps the smallest `remaining()` seen (and any lease not `is_held()`); at the end
//!    every lease must be held with no `lost_cause()`;
//! 4. during the hold: this process's CPU (`/proc/self/stat` utime + stime, % of one
//!    core; the sampler's own time is reported apart), the servers' CPU, Redis commands
//!    per second (`INFO commandstats` delta over the hold), renewals from the locker's
//!    metrics, and `connected_clients` after the acquisitions and at the end;
//! 5. every lease released; the locker must hold no resource afterwards.
//!
//! The 10,000 acquisitions take a fraction of a second, so the leases renew in
//! lockstep: every second, 10,000 extend calls per node within that fraction of a
//! second. That is the worst case for the watchdog; `SCALE_SPREAD_MS=1000` spreads
//! the acquisitions (and so the renewals) over a second instead.
//!
//! Environment: `SCALE_SECS` (hold, default 30), `SCALE_LEASES` (default 10000),
//! `SCALE_NODES` (default `1,3`), `SCALE_REPS` (default 3), `SCALE_SPREAD_MS` (default
//! 0), `SCALE_NODE_TIMEOUT_MS` (default: the crate's 200 ms), `SCALE_LOG` (a tracing
//! filter, e.g. `tower_redlock::lock::lease=debug` to see failed renewal rounds). The
//! tables show every repetition and the medians.

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::RedisServer;
use tower_redlock::{Lease, LockOptions, Redlock};

use common::{median, thousands};

const TTL: Duration = Duration::from_secs(3);
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
const ACQUIRE_TASKS: usize = 64;

struct Config {
    secs: u64,
    leases: usize,
    nodes: Vec<usize>,
    reps: usize,
    /// `SCALE_SPREAD_MS`: acquisition `i` starts no earlier than `spread × i / leases`
    /// after the first (default 0: as fast as 64 tasks go).
    spread: Duration,
    /// `SCALE_NODE_TIMEOUT_MS`; the crate's default (200 ms) when unset.
    node_timeout_ms: Option<u64>,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().map_or(default, |v| {
        v.parse().unwrap_or_else(|_| panic!("{name}={v:?}"))
    })
}

/// One repetition.
struct Row {
    nodes: usize,
    rep: usize,
    load_before: String,
    load_after: String,
    acquire_secs: f64,
    clients_before: Vec<u64>,
    clients_held: Vec<u64>,
    clients_end: Vec<u64>,
    clients_released: Vec<u64>,
    hold: Duration,
    min_remaining: Duration,
    /// The sampler's worst lateness against its 100 ms ticks: a stall of this process.
    late: Duration,
    /// Leases seen not held by the sampler, at any sample.
    dropouts: usize,
    held_at_end: usize,
    lost_at_end: usize,
    renewals: u64,
    renewal_failures: u64,
    lost_metric: u64,
    cpu_pct: f64,
    sampler_pct: f64,
    redis_cpu_pct: f64,
    commands_per_sec: f64,
    evalsha_per_sec: f64,
    left_after_release: usize,
}

fn main() {
    let config = Config {
        secs: env("SCALE_SECS", 30),
        leases: env("SCALE_LEASES", 10_000),
        nodes: std::env::var("SCALE_NODES")
            .unwrap_or_else(|_| "1,3".into())
            .split(',')
            .map(|n| n.trim().parse().expect("SCALE_NODES"))
            .collect(),
        reps: env("SCALE_REPS", 3),
        spread: Duration::from_millis(env("SCALE_SPREAD_MS", 0)),
        node_timeout_ms: std::env::var("SCALE_NODE_TIMEOUT_MS")
            .ok()
            .map(|v| v.parse().expect("SCALE_NODE_TIMEOUT_MS")),
    };
    if std::env::var("SCALE_LOG").is_ok() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_env("SCALE_LOG"))
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = Vec::new();
    for &nodes in &config.nodes {
        let servers = RedisServer::start_many(nodes);
        for rep in 0..config.reps {
            let row = runtime.block_on(hold(&servers, rep, &config));
            eprintln!(
                "{nodes} node(s) rep {}: min remaining {:?}, held {}/{}, lost {}, CPU {:.1}%, {:.0} commands/s (load {})",
                rep + 1,
                row.min_remaining,
                row.held_at_end,
                config.leases,
                row.lost_at_end,
                row.cpu_pct,
                row.commands_per_sec,
                row.load_after,
            );
            rows.push(row);
        }
    }
    print_tables(&rows, &config);
}

async fn hold(servers: &[RedisServer], rep: usize, config: &Config) -> Row {
    let load_before = common::loadavg();
    let clients_before: Vec<u64> = servers.iter().map(common::connected_clients).collect();
    let mut options = LockOptions::default().ttl(TTL);
    if let Some(ms) = config.node_timeout_ms {
        options = options.node_timeout(Duration::from_millis(ms));
    }
    let locker = Redlock::connect(servers.iter().map(|s| s.url()), options)
        .await
        .expect("locker");
    locker
        .try_acquire(format!("scale:{rep}:warm"))
        .await
        .expect("warm-up")
        .release()
        .await;

    // Acquire every lease, 64 at a time.
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let (total, spread) = (config.leases, config.spread);
    let workers: Vec<_> = (0..ACQUIRE_TASKS)
        .map(|_| {
            let (locker, next) = (locker.clone(), next.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return mine;
                    }
                    if !spread.is_zero() {
                        let at = started + spread.mul_f64(i as f64 / total as f64);
                        tokio::time::sleep_until(at.into()).await;
                    }
                    let lease = locker
                        .try_acquire(format!("scale:{rep}:{i}"))
                        .await
                        .expect("uncontended acquire");
                    mine.push(lease);
                }
            })
        })
        .collect();
    let mut leases: Vec<Lease> = Vec::with_capacity(total);
    for worker in workers {
        leases.extend(worker.await.expect("worker"));
    }
    let acquire_secs = started.elapsed().as_secs_f64();
    let clients_held: Vec<u64> = servers.iter().map(common::connected_clients).collect();

    // The hold.
    common::reset_stats(servers);
    let metrics0 = locker.metrics();
    let (cpu0, redis0) = (common::own_cpu(), common::servers_cpu(servers));
    let start = Instant::now();
    let end = start + Duration::from_secs(config.secs);
    let mut min_remaining = Duration::MAX;
    let mut dropouts = 0;
    let mut sampling = Duration::ZERO;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let mut late = Duration::ZERO;
    while Instant::now() < end {
        let due = tick.tick().await;
        let t = Instant::now();
        late = late.max(t.saturating_duration_since(due.into_std()));
        for lease in &leases {
            let remaining = lease.remaining();
            if remaining.is_zero() {
                dropouts += 1;
            }
            min_remaining = min_remaining.min(remaining);
        }
        sampling += t.elapsed();
    }
    let hold = start.elapsed();
    let cpu = common::own_cpu() - cpu0;
    let redis_cpu = common::servers_cpu(servers) - redis0;
    let by_command = common::by_command(servers);
    let metrics = locker.metrics();
    let held_at_end = leases.iter().filter(|l| l.is_held()).count();
    let lost_at_end = leases.iter().filter(|l| l.lost_cause().is_some()).count();
    let clients_end: Vec<u64> = servers.iter().map(common::connected_clients).collect();

    // Release everything, 64 at a time.
    let chunks: Vec<Vec<Lease>> = {
        let mut chunks: Vec<Vec<Lease>> = (0..ACQUIRE_TASKS).map(|_| Vec::new()).collect();
        for (i, lease) in leases.into_iter().enumerate() {
            chunks[i % ACQUIRE_TASKS].push(lease);
        }
        chunks
    };
    let releasers: Vec<_> = chunks
        .into_iter()
        .map(|chunk| {
            tokio::spawn(async move {
                for lease in chunk {
                    lease.release().await;
                }
            })
        })
        .collect();
    for releaser in releasers {
        releaser.await.expect("releaser");
    }
    let left_after_release = locker.local_resources();
    drop(locker);
    tokio::time::sleep(Duration::from_millis(200)).await; // connections close
    let clients_released: Vec<u64> = servers.iter().map(common::connected_clients).collect();

    let secs = hold.as_secs_f64();
    let commands: u64 = by_command.values().sum();
    Row {
        nodes: servers.len(),
        rep,
        load_before,
        load_after: common::loadavg(),
        acquire_secs,
        clients_before,
        clients_held,
        clients_end,
        clients_released,
        hold,
        min_remaining,
        late,
        dropouts,
        held_at_end,
        lost_at_end,
        renewals: metrics.renewals - metrics0.renewals,
        renewal_failures: metrics.renewal_failures - metrics0.renewal_failures,
        lost_metric: metrics.lost - metrics0.lost,
        cpu_pct: cpu.as_secs_f64() / secs * 100.0,
        sampler_pct: sampling.as_secs_f64() / secs * 100.0,
        redis_cpu_pct: redis_cpu.as_secs_f64() / secs * 100.0,
        commands_per_sec: commands as f64 / secs,
        evalsha_per_sec: by_command.get("evalsha").copied().unwrap_or(0) as f64 / secs,
        left_after_release,
    }
}

fn list(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join("/")
}

fn print_tables(rows: &[Row], config: &Config) {
    println!();
    println!(
        "{} leases, ttl {:?} (renewed every ~{:.2} s), hold {} s, acquisitions spread over {:?}, \
         node timeout {}, tokio multi-thread runtime; connected_clients per node (incl. the \
         observer's connection) as before/held/end/released.",
        thousands(config.leases as f64),
        TTL,
        (TTL.as_secs_f64() * 0.99 - 0.002) / 3.0,
        config.secs,
        config.spread,
        config
            .node_timeout_ms
            .map_or("200 ms (default)".to_owned(), |ms| format!("{ms} ms")),
    );
    println!();
    println!("| nodes | rep | load avg before → after | acquire 10k (s) | min remaining seen (ms) | worst sampler lateness (ms) | not held at a sample | held at end | lost at end | renewals | renewals / lease / s | renewal failures | client CPU (% of a core) | of which sampler (%) | Redis CPU (% of a core, all nodes) | Redis commands / s (all nodes) | EVALSHA / s (all nodes) | connected_clients | left after release |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} → {} | {:.2} | {:.0} | {:.1} | {} | {}/{} | {} ({} in metrics) | {} | {:.3} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} → {} → {} → {} | {} |",
            r.nodes,
            r.rep + 1,
            r.load_before,
            r.load_after,
            r.acquire_secs,
            r.min_remaining.as_secs_f64() * 1e3,
            r.late.as_secs_f64() * 1e3,
            r.dropouts,
            r.held_at_end,
            config.leases,
            r.lost_at_end,
            r.lost_metric,
            thousands(r.renewals as f64),
            r.renewals as f64 / config.leases as f64 / r.hold.as_secs_f64(),
            r.renewal_failures,
            r.cpu_pct,
            r.sampler_pct,
            r.redis_cpu_pct,
            thousands(r.commands_per_sec),
            thousands(r.evalsha_per_sec),
            list(&r.clients_before),
            list(&r.clients_held),
            list(&r.clients_end),
            list(&r.clients_released),
            r.left_after_release,
        );
    }
    println!();
    println!("| nodes | min remaining seen (ms, min over reps) | leases lost (all reps) | renewal failures (all reps) | client CPU (% of a core, median) | Redis commands / s (median) | Redis CPU (% of a core, median) | connected_clients held / before (max over reps) |");
    println!("|---|---|---|---|---|---|---|---|");
    for &nodes in &config.nodes {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.nodes == nodes).collect();
        let extra = rs
            .iter()
            .flat_map(|r| {
                r.clients_end
                    .iter()
                    .zip(&r.clients_before)
                    .map(|(end, before)| end.saturating_sub(*before))
            })
            .max()
            .unwrap_or(0);
        println!(
            "| {nodes} | {:.0} | {} | {} | {:.1} | {} | {:.1} | +{extra} per node |",
            rs.iter()
                .map(|r| r.min_remaining)
                .min()
                .unwrap_or_default()
                .as_secs_f64()
                * 1e3,
            rs.iter().map(|r| r.lost_at_end).sum::<usize>(),
            rs.iter().map(|r| r.renewal_failures).sum::<u64>(),
            median(rs.iter().map(|r| r.cpu_pct)),
            thousands(median(rs.iter().map(|r| r.commands_per_sec))),
            median(rs.iter().map(|r| r.redis_cpu_pct)),
        );
    }
}
