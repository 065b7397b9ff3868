//! Shared and counted acquisition against exclusive (issue 38), side by side in one run.
//!
//! `cargo bench --bench modes` spawns its own redis-server nodes on free loopback ports
//! (the `tests/support` helper) and prints a markdown table. Over 1 and 3 nodes, for
//! each mode — exclusive, shared (a reader), counted (one of 3 permits) — 16 tasks each
//! run `try_acquire_as` + `release` cycles on distinct resources (uncontended: what the
//! mode itself costs a lease), watchdog on. Each cell is cycles per second, the median
//! of the repetitions, with the ratio to exclusive on the same nodes in the same
//! repetition. A warm-up pass of each row runs first.
//!
//! Options: `-- --cycles N` per task (default 500), `-- --reps N` (default 3).

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::RedisServer;
use tokio::task::JoinSet;
use tower_redlock::{LockMode, LockOptions, Redlock};

const TASKS: usize = 16;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn modes() -> [(&'static str, LockMode); 3] {
    [
        ("exclusive", LockMode::Exclusive),
        ("shared", LockMode::Shared),
        ("counted (3)", LockMode::counted(3).expect("3 permits")),
    ]
}

/// Cycles per second of `TASKS` tasks × `cycles` acquire + release in `mode`.
async fn run(locker: &Redlock, mode: LockMode, cycles: usize, round: usize) -> f64 {
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for task in 0..TASKS {
        let locker = locker.clone();
        tasks.spawn(async move {
            for cycle in 0..cycles {
                let resource = format!("bench-modes:{round}:{task}:{cycle}");
                let lease = locker
                    .try_acquire_as(resource.as_str(), mode)
                    .await
                    .expect("an uncontended acquisition");
                lease.release().await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a bench task");
    }
    (TASKS * cycles) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() {
    let cycles = arg("--cycles", 500);
    let reps = arg("--reps", 3).max(1);
    println!("| nodes | mode | cycles/s (median of {reps}) | / exclusive |\n|---|---|---|---|");
    let mut round = 0;
    for nodes in [1, 3] {
        let servers = RedisServer::start_many(nodes);
        let options = LockOptions::default().node_timeout(Duration::from_secs(2));
        let locker = Redlock::connect(servers.iter().map(RedisServer::url), options)
            .await
            .expect("connect");
        // Per mode, per repetition: the rate, and its ratio to exclusive's in that one.
        let mut rates = vec![Vec::new(); modes().len()];
        let mut ratios = vec![Vec::new(); modes().len()];
        for (_, mode) in modes() {
            round += 1;
            run(&locker, mode, cycles / 5 + 1, round).await;
        }
        for _ in 0..reps {
            let mut exclusive = 0.0;
            for (index, (_, mode)) in modes().into_iter().enumerate() {
                round += 1;
                let rate = run(&locker, mode, cycles, round).await;
                if index == 0 {
                    exclusive = rate;
                }
                rates[index].push(rate);
                ratios[index].push(rate / exclusive);
            }
        }
        for (index, (name, _)) in modes().into_iter().enumerate() {
            println!(
                "| {nodes} | {name} | {:.0} | {:.2}× |",
                median(rates[index].clone()),
                median(ratios[index].clone())
            );
        }
    }
}
