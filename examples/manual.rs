//! Taking the lock inside the handler with the `Locked<K>` extractor.
//!
//! ```sh
//! cargo run --example manual          # PORT (default 3002); in memory
//!
//! curl -s -X POST 'localhost:3002/invoices/7/send?work_ms=2000' &
//! curl -s -i -X POST localhost:3002/invoices/7/send; wait    # 409 lock-held
//!
//! curl -s -X POST 'localhost:3002/accounts/1/transfer?amount=30' &
//! curl -s -X POST 'localhost:3002/accounts/1/transfer?amount=12'; wait  # both, in turn
//! ```
//!
//! [`LockLayer`](tower_redlock::http::LockLayer) is the simplest way to lock a route.
//! The extractor suits handlers that want the lease in their own hands: to race the
//! critical section against the lost signal, to release before slow work that needs
//! no lock, or to say in the signature which lock a handler runs under. The lock is
//! named by a marker type implementing [`LockKey`]; the locker comes from the state.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRef, Path, Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_redlock::axum::{LockKey, Locked};
use tower_redlock::http::{
    key::{path_param, PathParam},
    Contention, Scope,
};
use tower_redlock::Redlock;
use tracing_subscriber::EnvFilter;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One lock per invoice (and route): a second `send` of one invoice gets 409.
struct InvoiceId;

impl LockKey for InvoiceId {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }
}

/// One lock per account, `account:{id}`, whatever the route; transfers wait their turn.
struct AccountId;

impl LockKey for AccountId {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }

    fn scope() -> Scope {
        Scope::shared("account")
    }

    fn contention() -> Contention {
        Contention::Wait {
            timeout: Duration::from_secs(5),
        }
    }
}

/// The extractors find the locker through `FromRef`. The derive needs axum's `macros`
/// feature (`axum = { version = "0.8", features = ["macros"] }`); without it, write
/// `impl FromRef<AppState> for Redlock` by hand.
#[derive(Clone, FromRef)]
struct AppState {
    locker: Redlock,
    balances: Arc<Mutex<HashMap<String, i64>>>,
}

#[derive(Deserialize)]
struct Params {
    work_ms: Option<u64>,
    amount: Option<i64>,
}

/// `POST /invoices/{id}/send`: the critical section races the lost signal.
async fn send_invoice(
    Path(id): Path<String>,
    Query(params): Query<Params>,
    invoice: Locked<InvoiceId>,
) -> (StatusCode, Json<Value>) {
    let work = Duration::from_millis(params.work_ms.unwrap_or(50).min(60_000));
    let token = invoice.fencing_token();
    tokio::select! {
        // The lease is lost (renewals failed, or it was taken over): stop here.
        cause = invoice.lost() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "invoice": id, "error": format!("lock lost: {cause}") })),
        ),
        () = tokio::time::sleep(work) => {
            tracing::info!(invoice = %id, %token, "invoice sent");
            (
                StatusCode::OK,
                Json(json!({ "invoice": id, "sent": true, "fencing_token": token.to_string() })),
            )
        }
    }
} // `invoice` drops here: the lease is released in the background

/// `POST /accounts/{id}/transfer?amount=N`: read, modify, write under the lock, then
/// release before the slow part that needs no lock.
async fn transfer(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(params): Query<Params>,
    account: Locked<AccountId>,
) -> Json<Value> {
    let amount = params.amount.unwrap_or(10);
    let balance = {
        let mut balances = state.balances.lock().unwrap_or_else(|e| e.into_inner());
        let balance = balances.entry(id.clone()).or_insert(100);
        *balance -= amount;
        *balance
    };
    let token = account.fencing_token();
    // Done with the account: let the next transfer in, and see that the release worked
    // (`None`: the request held the account already, and its owner releases it).
    let released = match account.into_lease() {
        Some(lease) => Some(lease.release().await),
        None => None,
    };
    // ... send the receipt by e-mail: slow, and needs no lock ...
    tracing::info!(account = %id, amount, balance, %token, ?released, "transfer done");
    Json(json!({ "account": id, "balance": balance, "fencing_token": token.to_string() }))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse().map_err(|_| format!("PORT: {port:?}"))?,
        Err(_) => 3002,
    };
    let state = AppState {
        locker: Redlock::in_memory(),
        balances: Arc::default(),
    };
    let app = Router::new()
        .route("/invoices/{id}/send", post(send_invoice))
        .route("/accounts/{id}/transfer", post(transfer))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
