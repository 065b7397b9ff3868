//! `fence::redis` against a spawned `redis-server`: strings and hashes, the rule, exact
//! comparison of any `u64`, and a Redis Cluster (the fence key in the value's slot).

use redis::AsyncCommands;
use tower_redlock::fence::redis as guarded;
use tower_redlock::fence::FenceError;
use tower_redlock::{FencingToken, Resource};

#[cfg(feature = "cluster")]
use crate::support::cluster::RedisCluster;
use crate::support::RedisServer;

fn t(token: u64) -> FencingToken {
    FencingToken::new(token)
}

/// An exclusive holder's token, carried apart from its lease.
fn w(token: u64) -> (Resource, FencingToken) {
    (Resource::from("writer"), t(token))
}

async fn connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_string_is_written_only_under_a_token_not_below_the_stored_one() {
    let server = RedisServer::start();
    let mut conn = connection(&server).await;

    guarded::set(&mut conn, &w(10), "doc", "ten").await.unwrap();
    match guarded::set(&mut conn, &w(9), "doc", "nine").await {
        Err(FenceError::Stale {
            fence,
            token,
            current,
        }) => {
            assert_eq!((fence.as_str(), token, current), ("doc", t(9), t(10)));
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    assert_eq!(server.get("doc").as_deref(), Some("ten"));
    // The same holder again, then a later one.
    guarded::set(&mut conn, &w(10), "doc", "ten again")
        .await
        .unwrap();
    guarded::set(&mut conn, &w(11), "doc", "eleven")
        .await
        .unwrap();
    assert_eq!(server.get("doc").as_deref(), Some("eleven"));
    assert_eq!(
        guarded::current(&mut conn, "doc").await.unwrap(),
        Some(t(11))
    );
    assert_eq!(guarded::current(&mut conn, "other").await.unwrap(), None);
}

#[tokio::test]
async fn hash_fields_are_written_only_under_a_token_not_below_the_stored_one() {
    let server = RedisServer::start();
    let mut conn = connection(&server).await;

    guarded::set_fields(
        &mut conn,
        &w(5),
        "order:1",
        &[("status", "paid"), ("by", "b")],
    )
    .await
    .unwrap();
    let refused = guarded::set_fields(&mut conn, &w(4), "order:1", &[("status", "refunded")])
        .await
        .unwrap_err();
    assert_eq!(refused.current(), Some(t(5)));
    let status: String = conn.hget("order:1", "status").await.unwrap();
    assert_eq!(status, "paid");
    guarded::set_fields(&mut conn, &w(6), "order:1", &[("status", "shipped")])
        .await
        .unwrap();
    let fields: Vec<(String, String)> = conn.hgetall("order:1").await.unwrap();
    assert!(fields.contains(&("status".into(), "shipped".into())));
    assert!(
        fields.contains(&("by".into(), "b".into())),
        "other fields kept: {fields:?}"
    );
    let none: &[(&str, &str)] = &[];
    assert!(matches!(
        guarded::set_fields(&mut conn, &w(7), "order:1", none).await,
        Err(FenceError::Store(_))
    ));
}

/// Tokens past 2⁵³ (Lua's exact integers) and of different lengths compare exactly.
#[tokio::test]
async fn tokens_compare_exactly_across_the_whole_u64_range() {
    let server = RedisServer::start();
    let mut conn = connection(&server).await;
    let big = (1_u64 << 53) + 1;
    guarded::set(&mut conn, &w(big), "k", "a").await.unwrap();
    // 2⁵³ + 1 and 2⁵³ are the same Lua number: a float comparison would accept this.
    assert!(guarded::set(&mut conn, &w(big - 1), "k", "b")
        .await
        .unwrap_err()
        .is_stale());
    assert!(guarded::set(&mut conn, &w(999), "k", "b")
        .await
        .unwrap_err()
        .is_stale());
    guarded::set(&mut conn, &w(u64::MAX), "k", "max")
        .await
        .unwrap();
    assert!(guarded::set(&mut conn, &w(u64::MAX - 1), "k", "b")
        .await
        .unwrap_err()
        .is_stale());
    assert_eq!(server.get("k").as_deref(), Some("max"));
}

/// Over a Redis Cluster connection: the fence key lands in the value's slot (no
/// `CROSSSLOT`), with and without a hash tag.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_cluster_connection() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 0))
        .await
        .unwrap();
    let seeds: Vec<String> = cluster.nodes.iter().map(RedisServer::url).collect();
    let client = redis::cluster::ClusterClient::new(seeds).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    for key in ["order:42", "{order:42}:status", "a{b}c"] {
        let fence = guarded::fence_key(key);
        assert_eq!(cluster.slot(key), cluster.slot(&fence), "{key} vs {fence}");
        guarded::set(&mut conn, &w(2), key, "two").await.unwrap();
        let refused = guarded::set(&mut conn, &w(1), key, "one")
            .await
            .unwrap_err();
        assert_eq!(refused.current(), Some(t(2)), "{key}");
        let value: String = conn.get(key).await.unwrap();
        assert_eq!(value, "two");
    }
}
