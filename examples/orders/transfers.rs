//! Transfers between accounts: one request, two locks.
//!
//! `POST /transfers` with `{"from": "<account>", "to": "<account>", "amount": <integer>}`
//! (and an optional `?work_ms=N`) locks both accounts as one lease —
//! [`json_fields`]`(["/from", "/to"])`, each field a resource of its own in the
//! `account` scope — waiting for them ([`Contention::Wait`]). The lease takes the
//! accounts in a canonical order, so a transfer a → b and one b → a never deadlock.
//! The handler then moves the amount, writing each balance only with that account's
//! fencing token, as the orders ledger writes with its token.
//!
//! The two writes are separate steps (the accounts may live on different shards of a
//! Cluster): should the second be refused as stale — this request's lease ended and
//! another holder wrote since — the first stays applied and the client gets 409
//! `stale-fencing-token`. Your database would commit both in one transaction, each row
//! checked against its own token.
//!
//! The request is checked before anything is locked (`check_transfer`, a middleware in
//! front of the lock layer): the same account twice, a missing account, an amount that
//! is not a positive whole number or an invalid `work_ms` get 400
//! `invalid-transfer` (or `invalid-work-ms`) and lock nothing.
//!
//! `GET /accounts/{id}` answers `{"account", "balance", "transfers", "max_in_flight"}`:
//! balances start at 0 and may go negative; `max_in_flight` is the most transfers ever
//! seen inside the account's critical section at once, 1 under the lock. Accounts live
//! where the ledger lives (this process, or the Redis of `LEDGER_URL`), so every
//! instance sees the same balances.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tower_redlock::axum::LayerLease;
use tower_redlock::http::{key::json_fields, Contention, LockLayer, RequestKeys, Scope};
use tower_redlock::{FencingToken, Redlock};

use super::{
    lock, work_of, ApiProblem, AppState, Config, Ledger, LedgerConnection, LedgerError, Store,
    WorkParams,
};

/// The largest amount one transfer moves: balances stay far from `i64` overflow.
const MAX_AMOUNT: i64 = 1_000_000_000_000;

/// The largest transfer body read.
const MAX_BODY: usize = 16 * 1024;

/// `POST /transfers` and `GET /accounts/{id}`.
pub(super) fn routes(locker: &Redlock, config: &Config) -> Router<AppState> {
    let accounts_lock = LockLayer::new(locker.clone(), json_fields(["/from", "/to"]))
        .scope(Scope::shared("account"))
        .contention(Contention::Wait {
            timeout: config.wait_timeout,
        });
    Router::new()
        .route(
            "/transfers",
            post(transfer)
                .route_layer(accounts_lock)
                // The outer layer: a request is checked before anything is locked.
                .route_layer(middleware::from_fn(check_transfer)),
        )
        .route("/accounts/{id}", get(account_status))
}

/// A checked transfer request, left in the request extensions by `check_transfer`.
#[derive(Debug, Clone)]
struct Transfer {
    from: String,
    to: String,
    amount: i64,
    work: Duration,
}

fn invalid(detail: impl Into<String>) -> ApiProblem {
    ApiProblem::new(
        StatusCode::BAD_REQUEST,
        "invalid-transfer",
        "Invalid transfer",
        detail,
    )
}

/// Reads and checks the body and `work_ms`; 400 for a transfer that cannot be made,
/// before the lock layer sees the request.
async fn check_transfer(request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(error) => {
            return invalid(format!("the body could not be read: {error}")).into_response()
        }
    };
    let params = axum::extract::Query::<WorkParams>::try_from_uri(&parts.uri);
    let checked = match params {
        Ok(params) => parse_transfer(&bytes, &params.0),
        Err(error) => Err(ApiProblem::new(
            StatusCode::BAD_REQUEST,
            "invalid-work-ms",
            "Invalid work_ms",
            error.body_text(),
        )),
    };
    match checked {
        Ok(transfer) => {
            parts.extensions.insert(transfer);
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(problem) => problem.into_response(),
    }
}

fn parse_transfer(body: &[u8], params: &WorkParams) -> Result<Transfer, ApiProblem> {
    let work = work_of(params)?;
    let json: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("the body is not JSON: {e}")))?;
    let account = |field: &str| match json.get(field) {
        Some(Value::String(id)) if !id.is_empty() => Ok(id.clone()),
        Some(Value::String(_)) => Err(invalid(format!("`{field}` is empty"))),
        None | Some(Value::Null) => Err(invalid(format!(
            "`{field}` is missing: the account to move the amount {}",
            if field == "from" { "from" } else { "to" }
        ))),
        Some(other) => Err(invalid(format!(
            "`{field}` must be a string (an account id), got {other}"
        ))),
    };
    let (from, to) = (account("from")?, account("to")?);
    if from == to {
        return Err(invalid(format!(
            "`from` and `to` are the same account, {from:?}"
        )));
    }
    let amount = match json.get("amount") {
        None | Some(Value::Null) => return Err(invalid("`amount` is missing")),
        Some(Value::Number(n)) => n.as_i64().filter(|a| (1..=MAX_AMOUNT).contains(a)),
        Some(_) => None,
    };
    let Some(amount) = amount else {
        return Err(invalid(format!(
            "`amount` must be a whole number from 1 to {MAX_AMOUNT}, got {}",
            json["amount"]
        )));
    };
    Ok(Transfer {
        from,
        to,
        amount,
        work,
    })
}

/// `POST /transfers`: runs under the lease on both accounts (the layer took it).
async fn transfer(
    State(state): State<AppState>,
    Extension(transfer): Extension<Transfer>,
    Extension(keys): Extension<RequestKeys>,
    lease: LayerLease,
) -> Result<Json<Value>, ApiProblem> {
    let Transfer {
        from,
        to,
        amount,
        work,
    } = transfer;
    // Each account's token, by the resource the layer named after its key.
    let token_of = |account: &str| {
        keys.resource(account)
            .and_then(|resource| lease.fencing_token_of(resource))
            .ok_or_else(|| {
                ApiProblem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "account-not-locked",
                    "Account not locked",
                    format!("the lease does not hold the account {account:?}"),
                )
            })
    };
    let (from_token, to_token) = (token_of(&from)?, token_of(&to)?);
    let mut visit = state.accounts.enter(&[&from, &to]).await?;
    // The slow part. Should the lease be lost meanwhile, the layer (OnLost::Abort) drops
    // this future, and `visit` with it: nothing is written.
    tokio::time::sleep(work).await;
    let from_balance = visit.write(&from, -amount, from_token).await?;
    let to_balance = visit.write(&to, amount, to_token).await?;
    tracing::info!(%from, %to, amount, %from_token, %to_token, "transfer recorded");
    Ok(Json(json!({
        "from": from,
        "to": to,
        "amount": amount,
        "balances": { &from: from_balance, &to: to_balance },
        "fencing_tokens": { &from: from_token.to_string(), &to: to_token.to_string() },
    })))
}

/// `GET /accounts/{id}`: what is known of an account. Takes no lock.
async fn account_status(
    State(state): State<AppState>,
    Path(account): Path<String>,
) -> Result<Json<Value>, ApiProblem> {
    let record = state.accounts.account(&account).await?;
    Ok(Json(json!({
        "account": account,
        "balance": record.balance,
        "transfers": record.transfers,
        "max_in_flight": record.max_in_flight,
    })))
}

// ------------------------------------------------------------------------------------
// The accounts: what the locks protect

/// What is known of one account.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccountRecord {
    /// The balance: 0 at first, may go negative.
    pub balance: i64,
    /// Transfers from or to the account.
    pub transfers: u64,
    /// Transfers working on the account right now.
    pub in_flight: i64,
    /// The most transfers that ever worked on the account at once: 1 under the lock.
    pub max_in_flight: i64,
    /// The fencing token of the last accepted write.
    pub last_token: Option<u64>,
}

/// The balances, beside the ledger (in this process, or in the ledger's Redis). Cheap to
/// clone.
#[derive(Clone)]
pub struct Accounts {
    store: AccountStore,
}

#[derive(Clone)]
enum AccountStore {
    Memory(Arc<Mutex<HashMap<String, AccountRecord>>>),
    Redis {
        connection: LedgerConnection,
        scripts: Arc<AccountScripts>,
    },
}

struct AccountScripts {
    enter: redis::Script,
    leave: redis::Script,
    write: redis::Script,
}

// KEYS[1]: the account's hash; ARGV[1]: the amount to add (negative for a debit);
// ARGV[2]: the writer's fencing token, in decimal. The writer leaves the in-flight
// count, then its write is accepted only with a token larger than the last one
// (compared as decimal text, as `tower_redlock::fence::redis` does). An increment is not a
// plain set, so this one keeps a script of its own.
const WRITE: &str = r"
redis.call('HINCRBY', KEYS[1], 'in_flight', -1)
local token = ARGV[2]
local last = redis.call('HGET', KEYS[1], 'last_token')
if last and (#last > #token or (#last == #token and last >= token)) then
  return {'stale', last}
end
redis.call('HSET', KEYS[1], 'last_token', token)
redis.call('HINCRBY', KEYS[1], 'transfers', 1)
return {'ok', tostring(redis.call('HINCRBY', KEYS[1], 'balance', ARGV[1]))}
";

impl Accounts {
    /// The accounts where `ledger` keeps its orders.
    pub fn beside(ledger: &Ledger) -> Accounts {
        let store = match &ledger.store {
            Store::Memory(_) => AccountStore::Memory(Arc::default()),
            // The balances stay in this process when the orders live in PostgreSQL.
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => AccountStore::Memory(Arc::default()),
            Store::Redis { connection, .. } => AccountStore::Redis {
                connection: connection.clone(),
                scripts: Arc::new(AccountScripts {
                    enter: redis::Script::new(super::ENTER),
                    leave: redis::Script::new(super::LEAVE),
                    write: redis::Script::new(WRITE),
                }),
            },
        };
        Accounts { store }
    }

    fn key(account: &str) -> String {
        format!("orders-example:account:{account}")
    }

    /// A transfer starts working on `accounts`. Write with the returned [`AccountVisit`].
    pub async fn enter(&self, accounts: &[&str]) -> Result<AccountVisit, LedgerError> {
        let mut visit = AccountVisit {
            accounts: self.clone(),
            open: Vec::with_capacity(accounts.len()),
        };
        for &account in accounts {
            match &self.store {
                AccountStore::Memory(records) => {
                    let mut records = lock(records);
                    let record = records.entry(account.to_owned()).or_default();
                    record.in_flight += 1;
                    record.max_in_flight = record.max_in_flight.max(record.in_flight);
                }
                AccountStore::Redis {
                    connection,
                    scripts,
                } => {
                    let _: i64 = scripts
                        .enter
                        .key(Self::key(account))
                        .invoke_async(&mut connection.get().await?)
                        .await?;
                }
            }
            // Entered: a visit dropped from here on leaves this account again.
            visit.open.push(account.to_owned());
        }
        Ok(visit)
    }

    /// What is known of `account` (zeros for an unknown account).
    pub async fn account(&self, account: &str) -> Result<AccountRecord, LedgerError> {
        match &self.store {
            AccountStore::Memory(records) => {
                Ok(lock(records).get(account).cloned().unwrap_or_default())
            }
            AccountStore::Redis { connection, .. } => {
                let fields: Vec<Option<String>> = redis::cmd("HMGET")
                    .arg(Self::key(account))
                    .arg(&[
                        "balance",
                        "transfers",
                        "in_flight",
                        "max_in_flight",
                        "last_token",
                    ])
                    .query_async(&mut connection.get().await?)
                    .await?;
                let number = |i: usize| -> Result<i64, LedgerError> {
                    match fields.get(i).cloned().flatten() {
                        None => Ok(0),
                        Some(text) => text.parse().map_err(|_| {
                            LedgerError::Unavailable(format!("account field {i} is {text:?}"))
                        }),
                    }
                };
                Ok(AccountRecord {
                    balance: number(0)?,
                    transfers: number(1)?.max(0) as u64,
                    in_flight: number(2)?,
                    max_in_flight: number(3)?,
                    last_token: fields
                        .get(4)
                        .cloned()
                        .flatten()
                        .and_then(|text| text.parse().ok()),
                })
            }
        }
    }
}

/// A transfer at work on its accounts, between [`Accounts::enter`] and the writes.
/// Dropped before writing an account (the handler was stopped), it leaves that
/// account's in-flight count.
pub struct AccountVisit {
    accounts: Accounts,
    /// Accounts entered and not written yet.
    open: Vec<String>,
}

impl AccountVisit {
    /// Adds `amount` to the balance of `account` with the writer's fencing token for
    /// that account, and leaves it. Refused when the token is not larger than the last
    /// one accepted for the account. Returns the new balance.
    pub async fn write(
        &mut self,
        account: &str,
        amount: i64,
        token: FencingToken,
    ) -> Result<i64, LedgerError> {
        // Written (or refused): the write itself leaves the in-flight count.
        self.open.retain(|open| open != account);
        match &self.accounts.store {
            AccountStore::Memory(records) => {
                let mut records = lock(records);
                let record = records.entry(account.to_owned()).or_default();
                record.in_flight -= 1;
                if let Some(last) = record.last_token.filter(|&last| last >= token.get()) {
                    return Err(LedgerError::Stale { token, last });
                }
                record.last_token = Some(token.get());
                record.transfers += 1;
                record.balance += amount;
                Ok(record.balance)
            }
            AccountStore::Redis {
                connection,
                scripts,
            } => {
                let (outcome, value): (String, String) = scripts
                    .write
                    .key(Accounts::key(account))
                    .arg(amount)
                    .arg(token.get())
                    .invoke_async(&mut connection.get().await?)
                    .await?;
                let number = value.parse::<i64>().map_err(|_| {
                    LedgerError::Unavailable(format!("unexpected account reply {value:?}"))
                })?;
                match outcome.as_str() {
                    "ok" => Ok(number),
                    _ => Err(LedgerError::Stale {
                        token,
                        last: number.max(0) as u64,
                    }),
                }
            }
        }
    }
}

impl Drop for AccountVisit {
    fn drop(&mut self) {
        let open = std::mem::take(&mut self.open);
        if open.is_empty() {
            return;
        }
        match &self.accounts.store {
            AccountStore::Memory(records) => {
                let mut records = lock(records);
                for account in &open {
                    if let Some(record) = records.get_mut(account) {
                        record.in_flight -= 1;
                    }
                }
            }
            AccountStore::Redis {
                connection,
                scripts,
            } => {
                // Drop cannot wait: leave in the background.
                let (connection, scripts) = (connection.clone(), scripts.clone());
                tokio::spawn(async move {
                    for account in open {
                        let left: Result<i64, _> = match connection.get().await {
                            Ok(mut connection) => {
                                scripts
                                    .leave
                                    .key(Accounts::key(&account))
                                    .invoke_async(&mut connection)
                                    .await
                            }
                            Err(error) => Err(error),
                        };
                        if let Err(error) = left {
                            tracing::warn!(%error, "accounts: leaving the in-flight count failed");
                        }
                    }
                });
            }
        }
    }
}
