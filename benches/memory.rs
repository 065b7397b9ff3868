//! Memory (issue 6): bytes per held lease and per waiting acquire, counted by a global
//! allocator that wraps the system allocator and keeps the number of live bytes and
//! live allocations in atomics.
//!
//! `cargo bench --bench memory` spawns its own redis-server nodes on free loopback
//! ports (the `tests/support` helper) and prints a markdown table. For a `MemoryNode`,
//! 1 and 3 Redis nodes, with N = 10,000 (`-- --n N`):
//!
//! - **held lease**: N leases on distinct resources, each acquired with `try_acquire`
//!   and kept in a `Vec<Lease>` (its N × `size_of::<Lease>()` counted), with the
//!   watchdog on (the default; ttl 30 s, so no renewal runs during the measurement)
//!   and off;
//! - **waiting, same resource**: one lease held by this process, N spawned tasks each
//!   `acquire(resource, 10 min)` queued behind it (the task, its future and its place
//!   in the local queue; the `JoinHandle`s counted);
//! - **waiting, own resource**: N resources held by another locker (another process,
//!   as far as the nodes are concerned), N spawned tasks each waiting for one of them:
//!   every one is the head of its own local queue, subscribed to its release channel
//!   on every node and retrying on the fallback backoff (default `Backoff`: full
//!   jitter, capped at 500 ms). Measured 2 s after the last one started waiting, with
//!   the retry traffic of the following second (attempts per waiter and second, Redis
//!   commands per waiter and second).
//!
//! Each figure is (live bytes once settled − live bytes before) / N, taken after the
//! spawned work went quiet (200 ms) as the median of 5 readings 50 ms apart; "left
//! after" is the same difference once everything was released or cancelled (a leak
//! shows there; for a `MemoryNode`, whose store lives in this process, the fence
//! counters it keeps stay too). Redis memory is `INFO memory` `used_memory`, summed over
//! nodes, while held and after (the fence counters stay for `fence_ttl`, 7 days).
//! Repeated 3 times (`-- --reps N`); medians.
//!
//! Client work per acquisition (issue 16), in a second table: N `try_acquire` +
//! `release` cycles on distinct resources, one after the other (watchdog on), counting
//! allocator calls (`alloc` and `realloc`, whatever is freed again) and the tasks the
//! engine spawned ([`tower_redlock::metrics::tasks_spawned`]) per cycle; and the tokio
//! tasks alive per held lease (`num_alive_tasks`, held-lease rows, watchdog on).
//! `-- --cycles-only` runs that table alone.

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use support::RedisServer;
use tokio::task::JoinHandle;
use tower_redlock::{Lease, LockError, LockOptions, MemoryNode, Redlock};

use common::median;

/// The system allocator, counting live bytes and live allocations.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
static LIVE_ALLOCS: AtomicIsize = AtomicIsize::new(0);
/// Allocator calls that hand out memory (`alloc`, `alloc_zeroed`, `realloc`), ever.
static ALLOC_CALLS: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to `System` with the same arguments; the counters
// are only observed.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe {
            let p = System.alloc(layout);
            if !p.is_null() {
                LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
                LIVE_ALLOCS.fetch_add(1, Ordering::Relaxed);
                ALLOC_CALLS.fetch_add(1, Ordering::Relaxed);
            }
            p
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe {
            let p = System.alloc_zeroed(layout);
            if !p.is_null() {
                LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
                LIVE_ALLOCS.fetch_add(1, Ordering::Relaxed);
                ALLOC_CALLS.fetch_add(1, Ordering::Relaxed);
            }
            p
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe {
            System.dealloc(ptr, layout);
            LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
            LIVE_ALLOCS.fetch_sub(1, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        unsafe {
            let p = System.realloc(ptr, layout, new_size);
            if !p.is_null() {
                ALLOC_CALLS.fetch_add(1, Ordering::Relaxed);
                LIVE_BYTES.fetch_add(
                    new_size as isize - layout.size() as isize,
                    Ordering::Relaxed,
                );
            }
            p
        }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const TTL: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scenario {
    Held { watchdog: bool },
    WaitingSame,
    WaitingOwn,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Held { watchdog: true } => "held lease, watchdog on",
            Scenario::Held { watchdog: false } => "held lease, watchdog off",
            Scenario::WaitingSame => {
                "waiting acquire, same resource (queued behind a local holder)"
            }
            Scenario::WaitingOwn => {
                "waiting acquire, own resource (held elsewhere; head waiter, subscribed)"
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    Memory,
    Redis(usize),
}

impl Backend {
    fn name(self) -> String {
        match self {
            Backend::Memory => "MemoryNode".into(),
            Backend::Redis(1) => "Redis, 1 node".into(),
            Backend::Redis(n) => format!("Redis, {n} nodes"),
        }
    }
}

fn servers_of(backend: Backend) -> usize {
    match backend {
        Backend::Memory => 0,
        Backend::Redis(n) => n,
    }
}

/// Live bytes and allocations right now.
fn live() -> (isize, isize) {
    (
        LIVE_BYTES.load(Ordering::Relaxed),
        LIVE_ALLOCS.load(Ordering::Relaxed),
    )
}

/// Waits for spawned work to go quiet, then the median of 5 readings 50 ms apart.
async fn settled() -> (isize, isize) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut bytes = Vec::new();
    let mut allocs = Vec::new();
    for _ in 0..5 {
        let (b, a) = live();
        bytes.push(b as f64);
        allocs.push(a as f64);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (median(bytes) as isize, median(allocs) as isize)
}

struct Sample {
    backend: Backend,
    scenario: Scenario,
    bytes: f64,
    allocs: f64,
    left: f64,
    redis_bytes: Option<f64>,
    /// Waiting on their own resource: attempts and Redis commands per waiter and second.
    retry: Option<(f64, f64)>,
    /// Redis memory per item once everything was released (fence counters stay).
    redis_left: Option<f64>,
    /// Held leases: tokio tasks alive per lease.
    tasks_alive: Option<f64>,
}

fn used_memory(servers: &[RedisServer]) -> Option<f64> {
    if servers.is_empty() {
        return None;
    }
    Some(
        servers
            .iter()
            .filter_map(|s| common::info_field(s, "memory", "used_memory"))
            .filter_map(|v| v.parse::<f64>().ok())
            .sum(),
    )
}

fn locker(backend: Backend, node: &MemoryNode, servers: &[RedisServer], watchdog: bool) -> Redlock {
    let options = LockOptions::default()
        .ttl(TTL)
        .node_timeout(Duration::from_millis(500))
        .watchdog(watchdog);
    match backend {
        Backend::Memory => Redlock::new([node.clone()], options),
        Backend::Redis(_) => Redlock::from_urls(servers.iter().map(|s| s.url()), options),
    }
    .expect("locker")
}

fn main() {
    let n: usize = common::flag("--n", 10_000);
    let reps: usize = common::flag("--reps", 3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let load_before = common::loadavg();
    let futures = runtime.block_on(async {
        let locker = Redlock::in_memory();

        {
            let acquire = locker.acquire("r", WAIT);
            let try_acquire = locker.try_acquire("r");
            (
                std::mem::size_of_val(&acquire),
                std::mem::size_of_val(&try_acquire),
            )
        }
    });
    let cycles_only = common::switch("--cycles-only");
    let mut samples = Vec::new();
    let mut cycle_rows = Vec::new();
    for backend in [Backend::Memory, Backend::Redis(1), Backend::Redis(3)] {
        let servers = match backend {
            Backend::Memory => Vec::new(),
            Backend::Redis(nodes) => RedisServer::start_many(nodes),
        };
        let per_cycle: Vec<(f64, f64)> = (0..reps)
            .map(|rep| runtime.block_on(cycles(backend, &servers, n, rep)))
            .collect();
        cycle_rows.push((
            backend,
            median(per_cycle.iter().map(|c| c.0)),
            median(per_cycle.iter().map(|c| c.1)),
        ));
        if cycles_only {
            continue;
        }
        for rep in 0..reps {
            for scenario in [
                Scenario::Held { watchdog: true },
                Scenario::Held { watchdog: false },
                Scenario::WaitingSame,
                Scenario::WaitingOwn,
            ] {
                let sample = runtime.block_on(measure(backend, scenario, &servers, n, rep));
                eprintln!(
                    "{} / {} / rep {}: {:.0} B, {:.1} allocations per item, {:.1} B left after",
                    backend.name(),
                    scenario.name(),
                    rep + 1,
                    sample.bytes,
                    sample.allocs,
                    sample.left
                );
                samples.push(sample);
            }
        }
    }
    if !cycles_only {
        print_table(&samples, n, reps, &load_before, futures);
    }
    println!();
    println!(
        "Client work per acquisition: {} sequential try_acquire + release cycles, medians of {reps}; \
         tasks alive per held lease from the held-lease rows (watchdog on).",
        common::thousands(n as f64)
    );
    println!();
    println!("| backend | allocator calls per acquire + release | engine tasks spawned per acquire + release | tokio tasks alive per held lease |");
    println!("|---|---|---|---|");
    for (backend, allocs, tasks) in cycle_rows {
        let alive = median(
            samples
                .iter()
                .filter(|s| {
                    s.backend == backend && s.scenario == (Scenario::Held { watchdog: true })
                })
                .filter_map(|s| s.tasks_alive),
        );
        let alive = if alive.is_nan() {
            "–".to_owned()
        } else {
            format!("{alive:.2}")
        };
        println!(
            "| {} | {allocs:.1} | {tasks:.2} | {alive} |",
            backend.name()
        );
    }
}

async fn measure(
    backend: Backend,
    scenario: Scenario,
    servers: &[RedisServer],
    n: usize,
    rep: usize,
) -> Sample {
    let node = MemoryNode::new();
    let watchdog = !matches!(scenario, Scenario::Held { watchdog: false });
    let locker = locker(backend, &node, servers, watchdog).with_max_waiters(n + 1);
    let prefix = format!("mem:{rep}:{scenario:?}");
    // Warm-up: connections, scripts and (for waiters) the pub/sub connection.
    let other = locker_other(backend, &node, servers);
    {
        let held = other
            .try_acquire(format!("{prefix}:warm"))
            .await
            .expect("warm");
        let waiter = {
            let locker = locker.clone();
            let prefix = prefix.clone();
            tokio::spawn(async move { locker.acquire(format!("{prefix}:warm"), WAIT).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        held.release().await;
        waiter
            .await
            .expect("task")
            .expect("warm acquire")
            .release()
            .await;
    }
    let (bytes0, allocs0) = settled().await;
    let redis0 = used_memory(servers);
    let (bytes1, allocs1, redis1);
    let mut retry = None;
    let mut tasks_alive = None;
    match scenario {
        Scenario::Held { .. } => {
            let alive0 = tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks();
            let mut leases: Vec<Lease> = Vec::with_capacity(n);
            for i in 0..n {
                leases.push(
                    locker
                        .try_acquire(format!("{prefix}:{i}"))
                        .await
                        .expect("uncontended acquire"),
                );
            }
            (bytes1, allocs1) = settled().await;
            redis1 = used_memory(servers);
            let alive1 = tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks();
            tasks_alive = Some((alive1 as f64 - alive0 as f64) / n as f64);
            for lease in leases {
                lease.release().await;
            }
        }
        Scenario::WaitingSame => {
            let held = locker
                .try_acquire(format!("{prefix}:hot"))
                .await
                .expect("holder");
            let waits0 = locker.metrics().waits;
            let mut tasks: Vec<JoinHandle<Result<Lease, LockError>>> = Vec::with_capacity(n);
            for _ in 0..n {
                let locker = locker.clone();
                let resource = format!("{prefix}:hot");
                tasks.push(tokio::spawn(
                    async move { locker.acquire(resource, WAIT).await },
                ));
            }
            while locker.metrics().waits - waits0 < n as u64 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (bytes1, allocs1) = settled().await;
            redis1 = used_memory(servers);
            for task in &tasks {
                task.abort();
            }
            for task in tasks {
                let _ = task.await;
            }
            held.release().await;
        }
        Scenario::WaitingOwn => {
            let mut held = Vec::with_capacity(n);
            for i in 0..n {
                held.push(
                    other
                        .try_acquire(format!("{prefix}:{i}"))
                        .await
                        .expect("holder"),
                );
            }
            // The holder's leases are not the waiters' cost.
            let (b, a) = settled().await;
            let r = used_memory(servers);
            let (shift_b, shift_a) = (b - bytes0, a - allocs0);
            let waits0 = locker.metrics().waits;
            let mut tasks: Vec<JoinHandle<Result<Lease, LockError>>> = Vec::with_capacity(n);
            for i in 0..n {
                let locker = locker.clone();
                let resource = format!("{prefix}:{i}");
                tasks.push(tokio::spawn(
                    async move { locker.acquire(resource, WAIT).await },
                ));
            }
            // `waits` counts a caller once it subscribed and is about to wait.
            while locker.metrics().waits - waits0 < n as u64 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // While they wait: the attempts of the fallback retry, per waiter and second,
            // once its backoff reached its cap (after ~1 s), over one second.
            tokio::time::sleep(Duration::from_secs(2)).await;
            common::reset_stats(servers);
            let (attempts0, t0) = (locker.metrics().contended, std::time::Instant::now());
            tokio::time::sleep(Duration::from_secs(1)).await;
            let secs = t0.elapsed().as_secs_f64();
            retry = Some((
                (locker.metrics().contended - attempts0) as f64 / n as f64 / secs,
                common::commands(servers) as f64 / n as f64 / secs,
            ));
            let (b1, a1) = settled().await;
            (bytes1, allocs1) = (b1 - shift_b, a1 - shift_a);
            redis1 = match (used_memory(servers), r, redis0) {
                (Some(now), Some(r), Some(r0)) => Some(now - (r - r0)),
                _ => None,
            };
            for task in &tasks {
                task.abort();
            }
            for task in tasks {
                let _ = task.await;
            }
            for lease in held {
                lease.release().await;
            }
        }
    }
    drop(other);
    drop(locker);
    let (bytes2, _) = settled().await;
    let redis2 = used_memory(servers);
    let per = |x: isize| x as f64 / n as f64;
    Sample {
        backend,
        scenario,
        bytes: per(bytes1 - bytes0),
        allocs: per(allocs1 - allocs0),
        left: per(bytes2 - bytes0),
        redis_bytes: match (redis0, redis1) {
            (Some(a), Some(b)) => Some((b - a) / n as f64),
            _ => None,
        },
        retry,
        redis_left: match (redis0, redis2) {
            (Some(a), Some(b)) => Some((b - a) / n as f64),
            _ => None,
        },
        tasks_alive,
    }
}

/// Client work of one acquire + release: allocator calls and engine tasks spawned per
/// cycle, over `n` sequential cycles on distinct resources.
async fn cycles(backend: Backend, servers: &[RedisServer], n: usize, rep: usize) -> (f64, f64) {
    let node = MemoryNode::new();
    let locker = locker(backend, &node, servers, true);
    let prefix = format!("cycle:{rep}");
    // Warm-up: connections and scripts.
    for i in 0..100 {
        let lease = locker
            .try_acquire(format!("{prefix}:warm:{i}"))
            .await
            .expect("warm");
        lease.release().await;
    }
    let allocs0 = ALLOC_CALLS.load(Ordering::Relaxed);
    let tasks0 = tower_redlock::metrics::tasks_spawned();
    for i in 0..n {
        let lease = locker
            .try_acquire(format!("{prefix}:{i}"))
            .await
            .expect("uncontended acquire");
        lease.release().await;
    }
    let allocs = ALLOC_CALLS.load(Ordering::Relaxed) - allocs0;
    let tasks = tower_redlock::metrics::tasks_spawned() - tasks0;
    (allocs as f64 / n as f64, tasks as f64 / n as f64)
}

/// Another locker over the same nodes: "another process" to the nodes.
fn locker_other(backend: Backend, node: &MemoryNode, servers: &[RedisServer]) -> Redlock {
    locker(backend, node, servers, true)
}

fn print_table(
    samples: &[Sample],
    n: usize,
    reps: usize,
    load_before: &str,
    (acquire, try_acquire): (usize, usize),
) {
    println!();
    println!(
        "N = {}, medians of {reps} repetitions; tokio multi-thread runtime; load average {load_before} → {}. \
         size_of::<Lease>() = {} B; the future of `acquire` is {acquire} B, of `try_acquire` {try_acquire} B.",
        common::thousands(n as f64),
        common::loadavg(),
        std::mem::size_of::<Lease>()
    );
    println!();
    println!("| backend | what | bytes per item (client heap) | live allocations per item | bytes per item left after release/cancel | Redis used_memory per item (all nodes) | Redis used_memory per item left after release/cancel | per waiter and second while waiting |");
    println!("|---|---|---|---|---|---|---|---|");
    for backend in [Backend::Memory, Backend::Redis(1), Backend::Redis(3)] {
        for scenario in [
            Scenario::Held { watchdog: true },
            Scenario::Held { watchdog: false },
            Scenario::WaitingSame,
            Scenario::WaitingOwn,
        ] {
            let rows: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.backend == backend && s.scenario == scenario)
                .collect();
            if rows.is_empty() {
                continue;
            }
            let redis = median(rows.iter().filter_map(|s| s.redis_bytes));
            let redis_left = median(rows.iter().filter_map(|s| s.redis_left));
            let bytes = |x: f64| {
                if x.is_nan() {
                    "–".to_owned()
                } else {
                    format!("{x:.0}")
                }
            };
            let retry = if rows.iter().any(|s| s.retry.is_some()) {
                let attempts = median(rows.iter().filter_map(|s| s.retry.map(|r| r.0)));
                let commands = median(rows.iter().filter_map(|s| s.retry.map(|r| r.1)));
                if servers_of(backend) == 0 {
                    format!("{attempts:.1} attempts")
                } else {
                    format!("{attempts:.1} attempts, {commands:.1} commands")
                }
            } else {
                "–".to_owned()
            };
            println!(
                "| {} | {} | {:.0} | {:.1} | {:.1} | {} | {} | {retry} |",
                backend.name(),
                scenario.name(),
                median(rows.iter().map(|s| s.bytes)),
                median(rows.iter().map(|s| s.allocs)),
                median(rows.iter().map(|s| s.left)),
                bytes(redis),
                bytes(redis_left),
            );
        }
    }
}
