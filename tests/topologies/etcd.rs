//! The etcd node (feature `etcd`) against real etcd clusters of three members spawned
//! on loopback: the engine's rules, faults, and the HTTP layer with replay.
//!
//! Tests that only lock share one cluster (distinct resources per test); tests that
//! kill members start their own. No sleeps sequence anything: waits are on events,
//! bounded by limits reached only when a test fails. No timing is asserted.
use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::etcd::EtcdCluster;
use support::eventually_async;
use support::history::History;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_redlock::http::{key::header, replay::Replay, Contention, LockLayer, OnLost};
use tower_redlock::{
    http::problem::ProblemKind, node_from_url, Lease, LeaseHandle, LockError, LockOptions,
    MemoryNode, Redlock, Resource,
};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(30);

/// One cluster for every test of this binary that kills no member.
fn shared() -> &'static EtcdCluster {
    static CLUSTER: OnceLock<EtcdCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| EtcdCluster::start(3))
}

/// Options for etcd: whole seconds, and room for a raft commit on a busy machine.
fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(5))
        .node_timeout(Duration::from_secs(2))
}

/// etcd's shortest lease, for tests that wait for an expiry or a renewal.
fn short_ttl() -> LockOptions {
    options()
        .ttl(Duration::from_secs(2))
        .node_timeout(Duration::from_secs(1))
}

fn locker(cluster: &EtcdCluster, options: LockOptions) -> Redlock {
    Redlock::from_urls([cluster.url("t")], options).unwrap()
}

async fn etcd_client(cluster: &EtcdCluster) -> etcd_client::Client {
    let endpoints: Vec<String> = cluster
        .endpoints()
        .into_iter()
        .map(|e| format!("http://{e}"))
        .collect();
    etcd_client::Client::connect(endpoints, None).await.unwrap()
}

/// The etcd key of a resource's lock under the URL prefix `t/` and the default prefix.
fn lock_key(resource: &str) -> String {
    format!("t/redlock:{{{}}}", Resource::new(resource).as_str())
}

// ------------------------------------------------------------------------------------
// the node contract

/// `tower_redlock::node::conformance` on an etcd node: no fence counter of its own (the
/// revision is the token), no wait queue, no shared modes; records.
#[cfg(feature = "test-util")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_node_keeps_the_contract() {
    use tower_redlock::node::conformance::{check, Contract};
    let url = shared().url("conformance");
    let make = || node_from_url(&url).unwrap();
    check(&make, Contract::without_fence_counter()).await;
}

// ------------------------------------------------------------------------------------
// configuration

#[tokio::test]
async fn ttls_etcd_cannot_express_and_mixed_lockers_are_refused() {
    let url = "etcd://127.0.0.1:1,127.0.0.1:2/x";
    for (options, says) in [
        (
            LockOptions::default().ttl(Duration::from_millis(2500)),
            "whole seconds",
        ),
        (
            LockOptions::default().ttl(Duration::from_secs(1)),
            "minimum",
        ),
    ] {
        let err = Redlock::from_urls([url], options).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
    let mixed = Redlock::from_nodes(
        vec![
            node_from_url(url).unwrap(),
            Arc::new(MemoryNode::new()),
            Arc::new(MemoryNode::new()),
        ],
        LockOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(mixed.contains("only node"), "{mixed}");
    assert!(Redlock::from_urls([url], LockOptions::default()).is_ok());
}

// ------------------------------------------------------------------------------------
// engine

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_under_contention_with_the_history_checker() {
    let cluster = shared();
    let history = History::new("etcd_contention");
    let mut tasks = Vec::new();
    // Four lockers: four processes as far as the lock can tell.
    for holder in 0..4 {
        let locker = locker(cluster, options());
        let history = history.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..6 {
                match locker.acquire("contended", PROMPTLY).await {
                    Ok(lease) => {
                        let mut section = history.begin(
                            "contended",
                            lease.fencing_token().get(),
                            format!("locker {holder}"),
                        );
                        tokio::task::yield_now().await;
                        section.write();
                        section.end(!lease.is_held());
                        lease.release().await;
                    }
                    Err(e) => panic!("locker {holder}: {e}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let summary = history.check();
    assert_eq!(history.rejected(), 0, "{summary}");
    assert_eq!(history.sections().len(), 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_the_create_revision_and_strictly_increase() {
    let cluster = shared();
    let locker = locker(cluster, options());
    let mut client = etcd_client(cluster).await;
    let mut last = 0;
    for _ in 0..5 {
        let lease = locker.try_acquire("tokens").await.unwrap();
        let token = lease.fencing_token().get();
        assert!(token > last, "{token} after {last}");
        let got = client.get(lock_key("tokens"), None).await.unwrap();
        let kv = &got.kvs()[0];
        assert_eq!(kv.create_revision() as u64, token);
        assert_eq!(kv.value(), lease.owner().as_bytes());
        last = token;
        lease.release().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_extends_and_releases() {
    let cluster = shared();
    let a = locker(cluster, options());
    let b = locker(cluster, options());
    let mut client = etcd_client(cluster).await;
    let key = lock_key("owner-only");
    let lease = a.try_acquire("owner-only").await.unwrap();
    let before = client.get(key.clone(), None).await.unwrap().kvs()[0].clone();
    // B's failed attempt releases its own owner value on the node as it gives up: that
    // release must leave A's key alone.
    assert!(matches!(
        b.try_acquire("owner-only").await,
        Err(LockError::Held { .. })
    ));
    eventually_async("B's cleanup has run", PROMPTLY, || {
        let b = b.clone();
        async move { b.local_resources() == 0 }
    })
    .await;
    let after = client.get(key.clone(), None).await.unwrap().kvs()[0].clone();
    assert_eq!(after.value(), lease.owner().as_bytes());
    assert_eq!(
        after.mod_revision(),
        before.mod_revision(),
        "nothing written"
    );
    assert!(lease.extend().await.is_ok(), "the owner extends");

    // A's key taken away and re-created by C: A's extend and release must not touch
    // C's key (they compare the owner value).
    assert_eq!(client.delete(key.clone(), None).await.unwrap().deleted(), 1);
    let c = locker(cluster, options());
    let taken = c.try_acquire("owner-only").await.unwrap();
    let c_kv = client.get(key.clone(), None).await.unwrap().kvs()[0].clone();
    assert!(
        lease.extend().await.is_err(),
        "a lost lease is not extended"
    );
    lease.release().await;
    let still = client.get(key.clone(), None).await.unwrap().kvs()[0].clone();
    assert_eq!(still.value(), taken.owner().as_bytes());
    assert_eq!(still.mod_revision(), c_kv.mod_revision());
    taken.release().await;
    assert!(client.get(key, None).await.unwrap().kvs().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_and_unavailable_are_told_apart() {
    let cluster = shared();
    let a = locker(cluster, options());
    let b = locker(cluster, options());
    let lease = a.try_acquire("held").await.unwrap();
    match b.try_acquire("held").await {
        Err(LockError::Held { holder_ttl, .. }) => {
            let ttl = holder_ttl.expect("the holder's lease ttl");
            assert!(ttl <= Duration::from_secs(5), "{ttl:?}");
        }
        other => panic!("expected Held, got {other:?}"),
    }
    lease.release().await;

    // Nothing listens there: every call fails, which is no contention.
    let dead = format!("etcd://127.0.0.1:{}/t", closed_port());
    let nowhere = Redlock::from_urls([dead], options()).unwrap();
    match nowhere.try_acquire("held").await {
        Err(LockError::Unavailable { answered: 0, .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_the_watch_on_release() {
    let cluster = shared();
    let holder = locker(cluster, options());
    // Without the watch this waiter would retry after an hour.
    let waiter = locker(
        cluster,
        options().retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(3600)),
    );
    let lease = holder.try_acquire("wake").await.unwrap();
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.acquire("wake", Duration::from_secs(3600)).await }
    });
    // The waiter found the resource held, watched it (its watch is confirmed before
    // it counts as waiting), and found it held once more: from now on only the
    // watch (or the hour-long retry) brings it back.
    eventually_async("the waiter watches", PROMPTLY, || {
        let waiter = waiter.clone();
        async move {
            let metrics = waiter.metrics();
            metrics.waits >= 1 && metrics.contended >= 2
        }
    })
    .await;
    lease.release().await;
    let next = tokio::time::timeout(PROMPTLY, waiting)
        .await
        .expect("woken by the release, not by the hour-long retry")
        .unwrap()
        .unwrap();
    assert!(next.is_held());
    next.release().await;
}

// ------------------------------------------------------------------------------------
// faults

/// Tries until a lease is granted: while etcd elects a leader or replays its log,
/// calls fail (unavailable), and must never answer held.
async fn acquire_through_failover(locker: &Redlock, resource: &str) -> Lease {
    let deadline = tokio::time::Instant::now() + PROMPTLY;
    loop {
        match locker.try_acquire(resource).await {
            Ok(lease) => return lease,
            Err(LockError::Unavailable { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(support::POLL_INTERVAL).await;
            }
            Err(e) => panic!("nothing may be held: {e}"),
        }
    }
}

/// The cluster keeps granting, extending and releasing with one member (here the
/// leader when `leader`, else a follower) killed; tokens keep growing.
async fn survives_one_member_killed(leader: bool) {
    let cluster = EtcdCluster::start(3);
    let locker = locker(&cluster, options());
    let first = locker.try_acquire("one-down").await.unwrap();
    let before = first.fencing_token();
    first.release().await;
    let leader_index = cluster.leader();
    let victim = if leader {
        leader_index
    } else {
        (leader_index + 1) % 3
    };
    cluster.kill(victim);
    // A new leader may take an election timeout: until then calls fail (unavailable),
    // never answer held.
    let lease = acquire_through_failover(&locker, "one-down").await;
    assert!(lease.fencing_token() > before);
    if let Err(e) = lease.extend().await {
        panic!("extend with one member down: {e}");
    }
    let token = lease.fencing_token();
    lease.release().await;
    let again = locker.try_acquire("one-down").await.unwrap();
    assert!(again.fencing_token() > token);
    again.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_killed_changes_nothing() {
    survives_one_member_killed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_costs_an_election_only() {
    survives_one_member_killed(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_majority_down_is_unavailable_and_leaves_nothing_held() {
    let cluster = EtcdCluster::start(3);
    let locker = locker(
        &cluster,
        options().node_timeout(Duration::from_millis(1500)),
    );
    let leader = cluster.leader();
    cluster.kill((leader + 1) % 3);
    cluster.kill((leader + 2) % 3);
    match locker.try_acquire("majority").await {
        Err(LockError::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    cluster.restart((leader + 1) % 3);
    cluster.restart((leader + 2) % 3);
    cluster.wait_healthy();
    // The failed attempt's write never committed: the resource is free at once, for a
    // fresh locker too (no local state helps).
    let fresh = Redlock::from_urls([cluster.url("t")], options()).unwrap();
    acquire_through_failover(&fresh, "majority")
        .await
        .release()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_ttl_is_fenced_off() {
    let cluster = shared();
    // The "paused" holder: no watchdog, so its lease is never renewed, as if the
    // process had stopped for longer than the ttl.
    let paused = locker(cluster, short_ttl().watchdog(false));
    let next = locker(cluster, options());
    let storage = Fenced::default();
    let stale = paused.try_acquire("paused").await.unwrap();
    assert!(storage.write(stale.fencing_token().get()));
    // etcd expires the lease (its leader's timer, no client clock involved); the next
    // holder is woken by the deletion.
    let lease = next.acquire("paused", PROMPTLY).await.unwrap();
    assert!(lease.fencing_token() > stale.fencing_token());
    assert!(storage.write(lease.fencing_token().get()));
    // The paused holder wakes up and writes late: the storage refuses its token.
    assert!(!storage.write(stale.fencing_token().get()));
    assert!(stale.extend().await.is_err(), "a lost lease stays lost");
    lease.release().await;
}

/// A storage that accepts a write only with a token above every token it accepted.
#[derive(Default)]
struct Fenced(Mutex<u64>);

impl Fenced {
    fn write(&self, token: u64) -> bool {
        let mut last = self.0.lock().unwrap();
        if token > *last {
            *last = token;
            true
        } else {
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_still_grow_after_etcd_restarts_from_its_data_directory() {
    let cluster = EtcdCluster::start(3);
    let locker = locker(&cluster, options());
    let lease = locker.try_acquire("restart").await.unwrap();
    let before = lease.fencing_token();
    lease.release().await;
    cluster.restart_all();
    let lease = acquire_through_failover(&locker, "restart").await;
    assert!(
        lease.fencing_token() > before,
        "{} after {before}: the revision survives the restart",
        lease.fencing_token()
    );
    lease.release().await;
}

// ------------------------------------------------------------------------------------
// HTTP

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, Bytes) {
    let response: Response<Body> = tokio::time::timeout(PROMPTLY, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn problem_code(body: &Bytes) -> String {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap();
    ProblemKind::from_type_uri(json["type"].as_str().unwrap())
        .unwrap()
        .code()
        .to_owned()
}

fn order(id: &str) -> Request<Body> {
    Request::post(format!("/orders/{id}"))
        .body(Body::empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_409_503_and_lock_lost_over_etcd() {
    let cluster = shared();
    let entered = Arc::new(Notify::new());
    let handler = {
        let entered = entered.clone();
        move || {
            let entered = entered.clone();
            async move {
                entered.notify_one();
                // Runs until the layer drops it (OnLost::Abort).
                std::future::pending::<&str>().await
            }
        }
    };
    let app = |locker: Redlock| {
        Router::new()
            .route("/orders/{id}", post(handler.clone()))
            .route_layer(
                LockLayer::new(locker, tower_redlock::http::key::path_param("id"))
                    .contention(Contention::Reject)
                    .on_lost(OnLost::Abort),
            )
    };
    let app = app(locker(cluster, short_ttl()));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, order("409")).await }
    });
    entered.notified().await;

    // Held: 409 with the holder's ttl as Retry-After.
    let (status, headers, body) = send(&app, order("409")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem_code(&body), "lock-held");
    let retry: u64 = headers[RETRY_AFTER].to_str().unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");

    // The key deleted behind the holder's back: its watchdog finds it gone, the
    // handler is dropped, 503 lock-lost.
    let mut client = etcd_client(cluster).await;
    let route = Resource::new("POST").join("/orders/{id}").join("409");
    let key = format!("t/redlock:{{{}}}", route.as_str());
    assert_eq!(client.delete(key, None).await.unwrap().deleted(), 1);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(problem_code(&body), "lock-lost");

    // No store: 503 lock-unavailable, the handler never runs.
    let dead =
        Redlock::from_urls([format!("etcd://127.0.0.1:{}/t", closed_port())], options()).unwrap();
    let (status, headers, body) = send(&app_with(dead), order("503")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(problem_code(&body), "lock-unavailable");
    assert!(headers.contains_key(RETRY_AFTER));
}

fn app_with(locker: Redlock) -> Router {
    Router::new()
        .route("/orders/{id}", post(|| async { "ran" }))
        .route_layer(LockLayer::new(
            locker,
            tower_redlock::http::key::path_param("id"),
        ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_422_over_etcd() {
    let cluster = shared();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/payments",
            post({
                let runs = runs.clone();
                move |lease: Extension<LeaseHandle>, body: Bytes| {
                    let runs = runs.clone();
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        (
                            StatusCode::CREATED,
                            format!(
                                "payment {run} of {} bytes, token {}",
                                body.len(),
                                lease.fencing_token()
                            ),
                        )
                    }
                }
            }),
        )
        .route_layer(
            LockLayer::new(locker(cluster, options()), header("Idempotency-Key"))
                .contention(Contention::Wait { timeout: PROMPTLY })
                .replay(Replay::global()),
        );
    let pay = |body: &'static str| {
        Request::post("/payments")
            .header("idempotency-key", "etcd-pay-1")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap()
    };
    let (status, headers, first) = send(&app, pay(r#"{"amount":1}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!headers.contains_key("idempotent-replayed"));
    let (status, headers, again) = send(&app, pay(r#"{"amount":1}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first, "byte-identical");
    let (status, _, body) = send(&app, pay(r#"{"amount":2}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem_code(&body), "idempotency-key-reused");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
