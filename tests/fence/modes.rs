//! A write fence orders writers: shared and counted holders overlap, so neither passes
//! one (PostgreSQL and Redis), and an exclusive holder after them does. Three real
//! `redis-server`s as lock nodes.

use sqlx::Connection;
use tower_redlock::fence::{self, FenceError};
use tower_redlock::{Lease, LockMode, Redlock};

use crate::support::postgres::TestDatabase;
use crate::support::{self, RedisServer};

const REPORT: &str = "report:7";

async fn fenced_in_postgres(db: &TestDatabase, lease: &Lease) -> Result<(), String> {
    let mut conn = db.connect().await;
    let mut tx = conn.begin().await.unwrap();
    fence::postgres::advance(&mut tx, lease)
        .await
        .map_err(|e| format!("{e:?}"))?;
    tx.commit().await.unwrap();
    Ok(())
}

async fn fenced_in_redis(data: &RedisServer, lease: &Lease) -> Result<(), String> {
    let mut conn = redis::Client::open(data.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    fence::redis::set(&mut conn, lease, "report:7:body", "written")
        .await
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_shared_and_counted_holders_are_refused_an_exclusive_one_passes() {
    let servers = RedisServer::start_many(3);
    let locker =
        Redlock::from_urls(servers.iter().map(RedisServer::url), support::patient()).unwrap();
    let db = TestDatabase::create().await;
    fence::postgres::FenceTable::default()
        .create(&mut db.connect().await)
        .await
        .unwrap();
    let data = RedisServer::start();

    let counted = LockMode::counted(3).unwrap();
    for mode in [LockMode::Shared, counted] {
        let first = locker.try_acquire_as(REPORT, mode).await.unwrap();
        let second = locker.try_acquire_as(REPORT, mode).await.unwrap();
        for lease in [&first, &second] {
            for refused in [
                fenced_in_postgres(&db, lease).await,
                fenced_in_redis(&data, lease).await,
            ] {
                let expected = format!("{:?}", FenceError::<()>::NotExclusive { mode });
                assert_eq!(refused, Err(expected), "{mode:?}");
            }
        }
        first.release().await;
        second.release().await;
    }
    assert!(data.get("report:7:body").is_none(), "nothing written");

    let writer = locker.try_acquire(REPORT).await.unwrap();
    fenced_in_postgres(&db, &writer).await.unwrap();
    fenced_in_redis(&data, &writer).await.unwrap();
    assert_eq!(data.get("report:7:body").as_deref(), Some("written"));
}
