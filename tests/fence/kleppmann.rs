//! Kleppmann's scenario end to end: holder A acquires, pauses past its ttl (its own
//! await: it does not write until its lease has expired), holder B acquires, writes and
//! commits; A resumes and writes with its token: the store refuses, nothing of A's
//! write lands, B's stays. Three lock nodes, two of them (a majority) restarted from
//! snapshots taken before A acquired, so their fence counters come back behind A's
//! token: only the clock floor keeps B's token above A's.

use std::time::Duration;

use sqlx::Connection;
use tower_redlock::fence::{self, FenceError};
use tower_redlock::{FencingToken, Lease, LockError, LockOptions, Redlock};

use crate::support::postgres::TestDatabase;
use crate::support::{self, RedisServer};

const RESOURCE: &str = "invoice:7";

/// Three nodes with a counter for `RESOURCE` already, A's lease, and the snapshots of
/// two nodes taken before A acquired.
struct Scene {
    servers: Vec<RedisServer>,
    /// A's process.
    locker: Redlock,
    /// B's process: another locker over the same nodes.
    other: Redlock,
}

impl Scene {
    async fn start() -> Scene {
        let servers = RedisServer::start_many(3);
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let options = LockOptions::default()
            .node_timeout(Duration::from_millis(200))
            .ttl(Duration::from_millis(600))
            .watchdog(false);
        let locker = Redlock::connect(&urls, options.clone()).await.unwrap();
        let other = Redlock::connect(&urls, options).await.unwrap();
        Scene {
            servers,
            locker,
            other,
        }
    }

    /// A earlier holder, so the counters exist, then the stale snapshots, then A.
    async fn a_acquires_after_stale_snapshots(&mut self) -> (Lease, Vec<support::Snapshot>) {
        let earlier = self.locker.try_acquire(RESOURCE).await.unwrap();
        earlier.release().await;
        let snapshots = tokio::task::block_in_place(|| {
            self.servers[..2]
                .iter()
                .map(RedisServer::snapshot)
                .collect()
        });
        let a = self.locker.try_acquire(RESOURCE).await.unwrap();
        (a, snapshots)
    }

    /// A's pause: it awaits its own lease's expiry, then two nodes lose their state.
    async fn pause_past_ttl_and_restore(&mut self, a: &Lease, snapshots: &[support::Snapshot]) {
        let cause = a.lost().await;
        assert_eq!(cause, tower_redlock::LostCause::Expired);
        tokio::task::block_in_place(|| {
            for (server, snapshot) in self.servers.iter_mut().zip(snapshots) {
                server.restart_from(snapshot);
            }
        });
        for server in &self.servers[..2] {
            assert!(
                counter(server) < a.fencing_token().get(),
                "the restored counter must be behind A's token for the floor to matter"
            );
        }
    }

    /// B's lease, once the restarted nodes answer again.
    async fn b_acquires(&self, a: &Lease) -> Lease {
        let mut last = None;
        for _ in 0..100 {
            match self.other.try_acquire(RESOURCE).await {
                Ok(b) => {
                    assert!(
                        b.fencing_token() > a.fencing_token(),
                        "B {} A {}",
                        b.fencing_token(),
                        a.fencing_token()
                    );
                    return b;
                }
                // The restarted nodes' connections come back on the next calls; until
                // then the node A's key may still live on (drift) is all that answers.
                Err(e @ (LockError::Unavailable { .. } | LockError::Held { .. })) => last = Some(e),
                Err(e) => panic!("B could not acquire: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("B could not acquire: {last:?}");
    }
}

fn counter(server: &RedisServer) -> u64 {
    let fence_key = server
        .keys("*fence*")
        .into_iter()
        .next()
        .expect("a fence counter");
    server
        .get(&fence_key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_paused_holder_s_transaction_is_refused_and_commits_nothing() {
    let db = TestDatabase::create().await;
    let mut conn = db.connect().await;
    fence::postgres::FenceTable::default()
        .create(&mut conn)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE invoice_lines (id bigint, line text, written_by text)")
        .execute(&mut conn)
        .await
        .unwrap();

    let mut scene = Scene::start().await;
    let (a, snapshots) = scene.a_acquires_after_stale_snapshots().await;
    // A starts its transaction, reads, and pauses before writing.
    let mut a_tx = db.connect().await;
    let mut a_tx = a_tx.begin().await.unwrap();
    scene.pause_past_ttl_and_restore(&a, &snapshots).await;

    let b = scene.b_acquires(&a).await;
    let mut b_tx = conn.begin().await.unwrap();
    fence::postgres::advance(&mut b_tx, &b).await.unwrap();
    sqlx::query("INSERT INTO invoice_lines VALUES (7, 'total 100', 'B')")
        .execute(&mut *b_tx)
        .await
        .unwrap();
    b_tx.commit().await.unwrap();

    // A resumes: its write, then the fence, in its transaction.
    sqlx::query("INSERT INTO invoice_lines VALUES (7, 'total 90', 'A')")
        .execute(&mut *a_tx)
        .await
        .unwrap();
    match fence::postgres::advance(&mut a_tx, &a).await {
        Err(FenceError::Stale { current, token, .. }) => {
            assert_eq!(token, a.fencing_token());
            assert_eq!(current, b.fencing_token());
        }
        other => panic!("A's stale write must be refused, got {other:?}"),
    }
    a_tx.rollback().await.unwrap();

    let lines: Vec<(String, String)> = sqlx::query_as("SELECT line, written_by FROM invoice_lines")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert_eq!(lines, [("total 100".to_owned(), "B".to_owned())]);
    let stored = fence::postgres::FenceTable::default()
        .current(&mut conn, &tower_redlock::Resource::from(RESOURCE))
        .await
        .unwrap();
    assert_eq!(stored, Some(b.fencing_token()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_paused_holder_s_write_is_refused_and_b_s_value_stays() {
    // The data lives in a Redis of its own, apart from the lock nodes.
    let data = RedisServer::start();
    let mut conn = redis::Client::open(data.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let mut scene = Scene::start().await;
    let (a, snapshots) = scene.a_acquires_after_stale_snapshots().await;
    scene.pause_past_ttl_and_restore(&a, &snapshots).await;

    let b = scene.b_acquires(&a).await;
    fence::redis::set_fields(&mut conn, &b, "invoice:7", &[("total", "100")])
        .await
        .unwrap();

    let refused = fence::redis::set_fields(&mut conn, &a, "invoice:7", &[("total", "90")])
        .await
        .unwrap_err();
    assert_eq!(refused.current(), Some(b.fencing_token()), "{refused:?}");
    let total: String = redis::AsyncCommands::hget(&mut conn, "invoice:7", "total")
        .await
        .unwrap();
    assert_eq!(total, "100");
    assert_eq!(
        fence::redis::current(&mut conn, "invoice:7").await.unwrap(),
        Some(FencingToken::new(b.fencing_token().get()))
    );
}
