//! Scenario 17: the application process killed with SIGKILL in the middle of payments
//! (features `axum` and `postgres`). The application is this test binary re-executed
//! in a "server" role (`app_process`, selected by `FAULTS_APP_DATABASE_URL`): a
//! `/payments` route under `LockLayer::replay(… .records_in(PgRecords))`, its handler
//! inserting the payment through `Tx`, the lock node a `PostgresNode` on the same
//! database. A request's `x-stop-at` header makes the process announce on stdout that
//! it reached a point and block there; the test then kills it (an event, not a sleep).
//! [`random`] kills the process at moments chosen by a seeded RNG instead, in both
//! claim modes ([`ClaimMode`]).

mod random;

use super::*;

use std::net::SocketAddr;
use std::process::Stdio;

use crate::http_client::{Conn, Req};
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Extension;
use sqlx::PgPool;
use support::postgres::TestDatabase;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tower_redlock::axum::Tx;
use tower_redlock::http::replay::{PgRecords, Replay};
use tower_redlock::http::{key::header, LockLayer, RequestKey};
use tower_redlock::PostgresNode;

/// Where the process is killed: before the handler's write, between the write and the
/// commit (the layer's, with the record), after the commit before the response.
const POINTS: [&str; 3] = ["before-write", "written", "committed"];

/// The environment variable that selects the server role, with the database's URL.
const ROLE: &str = "FAULTS_APP_DATABASE_URL";

/// The environment variable that tells the server role its [`ClaimMode`].
const CLAIM_MODE: &str = "FAULTS_APP_CLAIM_MODE";

/// Where the application's `PgRecords` claims a key's pending marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimMode {
    /// `PgRecords::new`: committed before the handler, flagged transactional by `Tx`.
    BeforeHandler,
    /// `PgRecords::handlers_take_tx`: in the handler's transaction.
    InHandlersTx,
}

impl ClaimMode {
    fn name(self) -> &'static str {
        match self {
            ClaimMode::BeforeHandler => "before-handler",
            ClaimMode::InHandlersTx => "in-handlers-tx",
        }
    }

    /// Whether a process killed after a claim can leave a marker `Tx` has not flagged
    /// yet: committed before the handler runs, the marker is flagged transactional by
    /// `Tx`'s first statement, a round trip later. A retry then finds an attempt that
    /// might have written without a transaction, and answers 409 `outcome-unknown`
    /// until `UnknownOutcome`'s time is over, then runs cleanly (nothing was written).
    fn unflagged_marker_possible(self) -> bool {
        self == ClaimMode::BeforeHandler
    }

    fn records(self, pool: PgPool) -> PgRecords {
        match self {
            ClaimMode::BeforeHandler => PgRecords::new(pool),
            ClaimMode::InHandlersTx => PgRecords::new(pool).handlers_take_tx(),
        }
    }
}

/// Announces `point` for `key` on stdout and blocks until the process is killed.
async fn reached(point: &str, headers: &HeaderMap, key: &str) {
    if headers.get("x-stop-at").and_then(|v| v.to_str().ok()) == Some(point) {
        println!("[app] reached {point} {key}");
        std::future::pending::<()>().await;
    }
}

async fn pay(
    Extension(key): Extension<RequestKey>,
    Extension(pool): Extension<PgPool>,
    headers: HeaderMap,
    mut tx: Tx,
) -> (StatusCode, String) {
    reached("before-write", &headers, key.as_str()).await;
    let insert = "INSERT INTO payments (key) VALUES ($1) RETURNING id";
    let query = sqlx::query_scalar(insert).bind(key.as_str());
    // BROKEN=1: the payment commits on its own, apart from its record.
    let id: i64 = if broken() {
        query.fetch_one(&pool).await
    } else {
        query.fetch_one(&mut *tx).await
    }
    .expect("insert the payment");
    reached("written", &headers, key.as_str()).await;
    (StatusCode::CREATED, format!("pay_{id}"))
}

/// Outside the layer: the layer has committed the payment and its record when the
/// response gets here.
async fn after_commit(request: Request, next: Next) -> Response {
    let headers = request.headers().clone();
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let response = next.run(request).await;
    reached("committed", &headers, &key).await;
    response
}

/// The server role; returns at once in an ordinary run (no `FAULTS_APP_DATABASE_URL`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the application process of s17, started by it"]
async fn app_process() {
    let Ok(url) = std::env::var(ROLE) else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("pool");
    let mode = match std::env::var(CLAIM_MODE).as_deref() {
        Ok("in-handlers-tx") => ClaimMode::InHandlersTx,
        _ => ClaimMode::BeforeHandler,
    };
    let node = PostgresNode::new(pool.clone());
    let locker = Redlock::from_nodes(vec![Arc::new(node)], app_options()).expect("locker");
    let layer = LockLayer::new(locker, header("Idempotency-Key"))
        .replay(Replay::global().records_in(mode.records(pool.clone())));
    let app = axum::Router::new()
        .route("/payments", axum::routing::post(pay))
        .route_layer(layer)
        .layer(axum::middleware::from_fn(after_commit))
        .layer(Extension(pool));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    println!("[app] listening {}", listener.local_addr().expect("addr"));
    axum::serve(listener, app).await.expect("serve");
}

/// A short ttl: a killed process's lease is free again soon.
fn app_options() -> LockOptions {
    LockOptions::default().ttl(ms(1000)).node_timeout(ms(300))
}

/// A running application process and the lines it announces.
struct App {
    child: Child,
    addr: SocketAddr,
    lines: mpsc::UnboundedReceiver<String>,
}

impl App {
    async fn start(url: &str, mode: ClaimMode) -> App {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "app_killed::app_process",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env(ROLE, url)
            .env(CLAIM_MODE, mode.name())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the application process");
        let stdout = child.stdout.take().expect("stdout");
        let (send, mut lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if let Some(line) = line.strip_prefix("[app] ") {
                    let _ = send.send(line.to_owned());
                }
            }
        });
        let line = tokio::time::timeout(bound(30), lines.recv())
            .await
            .expect("the application listens")
            .expect("the application exited before listening");
        let addr = line
            .strip_prefix("listening ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected line {line:?}"));
        App { child, addr, lines }
    }

    /// Waits until the process announced `count` stop points.
    async fn reached(&mut self, count: usize) {
        for _ in 0..count {
            let line = tokio::time::timeout(bound(30), self.lines.recv())
                .await
                .expect("a stop point reached")
                .expect("the application exited");
            assert!(line.starts_with("reached "), "{line:?}");
        }
    }

    async fn kill(mut self) {
        self.child.kill().await.expect("SIGKILL");
    }
}

/// A database of its own with the payments, records and lock tables, and a pool on it.
async fn payments_database() -> (TestDatabase, PgPool) {
    let db = TestDatabase::create().await;
    let pool = db.pool(2).await;
    sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL)")
        .execute(&pool)
        .await
        .expect("payments");
    PgRecords::new(pool.clone())
        .create()
        .await
        .expect("records");
    PostgresNode::new(pool.clone())
        .create_tables()
        .await
        .expect("lock tables");
    (db, pool)
}

fn payment(key: &str) -> Req {
    Req::post("/payments")
        .header("idempotency-key", key)
        .json(r#"{"amount":100}"#)
}

/// Kills the application process at each point of a payment, `n(3)` rounds of three
/// payments in flight (one per point), each round's process killed once all three
/// announced their point. The clients then retry against a restarted process until
/// answered. Asserted: exactly one committed payment per key, every client answered
/// with it (`pay_<id>` of that row); replayed for the payments killed after the commit.
///
/// `BROKEN=1` inserts the payment on the pool instead of through `Tx`: the payment
/// killed between its write and the commit is committed without its record, the retry
/// pays again, and the scenario fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s17_app_process_killed_mid_payment() {
    let _serial = SERIAL.lock().await;
    let (db, pool) = payments_database().await;
    let started = Instant::now();
    let mut app = App::start(db.url(), ClaimMode::BeforeHandler).await;
    let (mut retries, mut replayed) = (0u64, 0u64);
    for round in 0..n(3) {
        let keys: Vec<String> = POINTS.iter().map(|p| format!("r{round}-{p}")).collect();
        let mut in_flight = Vec::new();
        for (key, point) in keys.iter().zip(POINTS) {
            let mut conn = Conn::open(app.addr).await;
            conn.write(&payment(key).header("x-stop-at", point)).await;
            in_flight.push(conn);
        }
        app.reached(POINTS.len()).await;
        app.kill().await;
        for mut conn in in_flight {
            assert!(
                conn.closed_without_reply().await,
                "a killed process answered"
            );
        }
        app = App::start(db.url(), ClaimMode::BeforeHandler).await;
        for (key, point) in keys.iter().zip(POINTS) {
            // The killed process's lease lives until its ttl: until then the retry is
            // told the request is in progress, and tries again.
            let deadline = Instant::now() + bound(20);
            let reply = loop {
                let reply = Conn::open(app.addr).await.send(payment(key)).await;
                if reply.status != 409 || Instant::now() > deadline {
                    break reply;
                }
                retries += 1;
                tokio::time::sleep(ms(50)).await;
            };
            assert_eq!(
                reply.status,
                201,
                "{key}: {} {}",
                reply.status,
                reply.text()
            );
            let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM payments WHERE key = $1")
                .bind(key)
                .fetch_all(&pool)
                .await
                .expect("payments");
            assert_eq!(ids.len(), 1, "{key} (killed at {point}): payments {ids:?}");
            assert_eq!(reply.text(), format!("pay_{}", ids[0]), "{key}");
            let was_replayed = reply.header("idempotent-replayed").is_some();
            assert_eq!(
                was_replayed,
                point == "committed",
                "{key}: {:?}",
                reply.headers
            );
            replayed += u64::from(was_replayed);
        }
    }
    app.kill().await;
    println!(
        "[faults] s17_app_process_killed_mid_payment: kills={} payments={} replayed={replayed} retries_while_in_progress={retries} elapsed={:.2}s",
        n(3),
        n(3) * 3,
        started.elapsed().as_secs_f64()
    );
}
