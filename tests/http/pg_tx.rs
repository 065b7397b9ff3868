//! Replay's records in PostgreSQL (`Replay::records_in`) and the handler's transaction
//! (`Tx`), through real HTTP (`axum::serve` on loopback) and a real database of the
//! test's own: the handler's writes and its record commit together or not at all. A
//! panic in the handler (under `CatchPanicLayer`) stands in for a crash of the process
//! between the handler's writes and the commit.

use crate::http_client::{Reply, Req, Served};
use crate::support::postgres::TestDatabase;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use sqlx::PgPool;
use tokio::sync::Notify;
use tower_http::catch_panic::CatchPanicLayer;
use tower_redlock::axum::{LayerLease, Tx};
use tower_redlock::http::replay::{PgRecords, Replay};
use tower_redlock::http::{key::header, InterruptedAttempt, LockLayer, OnDisconnect, OnLost};
use tower_redlock::{LockOptions, MemoryNode, Redlock};

/// What the payment handler does on its next run, and what it saw.
#[derive(Default)]
struct Script {
    runs: AtomicUsize,
    /// Panic after writing (a crash before the commit).
    panic_next: AtomicBool,
    /// Answer 202, which the tests' `store_if` refuses.
    unrecordable_next: AtomicBool,
    /// A newer holder's claim lands on the record row after the write.
    superseded_next: AtomicBool,
    /// The lease is lost after the write (its lock key deleted), seen before answering.
    lose_lease_next: AtomicBool,
    /// Wait for the client to hang up after the write.
    hang_next: AtomicBool,
    /// The hanging run wrote.
    written: Notify,
    /// The hanging run was dropped (`OnDisconnect::Cancel`).
    dropped: Notify,
    /// A run was told of an interrupted attempt.
    told_interrupted: AtomicBool,
}

/// Tells when the handler's future is dropped.
struct Dropped(Arc<Script>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.dropped.notify_one();
    }
}

struct Test {
    db: TestDatabase,
    pool: PgPool,
    script: Arc<Script>,
    served: Served,
    node: MemoryNode,
}

/// `/payments` under a replaying layer (memory lock node, records in PostgreSQL), its
/// handler inserting a payment through `Tx` (or, `with_tx` false, through the pool).
async fn start(with_tx: bool) -> Test {
    start_with(with_tx, OnDisconnect::Finish, false).await
}

/// `claim_in_tx`: `PgRecords::handlers_take_tx`, the marker claimed in the handler's
/// transaction.
async fn start_with(with_tx: bool, on_disconnect: OnDisconnect, claim_in_tx: bool) -> Test {
    let db = TestDatabase::create().await;
    let pool = db.pool(4).await;
    sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY, amount bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let records = match claim_in_tx {
        false => PgRecords::new(pool.clone()),
        true => PgRecords::new(pool.clone()).handlers_take_tx(),
    };
    records.create().await.unwrap();
    records.create().await.expect("create is idempotent");
    let script = Arc::new(Script::default());
    let node = MemoryNode::new();
    // A short ttl: the watchdog notices a deleted lock key promptly.
    let options = LockOptions::default().ttl(Duration::from_millis(600));
    let locker = Redlock::new([node.clone()], options).unwrap();
    let layer = LockLayer::new(locker, header("Idempotency-Key"))
        .on_lost(OnLost::Continue)
        .on_disconnect(on_disconnect)
        .replay(
            Replay::per_client(header("Authorization"))
                .store_if(|status| status == StatusCode::CREATED)
                .records_in(records),
        );
    let route = if with_tx {
        post(pay_in_tx)
    } else {
        post(pay_on_pool)
    };
    let app = Router::new()
        .route("/payments", route)
        .route_layer(layer)
        .layer(Extension(script.clone()))
        .layer(Extension(node.clone()))
        .layer(Extension(pool.clone()))
        .layer(CatchPanicLayer::new());
    let served = Served::start(app).await;
    Test {
        db,
        pool,
        script,
        served,
        node,
    }
}

async fn pay_in_tx(
    Extension(script): Extension<Arc<Script>>,
    Extension(pool): Extension<PgPool>,
    Extension(node): Extension<MemoryNode>,
    lease: LayerLease,
    interrupted: Option<Extension<InterruptedAttempt>>,
    mut tx: Tx,
) -> (StatusCode, String) {
    script.runs.fetch_add(1, Ordering::SeqCst);
    script
        .told_interrupted
        .fetch_or(interrupted.is_some(), Ordering::SeqCst);
    let id: i64 = sqlx::query_scalar("INSERT INTO payments (amount) VALUES (100) RETURNING id")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    if script.superseded_next.swap(false, Ordering::SeqCst) {
        // What a newer holder's claim writes, committed while this one still runs.
        sqlx::query("UPDATE redlock_records SET token = token + 1 WHERE resource = $1")
            .bind(lease.resource().as_str())
            .execute(&pool)
            .await
            .unwrap();
    }
    if script.hang_next.swap(false, Ordering::SeqCst) {
        let _dropped = Dropped(script.clone());
        script.written.notify_one();
        std::future::pending::<()>().await;
    }
    if script.lose_lease_next.swap(false, Ordering::SeqCst) {
        // As a paused or partitioned process would; the layer goes on (`OnLost::Continue`).
        node.delete(&format!("redlock:{{{}}}", lease.resource().as_str()));
        lease.lost().await;
    }
    if script.panic_next.swap(false, Ordering::SeqCst) {
        panic!("the process dies after the payment's write, before the commit (a test)");
    }
    if script.unrecordable_next.swap(false, Ordering::SeqCst) {
        return (StatusCode::ACCEPTED, format!("pay_{id}"));
    }
    (StatusCode::CREATED, format!("pay_{id}"))
}

async fn pay_on_pool(
    Extension(script): Extension<Arc<Script>>,
    Extension(pool): Extension<PgPool>,
) -> (StatusCode, String) {
    script.runs.fetch_add(1, Ordering::SeqCst);
    let id: i64 = sqlx::query_scalar("INSERT INTO payments (amount) VALUES (100) RETURNING id")
        .fetch_one(&pool)
        .await
        .unwrap();
    if script.panic_next.swap(false, Ordering::SeqCst) {
        panic!("the process dies after the payment's commit, before the record (a test)");
    }
    (StatusCode::CREATED, format!("pay_{id}"))
}

fn pay() -> Req {
    pay_with_key("p1")
}

fn pay_with_key(key: &str) -> Req {
    Req::post("/payments")
        .header("idempotency-key", key)
        .header("authorization", "Bearer alice")
        .json(r#"{"amount":100}"#)
}

impl Test {
    async fn payments(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Completed records, and pending markers flagged transactional.
    async fn records(&self) -> (i64, i64) {
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE data IS NOT NULL), \
             count(*) FILTER (WHERE data IS NULL AND transactional) FROM redlock_records",
        )
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    fn runs(&self) -> usize {
        self.script.runs.load(Ordering::SeqCst)
    }
}

fn assert_created(reply: &Reply, replayed: bool) {
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(
        reply.header("idempotent-replayed").is_some(),
        replayed,
        "{:?}",
        reply.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payment_and_its_record_commit_together_and_the_retry_is_replayed() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        let first = test.served.send(pay()).await;
        assert_created(&first, false);
        assert_eq!((test.payments().await, test.records().await), (1, (1, 0)));
        let retry = test.served.send(pay()).await;
        assert_created(&retry, true);
        assert_eq!(retry.text(), first.text());
        assert_eq!((test.payments().await, test.runs()), (1, 1));
        drop(test.db);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_commit_leaves_nothing_and_the_retry_runs_cleanly() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        test.script.panic_next.store(true, Ordering::SeqCst);
        let crashed = test.served.send(pay()).await;
        assert_eq!(crashed.status, 500, "{}", crashed.text());
        // No payment, no record: only this attempt's marker, which says it wrote in a
        // transaction that never committed; none when it was claimed in that transaction.
        let marker = i64::from(!claim_in_tx);
        assert_eq!(
            (test.payments().await, test.records().await),
            (0, (0, marker))
        );
        let retry = test.served.send(pay()).await;
        assert_created(&retry, false);
        assert!(!test.script.told_interrupted.load(Ordering::SeqCst));
        assert_eq!((test.payments().await, test.records().await), (1, (1, 0)));
        assert_created(&test.served.send(pay()).await, true);
        assert_eq!((test.payments().await, test.runs()), (1, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_the_commit_under_cancel_leaves_nothing() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Cancel, claim_in_tx).await;
        test.script.hang_next.store(true, Ordering::SeqCst);
        let mut conn = test.served.connect().await;
        conn.write(&pay()).await;
        test.script.written.notified().await;
        drop(conn);
        test.script.dropped.notified().await;
        let marker = i64::from(!claim_in_tx);
        assert_eq!(
            (test.payments().await, test.records().await),
            (0, (0, marker))
        );
        // The lease is released in the background: until then the retry is told to wait.
        let mut retry = test.served.send(pay()).await;
        for _ in 0..1000 {
            if retry.problem().as_deref() != Some("request-in-progress") {
                break;
            }
            tokio::task::yield_now().await;
            retry = test.served.send(pay()).await;
        }
        assert_created(&retry, false);
        assert!(!test.script.told_interrupted.load(Ordering::SeqCst));
        assert_eq!((test.payments().await, test.runs()), (1, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_not_recorded_rolls_the_handlers_writes_back() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        test.script.unrecordable_next.store(true, Ordering::SeqCst);
        let unrecorded = test.served.send(pay()).await;
        assert_eq!(unrecorded.status, 202, "{}", unrecorded.text());
        assert_eq!((test.payments().await, test.records().await), (0, (0, 0)));
        assert_created(&test.served.send(pay()).await, false);
        assert_eq!((test.payments().await, test.runs()), (1, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_superseded_before_its_commit_commits_nothing() {
    let test = start(true).await;
    test.script.superseded_next.store(true, Ordering::SeqCst);
    let stale = test.served.send(pay()).await;
    assert_eq!(stale.status, 503, "{}", stale.text());
    assert_eq!(stale.problem().as_deref(), Some("lock-lost"));
    assert_eq!(test.payments().await, 0);
    assert_eq!(test.records().await.0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_before_the_commit_rolls_back_and_its_response_is_not_sent() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        test.script.lose_lease_next.store(true, Ordering::SeqCst);
        let lost = test.served.send(pay()).await;
        assert_eq!(lost.status, 503, "{}", lost.text());
        assert_eq!(lost.problem().as_deref(), Some("lock-lost"));
        let marker = i64::from(!claim_in_tx);
        assert_eq!(
            (test.payments().await, test.records().await),
            (0, (0, marker))
        );
        // Nothing of it committed: the retry runs cleanly.
        assert_created(&test.served.send(pay()).await, false);
        assert_eq!((test.payments().await, test.runs()), (1, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_behind_the_fence_is_refused_before_it_writes() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        assert_created(&test.served.send(pay()).await, false);
        // The key is new again, and a newer holder wrote under its resource since.
        sqlx::query("DELETE FROM redlock_records")
            .execute(&test.pool)
            .await
            .unwrap();
        sqlx::query("UPDATE redlock_fences SET token = 9223372036854775807")
            .execute(&test.pool)
            .await
            .unwrap();
        let stale = test.served.send(pay()).await;
        assert_eq!(stale.status, 503, "{}", stale.text());
        assert_eq!(stale.problem().as_deref(), Some("lock-lost"));
        assert_eq!((test.payments().await, test.runs()), (1, 1));
    }
}

/// Both ways, a completed payment is replayed when the lock is not taken (its node is
/// down): under `handlers_take_tx`, which looks the record up under the lock, by a
/// lookup made then. A new key is refused, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_payment_is_replayed_while_the_lock_is_unavailable() {
    for claim_in_tx in [false, true] {
        let test = start_with(true, OnDisconnect::Finish, claim_in_tx).await;
        let first = test.served.send(pay()).await;
        assert_created(&first, false);
        test.node.set_available(false);
        let retry = test.served.send(pay()).await;
        assert_created(&retry, true);
        assert_eq!(retry.text(), first.text());
        let new = test.served.send(pay_with_key("p2")).await;
        assert_eq!(new.status, 503, "{}", new.text());
        assert_eq!((test.payments().await, test.runs()), (1, 1));
    }
}

/// Under `handlers_take_tx` no marker is committed before the handler: one that does not
/// take `Tx` is still recorded and replayed (and the layer logs an error), but a crash
/// while it ran leaves nothing that says its outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_without_tx_under_handlers_take_tx_is_recorded_without_a_marker() {
    let test = start_with(false, OnDisconnect::Finish, true).await;
    let first = test.served.send(pay()).await;
    assert_created(&first, false);
    assert_eq!((test.payments().await, test.records().await), (1, (1, 0)));
    assert_created(&test.served.send(pay()).await, true);
    test.script.panic_next.store(true, Ordering::SeqCst);
    let other = pay_with_key("p2");
    assert_eq!(test.served.send(other.clone()).await.status, 500);
    assert_eq!((test.payments().await, test.records().await), (2, (1, 0)));
    assert_created(&test.served.send(other).await, false);
    assert_eq!((test.payments().await, test.runs()), (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_without_tx_keeps_outcome_unknown_after_a_crash() {
    let test = start(false).await;
    test.script.panic_next.store(true, Ordering::SeqCst);
    assert_eq!(test.served.send(pay()).await.status, 500);
    // The payment committed on its own; the record did not: nobody can tell.
    assert_eq!((test.payments().await, test.records().await), (1, (0, 0)));
    let retry = test.served.send(pay()).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem().as_deref(), Some("outcome-unknown"));
    assert_eq!((test.payments().await, test.runs()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_without_records_in_postgres_is_a_misconfiguration() {
    let app = Router::new()
        .route("/payments", post(|_tx: Tx| async { "never" }))
        .route_layer(
            LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
                .replay(Replay::per_client(header("Authorization"))),
        );
    let served = Served::start(app).await;
    let reply = served.send(pay()).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    assert_eq!(reply.problem().as_deref(), Some("lock-layer-missing"));
    assert!(
        reply.text().contains("Replay::records_in"),
        "{}",
        reply.text()
    );
}

#[tokio::test]
async fn records_in_postgres_refuse_a_locker_without_fencing_tokens() {
    let db = TestDatabase::create().await;
    let options = LockOptions::default().fencing(false);
    let locker = Redlock::new([MemoryNode::new()], options).unwrap();
    let replay = Replay::global().records_in(PgRecords::new(db.pool(1).await));
    let refused = LockLayer::new(locker, header("Idempotency-Key")).try_replay(replay);
    assert!(refused.unwrap_err().to_string().contains("fencing"));
}
