//! Orders: the main demo of `tower-redlock`.
//!
//! ```sh
//! cargo run --example orders                      # one process, no Redis needed
//! LOCK_URLS=redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003 \
//!     cargo run --example orders                  # Redlock over three Redis nodes
//! LOCK_URLS=redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003 \
//!     cargo run --example orders                  # one Redis Cluster (one vote)
//! LOCK_URLS=etcd://127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379/orders \
//! LEDGER_URL=redis://127.0.0.1:7001 \
//!     cargo run --example orders --features etcd  # one etcd cluster, revisions as tokens
//! DATABASE_URL=postgres://postgres@127.0.0.1/orders \
//!     cargo run --example orders --features postgres  # all of it in PostgreSQL, no Redis
//! ```
//!
//! Environment:
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `PORT` | 3000 | listens on `127.0.0.1:$PORT` |
//! | `LOCK_URLS` (or its old name `REDIS_URLS`) | unset | node URLs separated by commas or whitespace (`redis://`, `redis+cluster://h1:p1,h2:p2`, `redis+sentinel://s1:p1,s2:p2/master`, `etcd://h1:p1,h2:p2/prefix` with `--features etcd`, `postgres://` with `--features postgres`; see `tower_redlock::split_node_urls`): Redlock over them (majority); an etcd node must be the only one. Unset: a `PostgresNode` on `DATABASE_URL`, or else the in-process `MemoryNode` and an in-process ledger |
//! | `LEDGER_URL` | the first of `LOCK_URLS` (required when that is etcd; unused with `DATABASE_URL`) | the Redis of the ledger: a server, a Cluster or a Sentinel master, as in `LOCK_URLS`. Give it one of its own to let any one lock node fail: with the default, the first node must stay up for the ledger |
//! | `DATABASE_URL` | unset | with `--features postgres` (`postgres://user@host/db`; tables created on first use): the ledger's orders and payments and `/payments`' replay records live in this PostgreSQL, every write fenced, the charge committed with its record (`postgres.rs`: no reconciliation code); without `LOCK_URLS` the lock too (a `PostgresNode`); transfers' balances stay in this process |
//! | `LOCK_TTL_MS` | 10000 | lease time to live (the watchdog renews it while a handler runs) |
//! | `WAIT_TIMEOUT_MS` | 5000 | how long `ship` waits for the order's lock |
//! | `LOCK_NODE_TIMEOUT_MS` | 50 (500 for etcd) | how long one lock node may take to answer |
//! | `RUST_LOG` | `info` | log filter |
//!
//! Routes:
//!
//! | route | lock | answer |
//! |---|---|---|
//! | `GET /healthz` | none | 200 |
//! | `GET /metrics` | none | the lock's metrics in the Prometheus text format, with `--features metrics`: `tower_redlock_acquisitions_total{outcome="held"}` grows with every 409 |
//! | `POST /orders/{id}/pay[?work_ms=N]` | `order:{id}`, refuse when held (409) | `{"order", "payment", "fencing_token"}` |
//! | `POST /orders/{id}/pay-unlocked[?work_ms=N]` | none: `pay` without the lock, for `benches/load.sh` to measure what the lock costs; unfenced (token 0), so keep its orders apart from `pay`'s | as `pay` |
//! | `POST /orders/{id}/ship[?work_ms=N]` | `order:{id}`, wait up to `WAIT_TIMEOUT_MS` | `{"order", "shipment", "fencing_token"}` |
//! | `POST /payments[?work_ms=N]` | the `Idempotency-Key` header of the customer (`Authorization: Bearer <customer>`; both required), refuse when held, replay the first answer to that customer only | `{"idempotency_key", "payment", "fencing_token"}`; the ledger entry `payment:<customer>:<key>` |
//! | `GET /orders/{id}` | none | `{"order", "payments", "shipments", "max_in_flight", "last_fencing_token"}` |
//! | `POST /transfers[?work_ms=N]` with `{"from", "to", "amount"}` | `account:{from}` and `account:{to}`, one lease, wait up to `WAIT_TIMEOUT_MS` | `{"from", "to", "amount", "balances", "fencing_tokens"}`; 400 `invalid-transfer` before locking for the same account twice, a missing account or an amount that is not a whole number from 1 up |
//! | `GET /accounts/{id}` | none | `{"account", "balance", "transfers", "max_in_flight"}` |
//!
//! `work_ms` (default 50, at most 60000) simulates the slow part of the handler, such as
//! a call to a payment provider.
//!
//! The ledger is what the lock protects. It counts payments and shipments per order,
//! and `max_in_flight` is the largest number of handlers that ever worked on one order
//! at once: with the lock it stays 1, whatever the number of instances. It also
//! teaches fencing: a write is accepted only with a fencing token larger than the last
//! one accepted for the order, so a handler whose lease ran out while it worked (a long
//! GC pause, a stopped VM) cannot overwrite the work of the next holder: it gets
//! 409 `stale-fencing-token`. With `LOCK_URLS` the ledger lives in Redis, at
//! `LEDGER_URL` or else in the first lock node (a Lua script per step), so every
//! instance started with the same settings shares it; without, it lives in this
//! process. The ledger stands for your database: it is not replicated, so the server
//! it lives on must be up for the routes that use it (the lock itself needs only a
//! majority of `LOCK_URLS`).
//!
//! Transfers between accounts (`transfers.rs`) lock two resources per request, as one
//! lease, and write each balance with that account's token; the balances live beside
//! the ledger.
//!
//! `tests/http` includes this file as a module and drives [`app`] directly, so the
//! test and the demo run the same code.

use std::net::Ipv4Addr;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::{get, post, MethodRouter};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_redlock::axum::LayerLease;
use tower_redlock::http::{
    self as lock_http, key::path_param, Contention, LockLayer, OnLost, RequestKey, Scope,
};
use tower_redlock::split_node_urls;
use tower_redlock::{FencingToken, LockOptions, MemoryNode, Redlock};
use tracing_subscriber::EnvFilter;

#[path = "ledger.rs"]
mod ledger;
#[cfg(feature = "postgres")]
#[path = "postgres.rs"]
mod postgres;
#[path = "problem.rs"]
mod problem;
#[path = "transfers.rs"]
mod transfers;

use ledger::{lock, LedgerConnection, Store, ENTER, LEAVE};
pub use ledger::{Entry, Ledger, LedgerError};

use problem::ApiProblem;
pub use transfers::Accounts;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ------------------------------------------------------------------------------------
// Configuration

/// What the environment configures; [`Config::default`] has the documented defaults.
#[derive(Debug, Clone)]
pub struct Config {
    /// `PORT`.
    pub port: u16,
    /// `LOCK_URLS` (or `REDIS_URLS`), one entry per node; empty for the in-process default.
    pub redis_urls: Vec<String>,
    /// `LEDGER_URL`; `None` for the first of `redis_urls`.
    pub ledger_url: Option<String>,
    /// `DATABASE_URL`: the ledger's orders and payments in PostgreSQL (feature
    /// `postgres`); `None` for the Redis or in-process ledger.
    pub database_url: Option<String>,
    /// `LOCK_TTL_MS`.
    pub lock_ttl: Duration,
    /// `WAIT_TIMEOUT_MS`.
    pub wait_timeout: Duration,
    /// `LOCK_NODE_TIMEOUT_MS`; `None` for the store's default.
    pub node_timeout: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            port: 3000,
            redis_urls: Vec::new(),
            ledger_url: None,
            database_url: None,
            lock_ttl: Duration::from_millis(10_000),
            wait_timeout: Duration::from_millis(5_000),
            node_timeout: None,
        }
    }
}

impl Config {
    /// Reads `PORT`, `LOCK_URLS` (or `REDIS_URLS`), `LEDGER_URL`, `LOCK_TTL_MS`, `WAIT_TIMEOUT_MS`
    /// and `LOCK_NODE_TIMEOUT_MS`.
    #[allow(dead_code)] // used by `main`; tests/http, which includes this file, does not
    pub fn from_env() -> Result<Config, String> {
        fn number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
            match std::env::var(name) {
                Ok(value) => value
                    .trim()
                    .parse()
                    .map_err(|_| format!("{name} must be a whole number, got {value:?}")),
                Err(_) => Ok(default),
            }
        }
        let defaults = Config::default();
        Ok(Config {
            port: number("PORT", defaults.port)?,
            redis_urls: split_node_urls(
                &std::env::var("LOCK_URLS")
                    .or_else(|_| std::env::var("REDIS_URLS"))
                    .unwrap_or_default(),
            ),
            ledger_url: std::env::var("LEDGER_URL")
                .ok()
                .map(|url| url.trim().to_owned())
                .filter(|url| !url.is_empty()),
            database_url: std::env::var("DATABASE_URL")
                .ok()
                .map(|url| url.trim().to_owned())
                .filter(|url| !url.is_empty()),
            lock_ttl: Duration::from_millis(number("LOCK_TTL_MS", 10_000)?),
            wait_timeout: Duration::from_millis(number("WAIT_TIMEOUT_MS", 5_000)?),
            node_timeout: match std::env::var("LOCK_NODE_TIMEOUT_MS") {
                Ok(_) => Some(Duration::from_millis(number("LOCK_NODE_TIMEOUT_MS", 0)?)),
                Err(_) => None,
            },
        })
    }
}

#[allow(dead_code)] // the binary's entry point; tests/http includes this file as a module
#[tokio::main]
pub async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let config = Config::from_env()?;
    // `GET /metrics`: the lock's metrics (feature `metrics`) in the Prometheus text format.
    // Installed before the locker and the layers are built: they register their series
    // at zero with it.
    #[cfg(feature = "metrics")]
    let metrics = {
        let prometheus =
            metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
        move || async move { prometheus.render() }
    };
    #[cfg(not(feature = "metrics"))]
    let metrics =
        || async { "run the demo with `--features metrics` to record the lock's metrics\n" };
    let (locker, ledger) = locker_and_ledger(&config)?;
    // Replay looks its records up before the first payment runs: the tables now.
    ledger
        .prepare()
        .await
        .map_err(|e| format!("DATABASE_URL: {e:?}"))?;
    let app = app(locker.clone(), ledger, &config).route("/metrics", get(metrics));
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, config.port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    // A deploy: stop taking connections and answer those in flight, then give the
    // handlers that run on without their client (they hold their leases) until the
    // deadline, and release whatever is left at once rather than leave it for its ttl.
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    tracing::info!(
        finishing = lock_http::handlers_finishing(),
        "connections closed; waiting for the handlers that run on after their client left"
    );
    let drained = locker.drain(DRAIN_DEADLINE).await;
    tracing::info!(?drained, "shut down");
    Ok(())
}

/// How long a shutdown waits for running critical sections.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Ctrl-C, or SIGTERM (what a container runtime sends).
async fn shutdown_signal() {
    let terminate = async {
        #[cfg(unix)]
        if let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            term.recv().await;
            return;
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: finishing the requests in flight");
}

/// The locker and the ledger that `config` asks for, and the app over them.
pub fn build(config: &Config) -> Result<Router, BoxError> {
    let (locker, ledger) = locker_and_ledger(config)?;
    Ok(app(locker, ledger, config))
}

/// The locker and the ledger that `config` asks for.
pub fn locker_and_ledger(config: &Config) -> Result<(Redlock, Ledger), BoxError> {
    let mut options = LockOptions::default().ttl(config.lock_ttl);
    let etcd = config
        .redis_urls
        .iter()
        .any(|url| url.starts_with("etcd://"));
    if etcd {
        // Every etcd write is a raft commit (an fsync on a majority of members): give it
        // more than the 50 ms default chosen for Redis.
        options = options.node_timeout(Duration::from_millis(500));
    }
    if let Some(timeout) = config.node_timeout {
        options = options.node_timeout(timeout);
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = &config.database_url {
        return postgres::locker_and_ledger(config, url, options);
    }
    if config.database_url.is_some() {
        return Err("DATABASE_URL is set: run with `--features postgres`".into());
    }
    let (locker, ledger) = match config.redis_urls.first() {
        None => {
            tracing::info!(
                "LOCK_URLS is not set: locking with the in-process MemoryNode, which only \
                 this process sees (set LOCK_URLS to lock across instances)"
            );
            (
                Redlock::new([MemoryNode::new()], options)?,
                Ledger::in_memory(),
            )
        }
        Some(first) => {
            let locker = Redlock::from_urls(&config.redis_urls, options)?;
            let ledger_url = match &config.ledger_url {
                Some(url) => url,
                None if etcd => {
                    return Err("LEDGER_URL is needed with an etcd lock node: the ledger \
                                lives in Redis"
                        .into())
                }
                None => {
                    tracing::info!(
                        "LEDGER_URL is not set: the ledger lives in the first node of \
                         LOCK_URLS, which must then stay up"
                    );
                    first
                }
            };
            tracing::info!(
                nodes = locker.node_count(),
                quorum = locker.quorum(),
                "locking over {}",
                if etcd { "etcd" } else { "Redis" }
            );
            (locker, Ledger::redis(ledger_url)?)
        }
    };
    Ok((locker, ledger))
}

// ------------------------------------------------------------------------------------
// Routes

#[derive(Clone)]
struct AppState {
    ledger: Ledger,
    accounts: Accounts,
}

/// The demo's router.
pub fn app(locker: Redlock, ledger: Ledger, config: &Config) -> Router {
    // `pay` and `ship` lock the same resource, `order:{id}`: a payment and a shipment
    // of one order never run at the same time. A payment is refused while the order is
    // busy (the client decides whether to retry); a shipment waits its turn.
    let order_lock = LockLayer::new(locker.clone(), path_param("id"))
        .scope(Scope::shared("order"))
        .on_lost(OnLost::Abort); // the default, spelled out: a lost lease stops the handler
    let pay_lock = order_lock.clone().contention(Contention::Reject);
    let ship_lock = order_lock.contention(Contention::Wait {
        timeout: config.wait_timeout,
    });

    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/orders/{id}", get(order_status))
        .route("/orders/{id}/pay", post(pay).route_layer(pay_lock))
        .route("/orders/{id}/pay-unlocked", post(pay_unlocked))
        .route("/orders/{id}/ship", post(ship).route_layer(ship_lock))
        .route("/payments", payments_route(&locker, &ledger))
        .merge(transfers::routes(&locker, config))
        .with_state(AppState {
            accounts: Accounts::beside(&ledger),
            ledger,
        })
}

#[derive(Debug, Deserialize)]
struct WorkParams {
    work_ms: Option<String>,
}

/// Most simulated work a request may ask for.
const MAX_WORK: Duration = Duration::from_millis(60_000);

/// The simulated work of a request: `work_ms`, default 50 ms, at most 60 s.
fn work_of(params: &WorkParams) -> Result<Duration, ApiProblem> {
    let Some(raw) = params.work_ms.as_deref() else {
        return Ok(Duration::from_millis(50));
    };
    let work = raw.parse().map(Duration::from_millis).map_err(|_| {
        ApiProblem::new(
            StatusCode::BAD_REQUEST,
            "invalid-work-ms",
            "Invalid work_ms",
            format!("work_ms must be a whole number of milliseconds, got {raw:?}"),
        )
    })?;
    if work > MAX_WORK {
        return Err(ApiProblem::new(
            StatusCode::BAD_REQUEST,
            "invalid-work-ms",
            "Invalid work_ms",
            format!("work_ms may be at most {}, got {raw}", MAX_WORK.as_millis()),
        ));
    }
    Ok(work)
}

/// `POST /orders/{id}/pay`: runs under the order's lock (the layer took it).
async fn pay(
    State(state): State<AppState>,
    Path(order): Path<String>,
    Query(params): Query<WorkParams>,
    lease: LayerLease,
) -> Result<Json<Value>, ApiProblem> {
    let work = work_of(&params)?;
    let token = lease.fencing_token();
    let payment = work_on_order(&state.ledger, &order, Entry::Payment, token, work).await?;
    tracing::info!(%order, payment, %token, "payment recorded");
    Ok(Json(json!({
        "order": order,
        "payment": payment,
        "fencing_token": token.to_string(),
    })))
}

/// `POST /orders/{id}/pay-unlocked`: `pay`'s work without a lock, hence without a
/// fencing token (0).
async fn pay_unlocked(
    State(state): State<AppState>,
    Path(order): Path<String>,
    Query(params): Query<WorkParams>,
) -> Result<Json<Value>, ApiProblem> {
    let work = work_of(&params)?;
    let token = FencingToken::new(0);
    let payment = work_on_order(&state.ledger, &order, Entry::Payment, token, work).await?;
    Ok(Json(json!({
        "order": order,
        "payment": payment,
        "fencing_token": token.to_string(),
    })))
}

/// `POST /orders/{id}/ship`: runs under the order's lock, after waiting for it.
async fn ship(
    State(state): State<AppState>,
    Path(order): Path<String>,
    Query(params): Query<WorkParams>,
    lease: LayerLease,
) -> Result<Json<Value>, ApiProblem> {
    let work = work_of(&params)?;
    let token = lease.fencing_token();
    let shipment = work_on_order(&state.ledger, &order, Entry::Shipment, token, work).await?;
    tracing::info!(%order, shipment, %token, "shipment recorded");
    Ok(Json(json!({
        "order": order,
        "shipment": shipment,
        "fencing_token": token.to_string(),
    })))
}

/// The body of `pay` and `ship`: enter the ledger, do the slow part, record the entry
/// under the fencing token. Returns the entry's number (1 for the first payment).
async fn work_on_order(
    ledger: &Ledger,
    order: &str,
    entry: Entry,
    token: FencingToken,
    work: Duration,
) -> Result<u64, ApiProblem> {
    let visit = ledger.enter(order).await?;
    // The slow part, e.g. the call to the payment provider. Should the lease be lost
    // meanwhile, the layer (OnLost::Abort) drops this future, and `visit` with it.
    tokio::time::sleep(work).await;
    Ok(visit.record(entry, token).await?)
}

/// `POST /payments`: one request per `Idempotency-Key` at a time, and idempotent
/// replay: the first response for a key is recorded in the lock nodes, and the same key
/// again gets it back (`Idempotent-Replayed: true`) without running the handler. The
/// layer answers 400 `key-missing` without the header, 409 `request-in-progress` while a
/// request with the same key runs, and 422 `idempotency-key-reused` for the same key
/// with another request (method, path, query or body). Keys are the customer's: two
/// customers who pick the same key make two payments (400 `key-missing` without one).
/// With the ledger in PostgreSQL, the records are kept there and the charge commits with
/// its record (`postgres.rs`).
fn payments_route(locker: &Redlock, ledger: &Ledger) -> MethodRouter<AppState> {
    let customer = |parts: &Parts| customer(&parts.headers).map(str::to_owned);
    let layer = LockLayer::new(locker.clone(), lock_http::key::header("Idempotency-Key"));
    let replay = lock_http::replay::Replay::per_client(customer);
    #[cfg(feature = "postgres")]
    if let Some(records) = ledger.records() {
        return post(postgres::create_payment)
            .route_layer(layer.replay(replay.records_in(records.handlers_take_tx())));
    }
    let _ = ledger;
    post(create_payment).route_layer(layer.replay(replay))
}

/// The customer a request comes from. A demo: the bearer token is the customer's name;
/// a real service verifies the credentials first and uses its own account id.
fn customer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    value
        .strip_prefix("Bearer ")
        .filter(|name| !name.is_empty())
}

async fn create_payment(
    State(state): State<AppState>,
    Extension(key): Extension<RequestKey>,
    Query(params): Query<WorkParams>,
    headers: HeaderMap,
    lease: LayerLease,
    interrupted: Option<Extension<lock_http::InterruptedAttempt>>,
) -> Result<Json<Value>, ApiProblem> {
    let work = work_of(&params)?;
    // The layer refused a request without one.
    let customer = customer(&headers).unwrap_or_default();
    // The key the layer locked (`"8e03978e"` in the structured form gives `8e03978e`):
    // reading the header again could name another payment than the one locked.
    let key = key.as_str();
    let token = lease.fencing_token();
    // The ledger entry of this payment is named after its customer and key (`GET
    // /orders/payment:<customer>:<key>` shows it): a token orders writes of one lock only,
    // so it gets its own entry.
    let entry = format!("payment:{customer}:{key}");
    // An earlier attempt with this key was cut (its lease lost, its process gone) after
    // it may have charged: the ledger says whether its token made the charge.
    if let Some(Extension(attempt)) = interrupted {
        let record = state.ledger.order(&entry).await?;
        if record.last_token == Some(attempt.fencing_token().get()) {
            tracing::info!(idempotency_key = key, interrupted = %attempt.fencing_token(), "the interrupted attempt had charged: not charging again");
            return Ok(Json(json!({
                "idempotency_key": key,
                "payment": record.payments,
                "fencing_token": attempt.fencing_token().to_string(),
            })));
        }
    }
    // Charge first, then the slow part (the provider's confirmation, a receipt), as a
    // real payment handler does: a handler cut half-way has charged.
    let payment = state
        .ledger
        .enter(&entry)
        .await?
        .record(Entry::Payment, token)
        .await?;
    tokio::time::sleep(work).await;
    tracing::info!(idempotency_key = key, payment, %token, "payment created");
    Ok(Json(json!({
        "idempotency_key": key,
        "payment": payment,
        "fencing_token": token.to_string(),
    })))
}

/// `GET /orders/{id}`: what the ledger knows of an order. Takes no lock.
async fn order_status(
    State(state): State<AppState>,
    Path(order): Path<String>,
) -> Result<Json<Value>, ApiProblem> {
    let record = state.ledger.order(&order).await?;
    Ok(Json(json!({
        "order": order,
        "payments": record.payments,
        "shipments": record.shipments,
        "max_in_flight": record.max_in_flight,
        "last_fencing_token": record.last_token.map(|token| token.to_string()),
    })))
}
