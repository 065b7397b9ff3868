//! Many transactions advancing one fence at once, at READ COMMITTED and SERIALIZABLE.
//! A watcher reads the fence throughout: it only grows. At READ COMMITTED every refused
//! transaction gets `Stale` with a token that won; at SERIALIZABLE a transaction whose
//! snapshot predates a concurrent commit fails with a serialization failure instead (a
//! retryable database error, not `Stale`), and is retried until it is accepted or
//! refused as stale.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rand::seq::SliceRandom;
use sqlx::{Connection, PgPool};
use tokio::sync::Barrier;
use tower_redlock::fence::postgres::{self as pg, FenceTable};
use tower_redlock::fence::FenceError;
use tower_redlock::{FencingToken, Resource};

use crate::held;
use crate::support::postgres::TestDatabase;

const TRANSACTIONS: usize = 16;
const ROUNDS: u64 = 4;

#[derive(Debug)]
enum Outcome {
    Won(u64),
    Stale { token: u64, current: u64 },
}

async fn contend(isolation: &'static str) -> (Vec<Outcome>, u32) {
    let db = TestDatabase::create().await;
    let pool: PgPool = db.pool(TRANSACTIONS as u32 + 1).await;
    FenceTable::default()
        .create(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let resource = Resource::from("hot");

    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (pool, done, resource) = (pool.clone(), done.clone(), resource.clone());
        tokio::spawn(async move {
            let mut seen = 0_u64;
            let mut reads = 0_u64;
            while !done.load(Ordering::Relaxed) {
                let mut conn = pool.acquire().await.unwrap();
                let now = FenceTable::default()
                    .current(&mut conn, &resource)
                    .await
                    .unwrap()
                    .map_or(0, FencingToken::get);
                assert!(now >= seen, "the fence went back from {seen} to {now}");
                seen = now;
                reads += 1;
            }
            reads
        })
    };

    let mut outcomes = Vec::new();
    let mut retries = 0;
    for round in 0..ROUNDS {
        // Tokens of this round, above every earlier round's, in random order.
        let mut tokens: Vec<u64> = (0..TRANSACTIONS as u64)
            .map(|i| (round + 1) * 1000 + i)
            .collect();
        tokens.shuffle(&mut rand::rng());
        let barrier = Arc::new(Barrier::new(TRANSACTIONS));
        let tasks: Vec<_> = tokens
            .into_iter()
            .map(|token| {
                let (pool, barrier) = (pool.clone(), barrier.clone());
                tokio::spawn(async move {
                    let mut retries = 0;
                    let mut first = true;
                    loop {
                        let mut conn = pool.acquire().await.unwrap();
                        let mut tx = conn.begin().await.unwrap();
                        sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {isolation}"))
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        // Take the snapshot, then all advance at once.
                        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
                        if first {
                            barrier.wait().await;
                            first = false;
                        }
                        let outcome = pg::advance(&mut tx, &held("hot", token)).await;
                        let outcome = match outcome {
                            Ok(()) => tx.commit().await.map(|()| Outcome::Won(token)),
                            Err(FenceError::Stale {
                                current, token: t, ..
                            }) => {
                                assert_eq!(t.get(), token);
                                Ok(Outcome::Stale {
                                    token,
                                    current: current.get(),
                                })
                            }
                            Err(error) if pg::is_retryable(&error) => {
                                retries += 1;
                                continue;
                            }
                            Err(error) => panic!("{isolation}: {error}"),
                        };
                        match outcome {
                            Ok(outcome) => return (outcome, retries),
                            // A commit can fail serialization too (SERIALIZABLE).
                            Err(sqlx::Error::Database(db))
                                if db.code().as_deref() == Some("40001") =>
                            {
                                retries += 1;
                            }
                            Err(error) => panic!("{isolation}: commit: {error}"),
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            let (outcome, r) = task.await.unwrap();
            retries += r;
            outcomes.push(outcome);
        }
    }
    done.store(true, Ordering::Relaxed);
    assert!(watcher.await.unwrap() > 0);

    let mut conn = pool.acquire().await.unwrap();
    let last = FenceTable::default()
        .current(&mut conn, &resource)
        .await
        .unwrap();
    let max = ROUNDS * 1000 + TRANSACTIONS as u64 - 1;
    assert_eq!(
        last,
        Some(FencingToken::new(max)),
        "the largest token always wins"
    );
    (outcomes, retries)
}

fn check(outcomes: &[Outcome]) {
    let won: BTreeSet<u64> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Won(token) => Some(*token),
            Outcome::Stale { .. } => None,
        })
        .collect();
    for outcome in outcomes {
        if let Outcome::Stale { token, current } = outcome {
            assert!(current > token, "{outcome:?}");
            assert!(
                won.contains(current),
                "{outcome:?}: {current} never won ({won:?})"
            );
        }
    }
    assert_eq!(outcomes.len(), TRANSACTIONS * ROUNDS as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_read_committed_the_fence_only_grows_and_every_refusal_names_a_winner() {
    let (outcomes, retries) = contend("READ COMMITTED").await;
    assert_eq!(
        retries, 0,
        "READ COMMITTED never fails serialization on the fence"
    );
    check(&outcomes);
    let stale = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Stale { .. }))
        .count();
    assert!(stale > 0, "the transactions did not contend: {outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_serializable_the_fence_only_grows_and_conflicts_are_retryable() {
    let (outcomes, retries) = contend("SERIALIZABLE").await;
    check(&outcomes);
    // Every transaction took its snapshot before any advanced: all but the first to
    // commit in a round meet a concurrent update (40001), retried, never `Stale`.
    assert!(
        retries > 0,
        "no serialization failure: the transactions did not overlap"
    );
    eprintln!("SERIALIZABLE: {retries} serialization failures retried");
}
