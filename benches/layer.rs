//! What a client sees of `LockLayer` (issue 42): requests/s and latency of an axum
//! route behind the layer, served by `axum::serve` on a loopback port to keep-alive
//! clients, against the same route without the layer whose handler does the same
//! Redis round trips by hand, in the same run.
//!
//! `cargo bench --bench layer` spawns its own redis-server nodes on free loopback ports
//! (the `tests/support` helper) and prints markdown tables. For tokio's multi-thread
//! and `current_thread` runtimes, 1 and 3 nodes, and a listener without and with
//! `TCP_NODELAY` (`axum::serve`'s default is without):
//!
//! - **layer**: `POST /work` with `route_layer(LockLayer::new(locker, header("Idempotency-Key")))`,
//!   every request a unique key (so no contention), a handler that returns `"ok"`. The
//!   locker has ttl 30 s, the watchdog on (the default), a 500 ms node timeout.
//! - **raw**: the same route without the layer; its handler does by hand, per node
//!   concurrently (`join_all`) over one multiplexed redis-rs connection per node, the
//!   same Redis work as the layer's fenced lock: what the crate pipelines for a caller
//!   that does not wait (`SET NX PX`, `EXISTS` of the wait queue, the crate's fence
//!   script), counts a quorum (N/2+1), then the crate's release script
//!   (compare-and-delete, `PUBLISH`) on the nodes that granted it, and answers `"ok"`.
//!
//! Load: `--conns` (16) keep-alive HTTP/1.1 connections from this process (the
//! `tests/support` client), each sending its next request once it has read the last
//! response, for `--secs` (2) after a warm-up of 0.3 s. Latency = from writing the
//! request to reading the last byte of the response. Both run in the same runtime as
//! the server, as an application's own load would. Each row starts on flushed nodes.
//!
//! Each (runtime, nodes, listener) triple is measured `--reps` (2) times, the routes
//! taking turns at going first; the tables show medians, and the ratios the median of
//! the per-repetition ratios. Redis commands per request come from
//! `INFO commandstats`, CPU per request (server and client: this process) from
//! `/proc/self/stat`.
//!
//! The `oneshot` bench this replaces (the service driven without sockets) could not
//! show a response that leaves in two writes, which is what a client pays for; the
//! layer's CPU per request, which it measured, is in the table here.
//!
//! Options: `-- --secs N`, `-- --conns N`, `-- --reps N`, `-- --nodes 1` (or `3`,
//! default `1,3`), `-- --runtime current_thread` (or `multi-thread`), `-- --nodelay on`
//! (or `off`, default both), `-- --quick` (0.5 s rows, one repetition).

#[path = "../tests/support/http_client.rs"]
mod http_client;
#[path = "../tests/support/mod.rs"]
mod support;

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::Router;
use futures_util::future::join_all;
use http_client::{Conn, Req};
use redis::aio::MultiplexedConnection;
use support::RedisServer;
use tokio::net::TcpListener;
use tower_redlock::http::{key::header, LockLayer};
use tower_redlock::{LockOptions, Redlock};

use common::{median, percentile, thousands};

const TTL: Duration = Duration::from_secs(30);
/// The fence counter's ttl: the crate's default (`LockOptions::fence_ttl`).
const FENCE_TTL: Duration = Duration::from_secs(3600);
const WARM_UP: Duration = Duration::from_millis(300);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    /// `LockLayer` over the Redis nodes.
    Layer,
    /// Raw redis-rs round trips in the handler.
    Raw,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Layer => "LockLayer",
            Route::Raw => "raw redis-rs in handler",
        }
    }
}

/// What a row is measured under.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Setup {
    runtime: &'static str,
    nodes: usize,
    nodelay: bool,
}

struct Config {
    secs: Duration,
    conns: usize,
    reps: usize,
}

/// One measured row.
struct Sample {
    setup: Setup,
    route: Route,
    rep: usize,
    rps: f64,
    p50: Duration,
    p99: Duration,
    /// Responses other than 200.
    errors: usize,
    /// Redis commands per request, summed over nodes.
    commands: f64,
    /// CPU of this process (server and client) per request, µs.
    cpu_us: f64,
}

fn main() {
    let quick = common::switch("--quick");
    let config = Config {
        secs: Duration::from_secs_f64(common::flag("--secs", if quick { 0.5 } else { 2.0 })),
        conns: common::flag("--conns", 16),
        reps: common::flag("--reps", if quick { 1 } else { 2 }),
    };
    let nodes: String = common::flag("--nodes", "1,3".to_owned());
    let runtimes: String = common::flag("--runtime", "multi-thread,current_thread".to_owned());
    let nodelay: String = common::flag("--nodelay", "off,on".to_owned());
    let clusters: Vec<Vec<RedisServer>> = nodes
        .split(',')
        .map(|n| RedisServer::start_many(n.trim().parse().expect("--nodes")))
        .collect();
    let nodelays: Vec<bool> = nodelay.split(',').map(|v| v.trim() == "on").collect();
    let mut samples = Vec::new();
    for runtime in runtimes.split(',').map(str::trim) {
        let (name, mut builder) = match runtime {
            "multi-thread" => ("multi-thread", tokio::runtime::Builder::new_multi_thread()),
            "current_thread" => (
                "current_thread",
                tokio::runtime::Builder::new_current_thread(),
            ),
            other => panic!("--runtime {other}: multi-thread or current_thread"),
        };
        let rt = builder.enable_all().build().expect("runtime");
        for servers in &clusters {
            for &nodelay in &nodelays {
                let setup = Setup {
                    runtime: name,
                    nodes: servers.len(),
                    nodelay,
                };
                rt.block_on(measure(setup, servers, &config, &mut samples));
            }
        }
    }
    print_tables(&samples, &config);
}

async fn measure(
    setup: Setup,
    servers: &[RedisServer],
    config: &Config,
    samples: &mut Vec<Sample>,
) {
    let locker = Redlock::connect(servers.iter().map(|s| s.url()), options())
        .await
        .expect("locker");
    let layer = Router::new()
        .route("/work", post(|| async { "ok" }))
        .route_layer(LockLayer::new(locker, header("Idempotency-Key")));
    let raw = raw_router(servers).await;
    for rep in 0..config.reps {
        // Each route goes first in turn: a drift of the machine's load over a
        // repetition then favours neither.
        let mut order = [(Route::Layer, &layer), (Route::Raw, &raw)];
        order.rotate_left(rep % 2);
        for (route, router) in order {
            let sample = run(setup, route, rep, router.clone(), servers, config).await;
            eprintln!(
                "{} {} node(s) nodelay {} rep {} {}: {:.0} req/s, p50 {:.3} ms, p99 {:.3} ms, {} errors (load {})",
                setup.runtime,
                setup.nodes,
                setup.nodelay,
                rep + 1,
                route.name(),
                sample.rps,
                sample.p50.as_secs_f64() * 1e3,
                sample.p99.as_secs_f64() * 1e3,
                sample.errors,
                common::loadavg(),
            );
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
            include_str!("../src/node/redis/scripts/held.lua"),
            include_str!("../src/node/redis/scripts/release.lua"),
            include_str!("../src/node/redis/scripts/hand_off.lua"),
            include_str!("../src/node/redis/scripts/release_queued.lua")
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

/// One row: `router` served on a loopback port, driven by `config.conns` keep-alive
/// connections for the warm-up and then `config.secs`.
async fn run(
    setup: Setup,
    route: Route,
    rep: usize,
    router: Router,
    servers: &[RedisServer],
    config: &Config,
) -> Sample {
    // Every row starts from empty nodes: the layer's fence counters (one per key) would
    // otherwise grow the keyspace under the next row.
    servers.iter().for_each(RedisServer::flushall);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let nodelay = setup.nodelay;
    let listener = listener.tap_io(move |tcp| {
        if nodelay {
            let _ = tcp.set_nodelay(true);
        }
    });
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let start = Instant::now();
    let (measured, end) = (start + WARM_UP, start + WARM_UP + config.secs);
    let tag = format!(
        "{}-{}-{}-{route:?}-{rep}",
        setup.runtime, setup.nodes, nodelay
    );
    let clients: Vec<_> = (0..config.conns)
        .map(|c| {
            let tag = format!("{tag}-{c}");
            tokio::spawn(async move {
                let mut conn = Conn::open(addr).await;
                let (mut latencies, mut errors) = (Vec::new(), 0);
                for i in 0.. {
                    let sent = Instant::now();
                    if sent >= end {
                        break;
                    }
                    let request =
                        Req::post("/work").header("idempotency-key", &format!("{tag}-{i}"));
                    let reply = conn.send(request).await;
                    if sent >= measured {
                        latencies.push(sent.elapsed());
                        errors += usize::from(reply.status != 200);
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    tokio::time::sleep_until(measured.into()).await;
    common::reset_stats(servers);
    let cpu0 = common::own_cpu();
    let mut latencies = Vec::new();
    let mut errors = 0;
    for client in join_all(clients).await {
        let (l, e) = client.expect("client");
        latencies.extend(l);
        errors += e;
    }
    let cpu = common::own_cpu() - cpu0;
    let elapsed = measured.elapsed();
    server.abort();
    latencies.sort();
    let n = latencies.len().max(1) as f64;
    Sample {
        setup,
        route,
        rep,
        rps: n / elapsed.as_secs_f64(),
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        errors,
        commands: common::commands(servers) as f64 / n,
        cpu_us: cpu.as_secs_f64() * 1e6 / n,
    }
}

fn print_tables(samples: &[Sample], config: &Config) {
    let mut setups: Vec<Setup> = Vec::new();
    for s in samples {
        if !setups.contains(&s.setup) {
            setups.push(s.setup);
        }
    }
    let of = |setup: Setup, route: Route| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.setup == setup && s.route == route)
            .collect()
    };
    let med = |rows: &[&Sample], f: fn(&Sample) -> f64| median(rows.iter().map(|s| f(s)));
    let listener = |setup: Setup| {
        if setup.nodelay {
            "TCP_NODELAY"
        } else {
            "default"
        }
    };
    println!();
    println!(
        "{} keep-alive connections, {:.1} s per row after {:.1} s of warm-up, medians of {} repetitions. Load average: {}",
        config.conns,
        config.secs.as_secs_f64(),
        WARM_UP.as_secs_f64(),
        config.reps,
        common::loadavg()
    );
    println!();
    println!("| runtime | nodes | listener | route | requests/s | p50 (ms) | p99 (ms) | non-200 | Redis commands / request | CPU (µs / request) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &setup in &setups {
        for route in [Route::Layer, Route::Raw] {
            let rows = of(setup, route);
            println!(
                "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {} | {:.1} | {:.0} |",
                setup.runtime,
                setup.nodes,
                listener(setup),
                route.name(),
                thousands(med(&rows, |s| s.rps)),
                med(&rows, |s| s.p50.as_secs_f64() * 1e3),
                med(&rows, |s| s.p99.as_secs_f64() * 1e3),
                rows.iter().map(|s| s.errors).sum::<usize>(),
                med(&rows, |s| s.commands),
                med(&rows, |s| s.cpu_us),
            );
        }
    }
    println!();
    println!("| runtime | nodes | listener | requests/s LockLayer / raw | p50 LockLayer − raw (ms) | target ≥ 0.9×, ≤ 1 ms |");
    println!("|---|---|---|---|---|---|");
    for &setup in &setups {
        let (layer, raw) = (of(setup, Route::Layer), of(setup, Route::Raw));
        let pairs: Vec<(&Sample, &Sample)> = layer
            .iter()
            .filter_map(|l| Some((*l, *raw.iter().find(|r| r.rep == l.rep)?)))
            .collect();
        let ratio = median(pairs.iter().map(|(l, r)| l.rps / r.rps));
        let p50 = median(
            pairs
                .iter()
                .map(|(l, r)| (l.p50.as_secs_f64() - r.p50.as_secs_f64()) * 1e3),
        );
        println!(
            "| {} | {} | {} | {ratio:.2}× | {p50:+.3} | {} |",
            setup.runtime,
            setup.nodes,
            listener(setup),
            if ratio >= 0.9 && p50 <= 1.0 {
                "met"
            } else {
                "not met"
            },
        );
    }
}
