//! Middleware cost (issue 6): requests/s and latency of an axum route behind
//! `LockLayer`, against the same route without the layer whose handler does the
//! equivalent raw redis-rs round trips by hand, in the same run.
//!
//! `cargo bench --bench layer` spawns its own redis-server nodes on free loopback ports
//! (the `tests/support` helper) and prints markdown tables. For 1 and 3 nodes, under
//! tokio's multi-thread runtime and then under `current_thread`:
//!
//! - **layer**: `POST /work` with `route_layer(LockLayer::new(locker, header("Idempotency-Key")))`,
//!   every request a unique key (so no contention), a handler that returns `"ok"`. The
//!   locker has ttl 30 s, the watchdog on (the default), a 500 ms node timeout. The
//!   lease is released in the background when the response body ends.
//! - **raw**: the same route without the layer; its handler does by hand, per node
//!   concurrently (`join_all`) over one multiplexed redis-rs connection per node, the
//!   same Redis work as the layer's fenced lock: what the crate pipelines for a caller
//!   that does not wait (`SET NX PX`, `EXISTS` of the wait queue, the crate's fence
//!   script `fence.lua`: the counter floored by the clock), counts a quorum (N/2+1),
//!   then the crate's release script (compare-and-delete, `PUBLISH`) on the nodes that
//!   granted it, both as `EVALSHA`, and answers `"ok"`. (Until 2026-11-23 the
//!   raw handler did a bare `SET NX PX` and an unfenced compare-and-delete: 4 Redis
//!   commands per request against the layer's 9, which measured fencing, not the
//!   layer.)
//!   Same TCP settings as the crate (`TCP_NODELAY`).
//! - **direct** (with `-- --direct`): the same route without the layer; its handler
//!   takes the layer's lock through the locker's API (`try_acquire` of the same
//!   resource, the lease dropped before answering, so released in the background):
//!   the lock engine without the middleware, to tell their costs apart.
//!
//! Every router is made with `with_state`, as `axum::serve` (`into_make_service`) makes
//! it, so handlers and their layers become routes once, not on every request.
//!
//! Load: a client in the same process, no sockets: `tasks` (64) tokio tasks send
//! `requests` (50,000: long enough for the 10 ms resolution of the CPU counters)
//! requests after a warm-up (5,000), each with `ServiceExt::oneshot` on a clone of the
//! `Router`, and read the body to the end.
//! Latency = from building the request to the end of the body. A row ends when every
//! response was read and, for the layer, every lease released (the locker holds no
//! resource any more), so background releases are inside the time.
//!
//! Each (runtime, nodes) pair is measured `reps` (4) times, the variants taking turns
//! at going first, each row on freshly flushed nodes; the tables show medians, and
//! the ratio is the median of the per-repetition ratios. Redis commands per request
//! come from `INFO commandstats`; CPU per request from `/proc/PID/stat` of this process
//! and of the servers.
//!
//! Options: `-- --requests N`, `-- --tasks N`, `-- --reps N`, `-- --quick` (2,000
//! requests, one repetition, for a smoke run); for profiling one row: `-- --nodes 1`
//! (or `3`, default `1,3`), `-- --runtime current_thread` (or `multi-thread`),
//! `-- --no-context` (skip the rows without Redis), `-- --only layer` (or `raw`,
//! `direct`).

#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use axum::Router;
use futures_util::future::join_all;
use http_body_util::BodyExt;
use redis::aio::MultiplexedConnection;
use support::RedisServer;
use tower::ServiceExt;
use tower_redlock::http::{key::header, LockLayer};
use tower_redlock::{LockOptions, MemoryNode, Redlock, Resource};

use common::{median, ms, percentile, thousands};

const TTL: Duration = Duration::from_secs(30);
/// The compare-and-delete of the anchors' raw client.
/// The fence counter's ttl: the crate's default (`LockOptions::fence_ttl`).
const FENCE_TTL: Duration = Duration::from_secs(3600);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flavor {
    MultiThread,
    CurrentThread,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::MultiThread => "multi-thread",
            Flavor::CurrentThread => "current_thread",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// `LockLayer` over the Redis nodes.
    Layer,
    /// Raw redis-rs round trips in the handler.
    Raw,
    /// Context: `LockLayer` over one `MemoryNode` (no Redis).
    LayerMemory,
    /// Context: the bare route, no lock at all.
    Bare,
    /// Context: the same locker as the layer's, called by hand in the handler (no
    /// layer): what the lock costs without the middleware around it.
    Direct,
}

impl Variant {
    /// The value of `--only` that selects this variant.
    fn flag(self) -> &'static str {
        match self {
            Variant::Layer => "layer",
            Variant::Raw => "raw",
            Variant::LayerMemory => "memory",
            Variant::Bare => "bare",
            Variant::Direct => "direct",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Variant::Layer => "LockLayer",
            Variant::Raw => "raw redis-rs in handler",
            Variant::LayerMemory => "LockLayer over MemoryNode",
            Variant::Bare => "bare route, no lock",
            Variant::Direct => "Redlock by hand in handler",
        }
    }
}

struct Config {
    requests: usize,
    warmup: usize,
    tasks: usize,
    reps: usize,
}

/// One measured row.
struct Sample {
    flavor: Flavor,
    nodes: usize,
    variant: Variant,
    rep: usize,
    rps: f64,
    p50: Duration,
    p99: Duration,
    /// Responses other than 200.
    errors: usize,
    /// Redis commands per request, summed over nodes.
    commands: f64,
    /// CPU of this process per request (µs).
    client_cpu_us: f64,
    /// CPU of the Redis servers per request (µs), summed over nodes.
    redis_cpu_us: f64,
    /// CPU of the busiest Redis server, % of one core.
    redis_busiest: f64,
}

fn main() {
    let quick = common::switch("--quick");
    let config = Config {
        requests: common::flag("--requests", if quick { 2000 } else { 50_000 }),
        warmup: if quick { 2000 } else { 5000 },
        tasks: common::flag("--tasks", 64),
        reps: common::flag("--reps", if quick { 1 } else { 4 }),
    };
    let nodes: String = common::flag("--nodes", "1,3".to_owned());
    let runtimes: String = common::flag("--runtime", "multi-thread,current_thread".to_owned());
    let clusters: Vec<Vec<RedisServer>> = nodes
        .split(',')
        .map(|n| RedisServer::start_many(n.trim().parse().expect("--nodes")))
        .collect();
    let mut samples = Vec::new();
    let mut loads = Vec::new();
    for flavor in [Flavor::MultiThread, Flavor::CurrentThread]
        .into_iter()
        .filter(|f| runtimes.split(',').any(|r| r.trim() == f.name()))
    {
        let runtime = match flavor {
            Flavor::MultiThread => tokio::runtime::Builder::new_multi_thread(),
            Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
        }
        .enable_all()
        .build()
        .expect("runtime");
        let before = common::loadavg();
        runtime.block_on(measure(flavor, &clusters, &config, &mut samples));
        loads.push((flavor, before, common::loadavg()));
    }
    print_tables(&samples, &loads, &config);
}

async fn measure(
    flavor: Flavor,
    clusters: &[Vec<RedisServer>],
    config: &Config,
    samples: &mut Vec<Sample>,
) {
    let only = std::env::args()
        .position(|a| a == "--only")
        .and_then(|i| std::env::args().nth(i + 1));
    let with_direct = common::switch("--direct") || only.as_deref() == Some("direct");
    for servers in clusters {
        let nodes = servers.len();
        let layer = layer_target(
            Redlock::connect(servers.iter().map(|s| s.url()), options())
                .await
                .expect("locker"),
        );
        let raw = Target {
            router: raw_router(servers).await,
            locker: None,
        };
        let direct = direct_target(
            Redlock::connect(servers.iter().map(|s| s.url()), options())
                .await
                .expect("locker"),
        );
        let mut variants = vec![Variant::Layer, Variant::Raw];
        if with_direct {
            variants.push(Variant::Direct);
        }
        for rep in 0..config.reps {
            // Each variant goes first in turn: a drift of the machine's load over a
            // repetition then favours none of them.
            let mut order = variants.clone();
            order.rotate_left(rep % variants.len());
            for variant in order {
                if only.as_deref().is_some_and(|o| o != variant.flag()) {
                    continue;
                }
                let target = match variant {
                    Variant::Layer => &layer,
                    Variant::Direct => &direct,
                    _ => &raw,
                };
                let sample = run(flavor, servers, variant, rep, target, config).await;
                eprintln!(
                    "{} {} node(s) rep {} {}: {:.0} req/s, p50 {} ms, p99 {} ms, {} errors (load {})",
                    flavor.name(),
                    nodes,
                    rep + 1,
                    variant.name(),
                    sample.rps,
                    ms(sample.p50),
                    ms(sample.p99),
                    sample.errors,
                    common::loadavg(),
                );
                samples.push(sample);
            }
        }
    }
    if common::switch("--no-context") {
        return;
    }
    // Context, without Redis: what the layer itself and the load driver cost.
    let memory = layer_target(Redlock::new([MemoryNode::new()], options()).expect("locker"));
    let bare = Target {
        router: Router::new()
            .route("/work", post(|| async { "ok" }))
            .with_state(()),
        locker: None,
    };
    for rep in 0..config.reps {
        for (variant, target) in [(Variant::LayerMemory, &memory), (Variant::Bare, &bare)] {
            let sample = run(flavor, &[], variant, rep, target, config).await;
            samples.push(sample);
        }
    }
}

fn options() -> LockOptions {
    // A generous per-node timeout: on a shared 2-core machine a node may stall for more
    // than the default 50 ms, which would turn into 503 rather than into latency.
    LockOptions::default()
        .ttl(TTL)
        .node_timeout(Duration::from_millis(500))
}

/// `POST /work` behind the lock layer, keyed by the `Idempotency-Key` header.
fn layer_target(locker: Redlock) -> Target {
    Target {
        router: Router::new()
            .route("/work", post(|| async { "ok" }))
            .route_layer(LockLayer::new(locker.clone(), header("Idempotency-Key")))
            .with_state(()),
        locker: Some(locker),
    }
}

/// `POST /work` without the layer; the handler takes the same lock as the layer's
/// through the locker's API and drops the lease (released in the background, as the
/// layer's is when the body ends).
fn direct_target(locker: Redlock) -> Target {
    let handler = {
        let locker = locker.clone();
        move |headers: HeaderMap| async move {
            let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
                return (StatusCode::BAD_REQUEST, "no key");
            };
            match locker
                .try_acquire(Resource::new("POST").join("/work").join(key))
                .await
            {
                Ok(_lease) => (StatusCode::OK, "ok"),
                Err(_) => (StatusCode::CONFLICT, "held"),
            }
        }
    };
    Target {
        router: Router::new().route("/work", post(handler)).with_state(()),
        locker: Some(locker),
    }
}

/// A router to drive, and the locker behind its layer, if any.
///
/// Every router is made with `with_state`, as `axum::serve` makes it (through
/// `into_make_service`): the handlers, and the layers around them, become routes once.
/// A router without it turns each handler into a route, and builds its layers, on
/// every request (until 2026-11-24 the layer's router paid that and the hand-written
/// one, made with its state, did not).
struct Target {
    router: Router,
    locker: Option<Redlock>,
}

/// What the hand-written handler needs: one multiplexed connection per node.
#[derive(Clone)]
struct RawState {
    conns: Arc<[MultiplexedConnection]>,
    quorum: usize,
    acquire: Arc<redis::Script>,
    release: Arc<redis::Script>,
}

/// `POST /work` without the layer; the handler locks by hand.
async fn raw_router(servers: &[RedisServer]) -> Router {
    let fence = Arc::new(redis::Script::new(concat!(
        include_str!("../src/node/redis/scripts/fence_rule.lua"),
        include_str!("../src/node/redis/scripts/fence.lua")
    )));
    let mut conns = Vec::new();
    for server in servers {
        let client = redis::Client::open(server.url()).expect("url");
        let info = client.get_connection_info().clone();
        let tcp = info.tcp_settings().clone().set_nodelay(true);
        let client = redis::Client::open(info.set_tcp_settings(tcp)).expect("settings");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        // Loaded once, so that every acquire pipelines a plain EVALSHA.
        let _: String = fence
            .prepare_invoke()
            .load_async(&mut conn)
            .await
            .expect("SCRIPT LOAD");
        conns.push(conn);
    }
    let state = RawState {
        quorum: conns.len() / 2 + 1,
        conns: conns.into(),
        // The crate's scripts as the crate sends them: the fence script pipelined behind
        // SET NX PX and EXISTS of the queue; the release script.
        acquire: fence,
        release: Arc::new(redis::Script::new(concat!(
            include_str!("../src/node/redis/scripts/release_fast.lua"),
            include_str!("../src/node/redis/scripts/hand_off.lua"),
            include_str!("../src/node/redis/scripts/release.lua")
        ))),
    };
    Router::new()
        .route("/work", post(raw_handler))
        .with_state(state)
}

async fn raw_handler(
    State(state): State<RawState>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return (StatusCode::BAD_REQUEST, "no key");
    };
    // The same resource name and owner value as the layer's.
    let key = format!("raw:{{POST:/work:{key}}}");
    let owner = owner();
    let floor = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64 * 1024);
    let granted = join_all(state.conns.iter().map(|conn| {
        let mut conn = conn.clone();
        let (key, owner, acquire) = (&key, &owner, &state.acquire);
        async move {
            // What the crate sends for a caller that does not wait: lock key, the wait
            // queue's check and the floored fence counter, pipelined.
            let reply: redis::RedisResult<(Option<String>, i64, u64)> = redis::pipe()
                .cmd("SET")
                .arg(key)
                .arg(owner)
                .arg("NX")
                .arg("PX")
                .arg(TTL.as_millis() as u64)
                .cmd("EXISTS")
                .arg(format!("{key}:queue"))
                .cmd("EVALSHA")
                .arg(acquire.get_hash())
                .arg(1)
                .arg(format!("{key}:fence"))
                .arg(floor)
                .arg(FENCE_TTL.as_millis() as u64)
                .query_async(&mut conn)
                .await;
            matches!(reply, Ok((Some(_), 0, _)))
        }
    }))
    .await;
    let votes = granted.iter().filter(|g| **g).count();
    let status = if votes >= state.quorum {
        StatusCode::OK // the handler's work would run here
    } else {
        StatusCode::CONFLICT
    };
    join_all(
        state
            .conns
            .iter()
            .zip(&granted)
            .filter(|(_, granted)| **granted)
            .map(|(conn, _)| {
                let mut conn = conn.clone();
                let (key, owner, release) = (&key, &owner, &state.release);
                async move {
                    // The crate's release script: compare-and-delete, then the hand-off
                    // to the queue (empty here) and PUBLISH.
                    let _: redis::RedisResult<i64> = release
                        .key(key)
                        .key(format!("{key}:queue"))
                        .arg(owner)
                        .arg(format!("{key}:released"))
                        .invoke_async(&mut conn)
                        .await;
                }
            }),
    )
    .await;
    (status, "ok")
}

/// 20 random bytes, hex-encoded: what the crate stores as the owner value.
fn owner() -> String {
    let bytes: [u8; 20] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Warm-up, then `config.requests` requests over `config.tasks` tasks.
async fn run(
    flavor: Flavor,
    servers: &[RedisServer],
    variant: Variant,
    rep: usize,
    target: &Target,
    config: &Config,
) -> Sample {
    let tag = format!("{:?}-{}-{:?}-{rep}", flavor, servers.len(), variant);
    let router = &target.router;
    // Every row starts from empty nodes: the layer's fence counters (one per key, kept
    // for 7 days) would otherwise grow the keyspace under the next row, which then
    // pays Redis's incremental rehashing.
    servers.iter().for_each(RedisServer::flushall);
    drive(router, &format!("{tag}-warm"), config.warmup, config.tasks).await;
    settle(target).await;
    common::reset_stats(servers);
    let (cpu0, redis0) = (common::own_cpu(), server_cpus(servers));
    let start = Instant::now();
    let (mut latencies, errors) =
        drive(router, &format!("{tag}-m"), config.requests, config.tasks).await;
    settle(target).await;
    let elapsed = start.elapsed();
    let cpu = common::own_cpu() - cpu0;
    let redis: Vec<Duration> = server_cpus(servers)
        .iter()
        .zip(&redis0)
        .map(|(after, before)| *after - *before)
        .collect();
    let commands = common::commands(servers);
    latencies.sort();
    let n = config.requests as f64;
    Sample {
        flavor,
        nodes: servers.len(),
        variant,
        rep,
        rps: n / elapsed.as_secs_f64(),
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        errors,
        commands: commands as f64 / n,
        client_cpu_us: cpu.as_secs_f64() * 1e6 / n,
        redis_cpu_us: redis.iter().sum::<Duration>().as_secs_f64() * 1e6 / n,
        redis_busiest: redis
            .iter()
            .map(|d| d.as_secs_f64() / elapsed.as_secs_f64() * 100.0)
            .fold(0.0, f64::max),
    }
}

fn server_cpus(servers: &[RedisServer]) -> Vec<Duration> {
    servers
        .iter()
        .map(|s| common::cpu_time(&s.pid().to_string()))
        .collect()
}

/// Waits until the layer's locker (if any) holds nothing: every lease released.
async fn settle(target: &Target) {
    if let Some(locker) = &target.locker {
        while locker.local_resources() > 0 {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
    }
}

/// `total` requests with keys `prefix-i` over `tasks` tasks; latencies and the number
/// of responses other than 200.
async fn drive(
    router: &Router,
    prefix: &str,
    total: usize,
    tasks: usize,
) -> (Vec<Duration>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (router, next, prefix) = (router.clone(), next.clone(), prefix.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(total / tasks + 1);
                let mut errors = 0;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return (latencies, errors);
                    }
                    let start = Instant::now();
                    let request = Request::post("/work")
                        .header("idempotency-key", format!("{prefix}-{i}"))
                        .body(Body::empty())
                        .expect("request");
                    let response = router.clone().oneshot(request).await.expect("infallible");
                    if response.status() != StatusCode::OK {
                        errors += 1;
                    }
                    let _ = response.into_body().collect().await;
                    latencies.push(start.elapsed());
                }
            })
        })
        .collect();
    let mut all = Vec::with_capacity(total);
    let mut errors = 0;
    for worker in workers {
        let (latencies, e) = worker.await.expect("worker");
        all.extend(latencies);
        errors += e;
    }
    (all, errors)
}

fn print_tables(samples: &[Sample], loads: &[(Flavor, String, String)], config: &Config) {
    let of = |flavor: Flavor, nodes: usize, variant: Variant| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.flavor == flavor && s.nodes == nodes && s.variant == variant)
            .collect()
    };
    let med = |rows: &[&Sample], f: fn(&Sample) -> f64| median(rows.iter().map(|s| f(s)));
    let flavors = [Flavor::MultiThread, Flavor::CurrentThread];
    println!();
    println!(
        "{} requests per row after {} warm-up, {} client tasks, medians of {} repetitions.",
        thousands(config.requests as f64),
        thousands(config.warmup as f64),
        config.tasks,
        config.reps
    );
    for (flavor, before, after) in loads {
        println!("Load average ({}): {before} → {after}", flavor.name());
    }
    println!();
    println!("| runtime | nodes | route | requests/s | p50 (ms) | p99 (ms) | non-200 | Redis commands / request | client CPU (µs / request) | Redis CPU (µs / request) | busiest Redis (% of a core) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for flavor in flavors {
        for (nodes, variant) in [
            (1, Variant::Layer),
            (1, Variant::Raw),
            (1, Variant::Direct),
            (3, Variant::Layer),
            (3, Variant::Raw),
            (3, Variant::Direct),
            (0, Variant::LayerMemory),
            (0, Variant::Bare),
        ] {
            let rows = of(flavor, nodes, variant);
            if rows.is_empty() {
                continue;
            }
            let redis = |x: f64| {
                if nodes == 0 {
                    "–".to_owned()
                } else {
                    format!("{x:.1}")
                }
            };
            println!(
                "| {} | {} | {} | {} | {:.3} | {:.3} | {} | {} | {:.1} | {} | {} |",
                flavor.name(),
                if nodes == 0 {
                    "–".into()
                } else {
                    nodes.to_string()
                },
                variant.name(),
                thousands(med(&rows, |s| s.rps)),
                med(&rows, |s| s.p50.as_secs_f64() * 1e3),
                med(&rows, |s| s.p99.as_secs_f64() * 1e3),
                rows.iter().map(|s| s.errors).sum::<usize>(),
                redis(med(&rows, |s| s.commands)),
                med(&rows, |s| s.client_cpu_us),
                redis(med(&rows, |s| s.redis_cpu_us)),
                redis(med(&rows, |s| s.redis_busiest)),
            );
        }
    }
    println!();
    println!("| runtime | nodes | LockLayer requests/s | raw requests/s | LockLayer / raw (median) | per repetition | p50 LockLayer / raw | target ≥ 0.9× |");
    println!("|---|---|---|---|---|---|---|---|");
    for flavor in flavors {
        for nodes in [1, 3] {
            let (layer, raw) = (
                of(flavor, nodes, Variant::Layer),
                of(flavor, nodes, Variant::Raw),
            );
            if layer.is_empty() || raw.is_empty() {
                continue;
            }
            let ratios: Vec<f64> = layer
                .iter()
                .filter_map(|l| {
                    let r = raw.iter().find(|r| r.rep == l.rep)?;
                    Some(l.rps / r.rps)
                })
                .collect();
            let p50s = layer.iter().filter_map(|l| {
                let r = raw.iter().find(|r| r.rep == l.rep)?;
                Some(l.p50.as_secs_f64() / r.p50.as_secs_f64())
            });
            let ratio = median(ratios.iter().copied());
            println!(
                "| {} | {nodes} | {} | {} | {ratio:.2}× | {} | {:.2}× | {} |",
                flavor.name(),
                thousands(med(&layer, |s| s.rps)),
                thousands(med(&raw, |s| s.rps)),
                ratios
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                median(p50s),
                if ratio >= 0.9 { "met" } else { "not met" },
            );
        }
    }
}
