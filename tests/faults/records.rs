//! Scenario 14: idempotency records across a rolling restart of nodes that persist
//! nothing (`--save '' --appendonly no`): every node restarted empty, one at a time.

use super::*;

use std::collections::HashMap;

use crate::http_client::{Req, Served};
use axum::Extension;
use tower_redlock::http::{key::header, replay::Replay, LockLayer, RequestKey};

/// Payments on three nodes without persistence, then every node restarted empty, one
/// at a time: first with a retry of every payment after each restart, then two nodes
/// restarted back to back with no request in between (the record then lives on one
/// node only), a retry, and the last node. Two app instances (lockers); each retry goes
/// to either.
///
/// Asserted: exactly one side effect (charge) per key, and every retry answered with
/// the first charge's response, replayed: a completed record found on any node that
/// answers is replayed and written back to the nodes that lost it. (Restarting every
/// node with no request in between loses the records: nothing can keep what no node
/// has. Not asserted here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_records_survive_a_rolling_restart_of_nodes_without_persistence() {
    let _serial = SERIAL.lock().await;
    let mut servers = RedisServer::start_many(3);
    let lockers = lockers(2, &urls(&servers), &support::patient());
    let charges: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut instances = Vec::new();
    for locker in &lockers {
        let charges = charges.clone();
        let app = axum::Router::new()
            .route(
                "/charges",
                axum::routing::post(move |Extension(key): Extension<RequestKey>| {
                    let charges = charges.clone();
                    async move {
                        let mut charges = charges.lock().unwrap_or_else(|p| p.into_inner());
                        let count = charges.entry(key.as_str().to_owned()).or_insert(0);
                        *count += 1;
                        (
                            axum::http::StatusCode::CREATED,
                            format!("charge {count} of {}", key.as_str()),
                        )
                    }
                }),
            )
            .route_layer(
                LockLayer::new(locker.clone(), header("Idempotency-Key")).replay(Replay::global()),
            );
        instances.push(Served::start(app).await);
    }
    let keys =
        |phase: &str| -> Vec<String> { (0..n(20)).map(|i| format!("{phase}-{i}")).collect() };
    let mut replays = 0;
    // Every key once through instance `first`, or again (a retry) through either.
    let pay = |key: String, instance: usize, retry: bool| {
        let served = &instances[instance % instances.len()];
        async move {
            let request = Req::post("/charges").header("idempotency-key", &key);
            let reply = served.send(request).await;
            assert_eq!(reply.status, 201, "{key}: {}", reply.text());
            assert_eq!(reply.text(), format!("charge 1 of {key}"), "{key}");
            let replayed = reply.header("idempotent-replayed") == Some("true");
            assert_eq!(
                replayed, retry,
                "{key}: replayed {replayed}, a retry {retry}"
            );
        }
    };

    // With a retry of every payment after each restart.
    let between = keys("between");
    for (i, key) in between.iter().enumerate() {
        pay(key.clone(), i, false).await;
    }
    for (k, server) in servers.iter_mut().enumerate() {
        tokio::task::block_in_place(|| server.restart());
        for (i, key) in between.iter().enumerate() {
            pay(key.clone(), i + k, true).await;
            replays += 1;
        }
    }

    // Two nodes restarted with nothing in between: one node keeps the records.
    let quiet = keys("quiet");
    for (i, key) in quiet.iter().enumerate() {
        pay(key.clone(), i, false).await;
    }
    for k in [0, 1] {
        tokio::task::block_in_place(|| servers[k].restart());
    }
    for round in 0..2 {
        for (i, key) in quiet.iter().enumerate() {
            pay(key.clone(), i + round, true).await;
            replays += 1;
        }
        if round == 0 {
            tokio::task::block_in_place(|| servers[2].restart());
        }
    }

    let charges = charges.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for key in between.iter().chain(&quiet) {
        assert_eq!(
            charges.get(key),
            Some(&1),
            "{key}: charged {:?} times",
            charges.get(key)
        );
    }
    assert_eq!(charges.len(), between.len() + quiet.len());
    println!(
        "[faults] s14: {} keys, each charged once; {replays} retries replayed across 5 restarts of empty nodes",
        charges.len()
    );
}
