//! The etcd node against etcd-client's own `lock` API doing the same work, over one
//! 3-member etcd cluster spawned on loopback (issue 20). See BENCHMARKS.md.
//!
//! - S1: one acquire + release, sequentially: latency p50 / p99.
//! - S2: 64 tasks on distinct keys: acquisitions per second.
//! - S3: 8 contenders (8 lockers / 8 clients: 8 processes as far as the lock can tell)
//!   on one key: hand-offs per second.
//!
//! The same work on both sides: a lease with the ttl, the lock, the unlock, the lease
//! revoked. `cargo bench --bench etcd [-- --quick]`.
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use etcd_client::{Client, LockOptions as EtcdLockOptions};
use support::etcd::EtcdCluster;
use tower_redlock::{LockOptions, Redlock};

const TTL: Duration = Duration::from_secs(10);

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(TTL)
        .node_timeout(Duration::from_secs(2))
}

async fn client(cluster: &EtcdCluster) -> Client {
    let endpoints: Vec<String> = cluster
        .endpoints()
        .into_iter()
        .map(|e| format!("http://{e}"))
        .collect();
    Client::connect(endpoints, None).await.expect("etcd client")
}

/// etcd-client's lock API, one acquisition: lease, lock, unlock, revoke.
async fn etcd_lock_once(client: &mut Client, name: &str) {
    let lease = client
        .lease_grant(TTL.as_secs() as i64, None)
        .await
        .unwrap()
        .id();
    let locked = client
        .lock(name, Some(EtcdLockOptions::new().with_lease(lease)))
        .await
        .unwrap();
    client.unlock(locked.key()).await.unwrap();
    client.lease_revoke(lease).await.unwrap();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (s1, s2_per_task, s3) = if quick { (50, 5, 50) } else { (300, 20, 300) };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cluster = EtcdCluster::start(3);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at start: {}", load.trim());
    runtime.block_on(async {
        let url = cluster.url("bench");
        let locker = Redlock::from_urls([url.as_str()], options()).unwrap();
        let mut etcd = client(&cluster).await;
        // Warm-up: connections, the first lease.
        for i in 0..10 {
            locker.try_acquire(format!("warm:{i}")).await.unwrap().release().await;
            etcd_lock_once(&mut etcd, &format!("bench-lock/warm:{i}")).await;
        }

        // S1
        let mut ours = Vec::with_capacity(s1);
        let mut theirs = Vec::with_capacity(s1);
        for i in 0..s1 {
            let start = Instant::now();
            let lease = locker.try_acquire(format!("s1:{i}")).await.unwrap();
            lease.release().await;
            ours.push(start.elapsed());
            let start = Instant::now();
            etcd_lock_once(&mut etcd, &format!("bench-lock/s1:{i}")).await;
            theirs.push(start.elapsed());
        }
        ours.sort();
        theirs.sort();
        let (o50, o99, t50, t99) = (
            percentile(&ours, 0.5),
            percentile(&ours, 0.99),
            percentile(&theirs, 0.5),
            percentile(&theirs, 0.99),
        );
        println!("| S1 acquire + release, {s1} sequential | p50 {:.2} ms, p99 {:.2} ms | p50 {:.2} ms, p99 {:.2} ms | {:.2}× |", ms(o50), ms(o99), ms(t50), ms(t99), ms(o50) / ms(t50));

        // S2: 64 tasks, distinct keys.
        let start = Instant::now();
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let locker = locker.clone();
                tokio::spawn(async move {
                    for i in 0..s2_per_task {
                        locker
                            .try_acquire(format!("s2:{t}:{i}"))
                            .await
                            .unwrap()
                            .release()
                            .await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let ours = (64 * s2_per_task) as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let mut etcd = etcd.clone();
                tokio::spawn(async move {
                    for i in 0..s2_per_task {
                        etcd_lock_once(&mut etcd, &format!("bench-lock/s2:{t}:{i}")).await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let theirs = (64 * s2_per_task) as f64 / start.elapsed().as_secs_f64();
        println!("| S2 64 tasks, distinct keys, {} acquisitions | {ours:.0}/s | {theirs:.0}/s | {:.2}× |", 64 * s2_per_task, ours / theirs);

        // S3: 8 contenders on one key, each its own locker or client.
        let per = s3 / 8;
        let lockers: Vec<Redlock> = (0..8)
            .map(|_| Redlock::from_urls([url.as_str()], options()).unwrap())
            .collect();
        let start = Instant::now();
        let tasks: Vec<_> = lockers
            .into_iter()
            .map(|locker| {
                tokio::spawn(async move {
                    for _ in 0..per {
                        locker
                            .acquire("s3", Duration::from_secs(60))
                            .await
                            .unwrap()
                            .release()
                            .await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let ours = (8 * per) as f64 / start.elapsed().as_secs_f64();
        let mut clients = Vec::new();
        for _ in 0..8 {
            clients.push(client(&cluster).await);
        }
        let start = Instant::now();
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|mut etcd| {
                tokio::spawn(async move {
                    for _ in 0..per {
                        etcd_lock_once(&mut etcd, "bench-lock/s3").await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let theirs = (8 * per) as f64 / start.elapsed().as_secs_f64();
        println!("| S3 8 contenders, one key, {} hand-offs | {ours:.0}/s | {theirs:.0}/s | {:.2}× |", 8 * per, ours / theirs);
    });
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
}
