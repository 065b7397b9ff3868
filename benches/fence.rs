//! What the fenced write adds to a transaction on the local PostgreSQL (issue 34).
//!
//! Two loops over one connection, interleaved in rounds so that the machine's load
//! drifts over both alike: a transaction that updates one row (`BEGIN`, `UPDATE`,
//! `COMMIT`), and the same transaction with `fence::postgres::advance` before the
//! `UPDATE` (the fence advanced under a new, larger token each time: the common path,
//! one statement). Prints the median time per transaction of each and their ratio.
//!
//! `cargo bench --bench fence --features postgres` (`$TOWER_REDLOCK_PG`, default
//! `postgres://postgres@127.0.0.1:5432`; a database of its own, dropped at the end).
//! `FENCE_BENCH_N` transactions per loop and round (default 2,000), 5 rounds.

// Shared with the tests; the bench uses part of it.
#[allow(dead_code)]
#[path = "../tests/support/postgres.rs"]
mod postgres;

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tower_redlock::fence;
use tower_redlock::{FencingToken, Resource};

const ROUNDS: usize = 5;

async fn plain(conn: &mut PgConnection, n: usize) -> Duration {
    let start = Instant::now();
    for i in 0..n {
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("UPDATE orders SET total = $1 WHERE id = 1")
            .bind(i as i64)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    start.elapsed() / n as u32
}

async fn fenced(conn: &mut PgConnection, n: usize, next: &mut u64) -> Duration {
    let resource = Resource::from("order:1");
    let start = Instant::now();
    for i in 0..n {
        *next += 1;
        let held = (resource.clone(), FencingToken::new(*next));
        let mut tx = conn.begin().await.unwrap();
        fence::postgres::advance(&mut tx, &held).await.unwrap();
        sqlx::query("UPDATE orders SET total = $1 WHERE id = 1")
            .bind(i as i64)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    start.elapsed() / n as u32
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: usize = std::env::var("FENCE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let db = postgres::TestDatabase::create().await;
    let mut conn = db.connect().await;
    fence::postgres::FenceTable::default()
        .create(&mut conn)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY, total bigint NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders VALUES (1, 0)")
        .execute(&mut conn)
        .await
        .unwrap();

    // Warm-up: prepared statements cached, the rows in memory.
    let mut next = 1_000_000;
    plain(&mut conn, n / 10).await;
    fenced(&mut conn, n / 10, &mut next).await;

    let (mut without, mut with) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        without.push(plain(&mut conn, n).await);
        with.push(fenced(&mut conn, n, &mut next).await);
    }
    let (without, with) = (median(without), median(with));
    let server: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    println!(
        "PostgreSQL {server}, {ROUNDS} rounds of {n} transactions each, medians per transaction:"
    );
    println!("| transaction | time |");
    println!("|---|---|");
    println!("| BEGIN; UPDATE; COMMIT | {without:.1?} |");
    println!("| BEGIN; fence advance; UPDATE; COMMIT | {with:.1?} |");
    println!(
        "ratio fenced / plain: {:.2}×",
        with.as_secs_f64() / without.as_secs_f64()
    );
}
