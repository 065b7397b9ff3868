//! tower-redlock in the anchors' harness (`../shared/anchors`): the same scenarios and
//! the same one-line JSON result as the other libraries' binaries, so `run_all.sh`
//! can put us in the same table (`EXTRA_IMPL="tower-redlock=$PWD/benches/anchor.sh"`).
//!
//! `cargo bench --bench anchor -- --scenario S1|S2|S3|S3ffa --ports 7101[,7102,7103]`
//! against Redis nodes that are already running (the harness starts them).
//!
//! Scenarios: S1 one task, acquire+release on distinct keys; S2 64 tasks on distinct
//! keys; S3 16 tasks on one key, ~1 ms hold, a releaser waits until another task
//! acquired (strict hand-off); S3ffa the same without that rule.
//!
//! `--baseline fenced` (S1/S2 only) runs, instead of the crate, the same round trips
//! written by hand with redis-rs: what the crate pipelines for a caller that does not
//! wait (`SET NX PX`, `EXISTS` of the wait queue, the fence script) on every node, a
//! quorum, then the crate's release script. The anchors' raw
//! limit does less work (a bare `SET NX PX`, no fence); this baseline separates what
//! the crate costs from what fencing costs Redis.
//!
//! Environment: `NO_FENCING=1` turns fencing off, `NO_WATCHDOG=1` the watchdog;
//! `TCP_NODELAY=0` opens the nodes with `tcp_nodelay=false` (Nagle's algorithm, as
//! redis-rs, rslock and the hand-written baselines run); `ANCHOR_RT=current_thread`
//! picks the runtime; `NODE_TIMEOUT_MS` the per-node timeout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_redlock::{LockOptions, Redlock};

struct Args {
    scenario: String,
    ports: Vec<u16>,
    variant: String,
    cycles: usize,
    tasks: usize,
    target: usize,
    hold: Duration,
    fenced_baseline: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        scenario: "S1".into(),
        ports: vec![7101],
        variant: "default".into(),
        cycles: 0,
        tasks: 0,
        target: 1000,
        hold: Duration::from_millis(1),
        fenced_baseline: false,
    };
    let argv: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    for pair in argv.chunks(2) {
        let [flag, value] = pair else {
            panic!("flags come in pairs: {argv:?}");
        };
        match flag.as_str() {
            "--scenario" => args.scenario = value.clone(),
            "--ports" => {
                args.ports = value.split(',').map(|p| p.parse().expect("port")).collect();
            }
            "--variant" => args.variant = value.clone(),
            "--cycles" => args.cycles = value.parse().expect("cycles"),
            "--conc" => args.tasks = value.parse().expect("conc"),
            "--target" => args.target = value.parse().expect("target"),
            "--hold-ms" => {
                args.hold = Duration::from_secs_f64(value.parse::<f64>().expect("hold") / 1e3)
            }
            "--baseline" => args.fenced_baseline = value == "fenced",
            other => panic!("unknown flag {other}"),
        }
    }
    if args.cycles == 0 {
        args.cycles = if args.scenario == "S1" { 5000 } else { 20000 };
    }
    if args.tasks == 0 {
        args.tasks = match args.scenario.as_str() {
            "S1" => 1,
            "S2" => 64,
            _ => 16,
        };
    }
    args
}

fn main() {
    let args = parse_args();
    let runtime = match std::env::var("ANCHOR_RT").as_deref() {
        Ok("current_thread") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        _ => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    }
    .expect("runtime");
    let line = runtime.block_on(run(&args));
    println!("{line}");
}

async fn run(args: &Args) -> String {
    // `TCP_NODELAY=0`: the transport the other Rust clients run with (redis-rs's default,
    // Nagle's algorithm), instead of the crate's default.
    let nodelay = if std::env::var("TCP_NODELAY").as_deref() == Ok("0") {
        "?tcp_nodelay=false"
    } else {
        ""
    };
    let urls = args
        .ports
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}/0{nodelay}"));
    let options = LockOptions::default()
        .ttl(Duration::from_secs(30))
        .watchdog(std::env::var("NO_WATCHDOG").is_err())
        .fencing(std::env::var("NO_FENCING").is_err())
        // Profiling under valgrind (callgrind counts instructions, ~50× slower) needs
        // a node timeout far above the 200 ms default.
        .node_timeout(Duration::from_millis(
            std::env::var("NODE_TIMEOUT_MS")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .unwrap_or(50),
        ));
    let locker = Redlock::connect(urls, options).await.expect("locker");
    // `SPIN=1`: a task that always yields keeps the runtime from ever sleeping in
    // `epoll_wait`, as the raw redis-rs client's runtime never does under S1 on
    // current_thread (BENCHMARKS.md, session 12). A measurement aid, not a setting.
    if std::env::var_os("SPIN").is_some() {
        tokio::spawn(async {
            loop {
                tokio::task::yield_now().await;
            }
        });
    }
    let prefix = format!("bench:tower-redlock:{}", std::process::id());
    let mut fields: Vec<(&str, String)> = Vec::new();
    let subject = if args.fenced_baseline {
        Subject::Fenced(Arc::new(FencedRaw::connect(&args.ports).await))
    } else {
        Subject::Crate(locker.clone())
    };
    match args.scenario.as_str() {
        "S1" | "S2" => {
            let warm_up = (args.cycles / 10).max(args.tasks);
            cycles(&subject, &format!("{prefix}:w"), warm_up, args.tasks).await;
            let start = Instant::now();
            let mut latencies =
                cycles(&subject, &format!("{prefix}:m"), args.cycles, args.tasks).await;
            let elapsed = start.elapsed().as_secs_f64();
            latencies.sort_by(f64::total_cmp);
            fields.push(("ops", args.cycles.to_string()));
            fields.push(("conc", args.tasks.to_string()));
            fields.push(("elapsed_s", num(elapsed)));
            fields.push(("ops_per_s", num(args.cycles as f64 / elapsed)));
            fields.push(("acq_p50_us", num(percentile(&latencies, 50.0))));
            fields.push(("acq_p99_us", num(percentile(&latencies, 99.0))));
        }
        "S3" | "S3ffa" => {
            let strict = args.scenario == "S3";
            fields.extend(contended(&locker, &format!("{prefix}:hot"), args, strict).await);
        }
        other => panic!("unknown scenario {other}"),
    }
    let name = if args.fenced_baseline {
        "raw-fenced"
    } else {
        "tower-redlock"
    };
    let mut out = format!(
        "{{\"impl\":\"{name}\",\"lang\":\"rust\",\"scenario\":\"{}\",\"variant\":\"{}\",\"nodes\":{}",
        args.scenario,
        args.variant,
        args.ports.len()
    );
    for (key, value) in fields {
        out.push_str(&format!(",\"{key}\":{value}"));
    }
    out.push('}');
    out
}

/// `total` acquire+release cycles on distinct keys over `tasks` tasks; acquire
/// latencies in µs.
async fn cycles(subject: &Subject, prefix: &str, total: usize, tasks: usize) -> Vec<f64> {
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (subject, next, prefix) = (subject.clone(), next.clone(), prefix.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(total / tasks + 1);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return latencies;
                    }
                    let key = format!("{prefix}:{i}");
                    subject.cycle(key, &mut latencies).await;
                }
            })
        })
        .collect();
    let mut all = Vec::with_capacity(total);
    for worker in workers {
        all.extend(worker.await.expect("worker"));
    }
    all
}

/// What S1/S2 measure: the crate, or the same round trips written by hand.
#[derive(Clone)]
enum Subject {
    Crate(Redlock),
    Fenced(Arc<FencedRaw>),
}

impl Subject {
    /// One acquire + release on a fresh key; records the acquire latency in µs.
    async fn cycle(&self, key: String, latencies: &mut Vec<f64>) {
        let start = Instant::now();
        match self {
            Subject::Crate(locker) => {
                let lease = locker.try_acquire(key).await.expect("uncontended acquire");
                latencies.push(start.elapsed().as_secs_f64() * 1e6);
                lease.release().await;
            }
            Subject::Fenced(raw) => {
                let owner = raw.acquire(&key).await;
                latencies.push(start.elapsed().as_secs_f64() * 1e6);
                raw.release(&key, &owner).await;
            }
        }
    }
}

/// The crate's round trips by hand: one multiplexed connection per node, the crate's
/// pipeline for a caller that does not wait (lock key, the wait queue's check, the fence
/// script: the counter floored by the clock) on every node at once, return at a quorum
/// (stragglers finish in the background), then
/// the release script on every node. The same server work as the crate, none of its
/// client work.
struct FencedRaw {
    conns: Vec<redis::aio::MultiplexedConnection>,
    quorum: usize,
    acquire: redis::Script,
    release: redis::Script,
    next: std::sync::atomic::AtomicU64,
}

impl FencedRaw {
    async fn connect(ports: &[u16]) -> FencedRaw {
        // The crate's scripts as the crate sends them: the fence script pipelined behind
        // SET NX PX and EXISTS of the queue; the release script.
        let acquire = redis::Script::new(concat!(
            include_str!("../src/node/redis/scripts/fence_rule.lua"),
            include_str!("../src/node/redis/scripts/fence.lua")
        ));
        let mut conns = Vec::new();
        for port in ports {
            let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).expect("url");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("connect");
            // Loaded once, so that every acquire is a plain EVALSHA.
            let _: String = acquire
                .prepare_invoke()
                .load_async(&mut conn)
                .await
                .expect("SCRIPT LOAD");
            conns.push(conn);
        }
        FencedRaw {
            quorum: conns.len() / 2 + 1,
            conns,
            acquire,
            release: redis::Script::new(concat!(
                include_str!("../src/node/redis/scripts/held.lua"),
                include_str!("../src/node/redis/scripts/release.lua"),
                include_str!("../src/node/redis/scripts/hand_off.lua"),
                include_str!("../src/node/redis/scripts/release_queued.lua")
            )),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    async fn acquire(&self, key: &str) -> String {
        use futures_util::stream::{FuturesUnordered, StreamExt};
        let owner = format!(
            "{:x}-{}",
            std::process::id(),
            self.next.fetch_add(1, Ordering::Relaxed)
        );
        let floor = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64 * 1024)
            .to_string();
        let mut calls: FuturesUnordered<_> = self
            .conns
            .iter()
            .map(|conn| {
                let mut conn = conn.clone();
                // What the crate sends for a caller that does not wait (`try_acquire`).
                let mut pipe = redis::pipe();
                pipe.cmd("SET")
                    .arg(format!("{{{key}}}"))
                    .arg(&owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .cmd("EXISTS")
                    .arg(format!("{{{key}}}:queue"))
                    .cmd("EVALSHA")
                    .arg(self.acquire.get_hash())
                    .arg(1)
                    .arg(format!("{{{key}}}:fence"))
                    .arg(&floor);
                async move {
                    let reply: redis::RedisResult<(Option<String>, i64, u64)> =
                        pipe.query_async(&mut conn).await;
                    matches!(reply, Ok((Some(_), 0, _)))
                }
            })
            .collect();
        let mut granted = 0;
        while let Some(ok) = calls.next().await {
            granted += usize::from(ok);
            if granted >= self.quorum {
                break;
            }
        }
        if !calls.is_empty() {
            tokio::spawn(calls.for_each(|_| async {}));
        }
        assert!(granted >= self.quorum, "uncontended acquire");
        owner
    }

    async fn release(&self, key: &str, owner: &str) {
        let calls = self.conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let mut invocation = self.release.prepare_invoke();
            invocation
                .key(format!("{{{key}}}"))
                .key(format!("{{{key}}}:queue"))
                .arg(owner);
            async move {
                let _: redis::RedisResult<i64> = invocation.invoke_async(&mut conn).await;
            }
        });
        futures_util::future::join_all(calls).await;
    }
}

#[derive(Default)]
struct Contention {
    count: usize,
    last_release: Option<Instant>,
    last_holder: usize,
    same_holder: usize,
    handoffs: Vec<f64>,
    holds: Vec<f64>,
    done: Option<Instant>,
}

async fn contended(
    locker: &Redlock,
    key: &str,
    args: &Args,
    strict: bool,
) -> Vec<(&'static str, String)> {
    let warm = locker
        .acquire(format!("{key}:warm"), Duration::from_secs(5))
        .await
        .expect("warm-up");
    warm.release().await;
    let state = Arc::new(Mutex::new(Contention::default()));
    let (acquired_tx, acquired_rx) = tokio::sync::watch::channel(0usize);
    let acquired_tx = Arc::new(acquired_tx);
    let (target, hold) = (args.target, args.hold);
    let start = Instant::now();
    let tasks: Vec<_> = (1..=args.tasks)
        .map(|me| {
            let (locker, state, key) = (locker.clone(), state.clone(), key.to_owned());
            let (acquired_tx, mut acquired_rx) = (acquired_tx.clone(), acquired_rx.clone());
            tokio::spawn(async move {
                loop {
                    if state.lock().unwrap().count >= target {
                        return;
                    }
                    let lease = locker
                        .acquire(key.as_str(), Duration::from_secs(600))
                        .await
                        .expect("contended acquire");
                    let now = Instant::now();
                    let mine = {
                        let mut s = state.lock().unwrap();
                        if s.count >= target {
                            0
                        } else {
                            s.count += 1;
                            if let Some(released) = s.last_release {
                                s.handoffs.push((now - released).as_secs_f64() * 1e6);
                            }
                            if s.last_holder == me {
                                s.same_holder += 1;
                            }
                            s.last_holder = me;
                            acquired_tx.send_replace(s.count);
                            s.count
                        }
                    };
                    if mine == 0 {
                        lease.release().await;
                        return;
                    }
                    tokio::task::spawn_blocking(move || std::thread::sleep(hold))
                        .await
                        .expect("hold");
                    let released = Instant::now();
                    {
                        let mut s = state.lock().unwrap();
                        s.last_release = Some(released);
                        s.holds.push((released - now).as_secs_f64() * 1e6);
                    }
                    lease.release().await;
                    if mine == target {
                        state.lock().unwrap().done = Some(Instant::now());
                    }
                    if strict {
                        let _ = acquired_rx.wait_for(|c| *c > mine || *c >= target).await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let mut s = state.lock().unwrap();
    let total = (s.done.expect("finished") - start).as_secs_f64();
    s.handoffs.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    vec![
        ("ops", target.to_string()),
        ("conc", args.tasks.to_string()),
        ("elapsed_s", num(total)),
        ("ops_per_s", num(target as f64 / total)),
        ("handoff_p50_us", num(percentile(&s.handoffs, 50.0))),
        ("handoff_p99_us", num(percentile(&s.handoffs, 99.0))),
        ("handoff_mean_us", num(mean(&s.handoffs))),
        ("hold_mean_us", num(mean(&s.holds))),
        (
            "same_holder_frac",
            num(s.same_holder as f64 / target as f64),
        ),
    ]
}

/// Nearest-rank percentile of an ascending slice.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "null".into()
    }
}
