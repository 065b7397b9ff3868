//! What PostgreSQL costs through the crate (issue 47), each against a baseline doing the
//! same round trips by hand, in the same run:
//!
//! - **node**: `try_acquire` + `release` of one resource on a locker over one
//!   [`PostgresNode`], against the same two statements sent by hand with sqlx (a lease
//!   row upserted where it expired with its fence counter stepped, in one statement;
//!   then deleted where it is the owner's, with `pg_notify`), on a pool of one connection;
//!   and against the node's own function calls sent by hand (the same server work: what
//!   the crate adds on the client).
//! - **payments**: `POST /pay` with a unique `Idempotency-Key` each, served by
//!   `axum::serve` to keep-alive clients: the crate's route (`LockLayer` over the
//!   in-memory lock, `Replay::records_in(PgRecords)`, a handler inserting the payment
//!   through `Tx`), against a hand-written route that looks the key up, then inserts the
//!   payment and its idempotency row in one transaction. Both commit once per payment
//!   with the payment row; the crate also commits its claim (the pending marker) before
//!   the handler runs; with `PgRecords::handlers_take_tx`, it claims in the handler's
//!   transaction instead and commits once.
//!
//! `cargo bench --bench postgres --features "postgres axum"` (`$TOWER_REDLOCK_PG`,
//! default `postgres://postgres@127.0.0.1:5432`; a database of its own, dropped at the
//! end). Options: `-- --secs N` (2) per row, `-- --reps N` (3), `-- --conns N` (8),
//! `-- --node-only` (the node's rows alone).
//! Rows alternate which side goes first; medians of the repetitions.

#[allow(dead_code)]
#[path = "../tests/support/postgres.rs"]
mod postgres;

#[path = "../tests/support/http_client.rs"]
mod http_client;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use http_client::{Req, Served};
use sqlx::{Executor, PgPool, Row};
use tower_redlock::axum::Tx;
use tower_redlock::http::replay::{PgRecords, Replay};
use tower_redlock::http::{key::header, LockLayer};
use tower_redlock::{LockOptions, PostgresNode, Redlock};

fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(default)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Acquire + release through the crate, per second, for `secs`.
async fn node_crate(locker: &Redlock, secs: Duration) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < secs {
        let lease = locker.try_acquire("bench").await.expect("free");
        lease.release().await;
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

const RAW_ACQUIRE: &str = "WITH taken AS (
        INSERT INTO raw_leases AS l (key, owner, expires_at)
        VALUES ('bench', $1::text, clock_timestamp() + interval '30 seconds')
        ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at <= clock_timestamp()
        RETURNING key
    ), fenced AS (
        INSERT INTO raw_fences AS c (key, counter)
        SELECT 'bench', $2::int8 FROM taken
        ON CONFLICT (key) DO UPDATE SET counter = greatest(c.counter + 1, EXCLUDED.counter)
        RETURNING counter
    )
    SELECT (SELECT counter FROM fenced)";

const RAW_RELEASE: &str = "WITH gone AS (
        DELETE FROM raw_leases WHERE key = 'bench' AND owner = $1::text RETURNING key
    )
    SELECT count(pg_notify('raw_released', key)) FROM gone";

/// The node's own calls of its schema's functions (the same server work as the crate's
/// statements), inline, by hand.
const CALL_ACQUIRE: &str = "SELECT * FROM redlock_acquire_one('raw-bench', 'raw-bench:fence', \
     $1::text, 30000, true, $2::int8, 86400000, false)";
const CALL_RELEASE: &str = "SELECT redlock_release_one('raw-bench', 'raw-bench', $1::text, true)";

/// How the baseline sends its two round trips.
#[derive(Clone, Copy, PartialEq)]
enum Raw {
    /// Hand-written statements inline in the simple query protocol (as the node sends
    /// its calls by default).
    Inline,
    /// The same, prepared, values bound.
    Prepared,
    /// The node's function calls, inline.
    Calls,
}

/// The same two round trips by hand.
async fn node_raw(pool: &PgPool, secs: Duration, how: Raw) -> f64 {
    let (acquire, release, token_at) = match how {
        Raw::Calls => (CALL_ACQUIRE, CALL_RELEASE, 1),
        _ => (RAW_ACQUIRE, RAW_RELEASE, 0),
    };
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < secs {
        let owner = format!("{:032x}", rand::random::<u128>());
        let floor = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64)
            << 10;
        let row = if how == Raw::Prepared {
            let query = sqlx::query(acquire).bind(&owner).bind(floor);
            query.fetch_one(pool).await.unwrap()
        } else {
            let inline = acquire
                .replace("$1::text", &format!("'{owner}'"))
                .replace("$2::int8", &floor.to_string());
            pool.fetch_one(inline.as_str()).await.unwrap()
        };
        let token: Option<i64> = row.try_get(token_at).unwrap();
        assert!(token.is_some(), "the raw lease is free");
        if how == Raw::Prepared {
            sqlx::query(release)
                .bind(&owner)
                .execute(pool)
                .await
                .unwrap();
        } else {
            let inline = release.replace("$1::text", &format!("'{owner}'"));
            pool.execute(inline.as_str()).await.unwrap();
        }
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn pay_through_tx(
    headers: HeaderMap,
    mut tx: Tx,
) -> Result<(StatusCode, String), StatusCode> {
    let key = headers["idempotency-key"]
        .to_str()
        .unwrap_or_default()
        .to_owned();
    sqlx::query("INSERT INTO payments (key, amount) VALUES ($1, 100)")
        .bind(&key)
        .execute(&mut *tx)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, format!("paid {key}")))
}

/// `fenced`: with the write fence the crate's `Tx` advances (a row per key in the
/// same transaction), so that both sides do the same writes.
async fn pay_by_hand(
    State((pool, fenced)): State<(PgPool, bool)>,
    headers: HeaderMap,
) -> Result<(StatusCode, String), StatusCode> {
    let failed = |_| StatusCode::INTERNAL_SERVER_ERROR;
    let key = headers["idempotency-key"]
        .to_str()
        .unwrap_or_default()
        .to_owned();
    let found: Option<String> = sqlx::query_scalar("SELECT body FROM hand_records WHERE key = $1")
        .bind(&key)
        .fetch_optional(&pool)
        .await
        .map_err(failed)?;
    if let Some(body) = found {
        return Ok((StatusCode::CREATED, body));
    }
    let body = format!("paid {key}");
    let mut tx = pool.begin().await.map_err(failed)?;
    if fenced {
        sqlx::query(
            "INSERT INTO redlock_fences AS f (resource, token) VALUES ($1, 1) \
             ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token \
             WHERE f.token < EXCLUDED.token",
        )
        .bind(&key)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    }
    sqlx::query("INSERT INTO payments (key, amount) VALUES ($1, 100)")
        .bind(&key)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    sqlx::query("INSERT INTO hand_records (key, body) VALUES ($1, $2)")
        .bind(&key)
        .bind(&body)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    Ok((StatusCode::CREATED, body))
}

/// Payments per second through `app` from `conns` keep-alive clients for `secs`.
async fn payments(app: Router, conns: usize, secs: Duration, next: &Arc<AtomicU64>) -> f64 {
    let served = Served::start(app).await;
    let start = Instant::now();
    let clients = (0..conns).map(|_| {
        let (next, addr) = (next.clone(), served.addr);
        tokio::spawn(async move {
            let mut conn = http_client::Conn::open(addr).await;
            let mut n = 0u64;
            while start.elapsed() < secs {
                let key = format!("k{}", next.fetch_add(1, Ordering::Relaxed));
                let reply = conn
                    .send(Req::post("/pay").header("Idempotency-Key", &key))
                    .await;
                assert_eq!(reply.status, 201, "{}", reply.text());
                n += 1;
            }
            n
        })
    });
    let mut total = 0;
    for client in clients.collect::<Vec<_>>() {
        total += client.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let secs = Duration::from_secs_f64(flag("--secs", 2.0));
    let reps: usize = flag("--reps", 3);
    let conns: usize = flag("--conns", 8);
    let node_only = std::env::args().any(|a| a == "--node-only");
    let db = postgres::TestDatabase::create().await;
    let pool = db.pool(16).await;
    let pools = [db.pool(1).await, db.pool(1).await];
    let node_pool = db.pool(1).await;
    pool.execute(
        "CREATE TABLE raw_leases (key text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL);
         CREATE TABLE raw_fences (key text PRIMARY KEY, counter bigint NOT NULL);
         CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL, amount bigint NOT NULL);
         CREATE TABLE hand_records (key text PRIMARY KEY, body text NOT NULL);",
    )
    .await
    .unwrap();

    // One connection per locker (inline, prepared), one for the baseline.
    let lockers = [false, true].map(|prepared| {
        let node = PostgresNode::new(pools[usize::from(prepared)].clone());
        Redlock::new([node.prepared_statements(prepared)], LockOptions::default()).unwrap()
    });
    lockers[0]
        .try_acquire("warm")
        .await
        .unwrap()
        .release()
        .await;
    let records = PgRecords::new(pool.clone());
    records.create().await.unwrap();
    // The marker committed before the handler (any handler), or claimed in its
    // transaction (`handlers_take_tx`).
    let crate_apps = [records.clone(), records.handlers_take_tx()].map(|records| {
        Router::new()
            .route("/pay", post(pay_through_tx))
            .route_layer(
                LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
                    .replay(Replay::global().records_in(records)),
            )
    });
    let [hand_app, hand_fenced_app] = [false, true].map(|fenced| {
        Router::new()
            .route("/pay", post(pay_by_hand))
            .with_state((pool.clone(), fenced))
    });
    let next = Arc::new(AtomicU64::new(0));
    // Warm-up: connections opened, statements prepared, tables' first pages in.
    // Each locker (inline, prepared) against each way of sending the baseline.
    let node_pairs = [(0, Raw::Inline), (1, Raw::Prepared), (0, Raw::Calls)];
    for (locker, raw) in node_pairs {
        node_crate(&lockers[locker], Duration::from_millis(300)).await;
        node_raw(&node_pool, Duration::from_millis(300), raw).await;
    }
    let mut node_rows = [Vec::new(), Vec::new(), Vec::new()];
    let mut pay_rows = [Vec::new(), Vec::new(), Vec::new()];
    let pay_pairs = [
        (&crate_apps[0], &hand_app),
        (&crate_apps[1], &hand_app),
        (&crate_apps[1], &hand_fenced_app),
    ];
    for rep in 0..reps {
        for ((locker, how), rows) in node_pairs.into_iter().zip(&mut node_rows) {
            let locker = &lockers[locker];
            let (ours, raw) = if rep % 2 == 0 {
                let ours = node_crate(locker, secs).await;
                (ours, node_raw(&node_pool, secs, how).await)
            } else {
                let raw = node_raw(&node_pool, secs, how).await;
                (node_crate(locker, secs).await, raw)
            };
            rows.push((ours, raw));
        }
        for ((app, hand_app), rows) in pay_pairs.into_iter().zip(&mut pay_rows) {
            if node_only {
                break;
            }
            let (ours, hand) = if rep % 2 == 0 {
                let ours = payments(app.clone(), conns, secs, &next).await;
                (ours, payments(hand_app.clone(), conns, secs, &next).await)
            } else {
                let hand = payments(hand_app.clone(), conns, secs, &next).await;
                (payments(app.clone(), conns, secs, &next).await, hand)
            };
            rows.push((ours, hand));
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("| measure | crate /s | baseline /s | crate ÷ baseline |");
    println!("|---|---|---|---|");
    let row = |name: &str, rows: &[(f64, f64)]| {
        println!(
            "| {name} | {:.0} | {:.0} | {:.2}× |",
            median(rows.iter().map(|r| r.0).collect()),
            median(rows.iter().map(|r| r.1).collect()),
            median(rows.iter().map(|r| r.0 / r.1).collect())
        );
    };
    let [inline, prepared, calls] = &node_rows;
    let pay_rows = pay_rows.map(|rows| {
        if rows.is_empty() {
            vec![(f64::NAN, f64::NAN)]
        } else {
            rows
        }
    });
    row(
        "acquire + release, PostgresNode vs raw sqlx: inline (the default) vs statements by hand",
        inline,
    );
    row(
        "the same, prepared (`statements=prepared`) vs statements by hand, prepared",
        prepared,
    );
    row(
        "PostgresNode inline vs its own function calls by hand, inline",
        calls,
    );
    row(
        &format!("POST /pay, Tx + records vs by hand ({conns} keep-alive clients)"),
        &pay_rows[0],
    );
    row(
        "the same, `PgRecords::handlers_take_tx` (the marker in the handler's transaction)",
        &pay_rows[1],
    );
    row(
        "the same vs by hand with the write fence `Tx` advances (the same writes)",
        &pay_rows[2],
    );
    println!(
        "\n{secs:?} per row, medians of {reps} repetitions, sides alternating. Load average: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    drop((pool, pools, node_pool));
}
