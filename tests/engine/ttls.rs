//! Every key the crate writes on a Redis node has a ttl, on every path: a key locked
//! once (an idempotency key) must not leave anything on the nodes for good.
//!
//! Every server is spawned by `support` on a free 127.0.0.1 port.
use crate::support;

use std::time::Duration;

use bytes::Bytes;
use support::{eventually, RedisServer};
use tower_redlock::{LockMode, LockOptions, Redlock};

const LIMIT: Duration = Duration::from_secs(10);

fn locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    Redlock::from_urls(urls, options.node_timeout(support::PATIENT_NODE_TIMEOUT)).unwrap()
}

/// Every key of every server that has no ttl, with its server.
fn keys_without_ttl(servers: &[RedisServer]) -> Vec<String> {
    servers
        .iter()
        .flat_map(|server| {
            let keys = server.keys("*");
            keys.into_iter()
                .filter(|key| server.pttl(key) == -1)
                .map(move |key| format!("{key} on {}", server.port()))
        })
        .collect()
}

/// Waits until `key` exists on every server.
async fn on_every_server(servers: &[RedisServer], key: &str) {
    eventually(&format!("{key} on every server"), LIMIT, || {
        servers.iter().all(|server| server.exists(key))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_written_on_every_path_has_a_ttl() {
    let servers = RedisServer::start_many(3);
    let fenced = locker(&servers, LockOptions::default());
    let plain = locker(&servers, LockOptions::default().fencing(false));
    let other = locker(&servers, LockOptions::default());

    // The single acquire: pipelined (fenced, not waiting) and plain, on keys locked once.
    for i in 0..20 {
        let lease = fenced.try_acquire(format!("once-{i}")).await.unwrap();
        lease.release().await;
        let lease = plain.try_acquire(format!("plain-{i}")).await.unwrap();
        lease.release().await;
    }
    // The acquire script's fast path, which a Cluster's single acquire takes (sent to a
    // standalone server by the test hook).
    let scripted = locker(
        &servers,
        LockOptions::default().unsafe_fence_seed_only_when_missing(),
    );
    for i in 0..3 {
        let lease = scripted.try_acquire(format!("scripted-{i}")).await.unwrap();
        lease.release().await;
    }
    // A set, once.
    let set = fenced.try_acquire_all(["set-a", "set-b"]).await.unwrap();
    set.release().await;

    // The write-back of a token: one node's counter ahead of the others, for one
    // resource and for a set.
    for key in ["{raised}:fence", "{raised-a}:fence"] {
        servers[0].cmd(&[
            "SET",
            &format!("redlock:{key}"),
            "4000000000000000",
            "PX",
            "60000",
        ]);
    }
    fenced.try_acquire("raised").await.unwrap().release().await;
    let set = fenced
        .try_acquire_all(["raised-a", "raised-b"])
        .await
        .unwrap();
    set.release().await;

    // Records: a stored one, and an interrupted claim that the next holder finds.
    let lease = fenced.try_acquire("record").await.unwrap();
    lease
        .claim_record(b"fp", Duration::from_secs(30), None)
        .await
        .unwrap();
    lease
        .store_record(b"fp", Bytes::from_static(b"done"), Duration::from_secs(60))
        .await
        .unwrap();
    lease.release().await;
    let lease = fenced.try_acquire("interrupted").await.unwrap();
    lease
        .claim_record(b"fp", Duration::from_secs(30), None)
        .await
        .unwrap();
    lease.release().await;
    let lease = fenced.try_acquire("interrupted").await.unwrap();
    lease
        .claim_record(b"fp", Duration::from_secs(30), None)
        .await
        .unwrap();
    lease.release().await;

    // Held while scanned: a waiter queued behind a holder (the acquire script, the
    // queue), a writer waiting for readers (its intent), permits (their limit), and a
    // set waiting on a held member (the queue's listeners' mark).
    let holder = fenced.try_acquire("queued").await.unwrap();
    let queued = {
        let other = other.clone();
        tokio::spawn(async move { other.acquire("queued", LIMIT).await.map(drop) })
    };
    on_every_server(&servers, "redlock:{queued}:queue").await;
    let reader = fenced
        .try_acquire_as("read", LockMode::Shared)
        .await
        .unwrap();
    let writer = {
        let other = other.clone();
        tokio::spawn(async move {
            other
                .acquire_as("read", LockMode::Exclusive, LIMIT)
                .await
                .map(drop)
        })
    };
    on_every_server(&servers, "redlock:{read}:writer").await;
    let permits = LockMode::counted(2).unwrap();
    let first = fenced.try_acquire_as("permits", permits).await.unwrap();
    let second = other.try_acquire_as("permits", permits).await.unwrap();
    let set_holder = fenced.try_acquire("set-held").await.unwrap();
    let set_waiter = {
        let other = other.clone();
        tokio::spawn(async move {
            other
                .acquire_all(["set-held", "set-free"], LIMIT)
                .await
                .map(drop)
        })
    };
    on_every_server(&servers, "redlock:{set-held}:queue").await;

    assert_eq!(keys_without_ttl(&servers), Vec::<String>::new());

    holder.release().await;
    reader.release().await;
    set_holder.release().await;
    for waiter in [queued, writer, set_waiter] {
        tokio::time::timeout(LIMIT, waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    first.release().await;
    second.release().await;

    assert_eq!(keys_without_ttl(&servers), Vec::<String>::new());
}
