//! A lease over a set of resources (issue 17) on the nodes that are more than one
//! server: a Sentinel-managed master runs each set call as one script; a Redis Cluster
//! keeps the per-key calls (the members' keys are in different slots), all or nothing
//! all the same.
use crate::support;

use std::time::Duration;

use support::cluster::{RedisCluster, SentinelGroup};
use support::eventually;
use tower_redlock::{LockError, LockOptions, Redlock, ReleaseOutcome};

const LIMIT: Duration = Duration::from_secs(10);

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(8))
        .node_timeout(support::PATIENT_NODE_TIMEOUT)
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_on_a_sentinel_master_is_one_script_acknowledged_by_the_replica() {
    let group = blocking(SentinelGroup::start).await;
    let url = group.url();
    let master = group.server(group.master_port());
    let replica = group
        .servers
        .iter()
        .find(|s| s.port() != group.master_port())
        .unwrap();
    let locker = Redlock::connect(
        [format!("{url}?wait_replicas=1&wait_timeout_ms=500")],
        options(),
    )
    .await
    .unwrap();
    let other = Redlock::connect([&url], options()).await.unwrap();
    let held = other.try_acquire("s2").await.unwrap();
    match locker.try_acquire_all(["s3", "s2", "s1"]).await {
        Err(LockError::Held { resource, .. }) => assert_eq!(resource.as_str(), "s2"),
        other => panic!("expected s2 held, got {other:?}"),
    }
    assert!(!master.exists(&lock_key("s1")) && !master.exists(&lock_key("s3")));
    held.release().await;

    // Every script loaded on the master, so that the count below has no `NOSCRIPT`.
    let warm = locker.try_acquire_all(["w1", "w2"]).await.unwrap();
    warm.extend().await.unwrap();
    warm.release().await;
    master.reset_stats();
    let lease = locker.try_acquire_all(["s3", "s2", "s1"]).await.unwrap();
    // Counted only once the replica acknowledged every member.
    for member in ["s1", "s2", "s3"] {
        assert_eq!(
            replica.get(&lock_key(member)).as_deref(),
            Some(lease.owner())
        );
    }
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    assert_eq!(
        master.command_calls("evalsha") + master.command_calls("eval"),
        3
    );
    for member in ["s1", "s2", "s3"] {
        assert!(!master.exists(&lock_key(member)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_across_cluster_slots_is_all_or_nothing() {
    let cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let any = cluster.nodes[0].port();
    // Members on different masters.
    let members = ["c1", "c2", "c3", "c4", "c5", "c6"];
    let masters: std::collections::HashSet<u16> = members
        .iter()
        .map(|m| cluster.master_of_slot(cluster.slot(&lock_key(m)), any))
        .collect();
    assert!(masters.len() > 1, "every member on one master");
    let on =
        |member: &str| cluster.node(cluster.master_of_slot(cluster.slot(&lock_key(member)), any));
    let locker = Redlock::connect([cluster.url()], options()).await.unwrap();
    let other = Redlock::connect([cluster.url()], options()).await.unwrap();

    let held = other.try_acquire("c4").await.unwrap();
    match locker.try_acquire_all(members).await {
        Err(LockError::Held { resource, .. }) => assert_eq!(resource.as_str(), "c4"),
        other => panic!("expected c4 held, got {other:?}"),
    }
    // The members taken before `c4` were given back.
    eventually("nothing of the set left", LIMIT, || {
        members
            .iter()
            .filter(|&&m| m != "c4")
            .all(|m| !on(m).exists(&lock_key(m)))
    })
    .await;
    held.release().await;

    let lease = locker.try_acquire_all(members).await.unwrap();
    for member in members {
        assert_eq!(
            on(member).get(&lock_key(member)).as_deref(),
            Some(lease.owner())
        );
    }
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    for member in members {
        assert!(!on(member).exists(&lock_key(member)));
    }
}

/// etcd: one transaction for the whole set, the members on one etcd lease.
#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use support::etcd::EtcdCluster;
    use tower_redlock::{LostCause, Resource};

    fn key(resource: &str) -> String {
        format!("s/redlock:{{{}}}", Resource::new(resource).as_str())
    }

    async fn exists(client: &mut etcd_client::Client, resource: &str) -> bool {
        let reply = client.get(key(resource), None).await.unwrap();
        !reply.kvs().is_empty()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_set_on_etcd_is_one_transaction() {
        let cluster = blocking(|| EtcdCluster::start(1)).await;
        let options = LockOptions::default()
            .ttl(Duration::from_secs(5))
            .node_timeout(Duration::from_secs(2))
            .watchdog(false);
        let locker = Redlock::from_urls([cluster.url("s")], options.clone()).unwrap();
        let other = Redlock::from_urls([cluster.url("s")], options).unwrap();
        let endpoints: Vec<String> = cluster
            .endpoints()
            .into_iter()
            .map(|e| format!("http://{e}"))
            .collect();
        let mut client = etcd_client::Client::connect(endpoints, None).await.unwrap();

        let held = other.try_acquire("e2").await.unwrap();
        match locker.try_acquire_all(["e3", "e2", "e1"]).await {
            Err(LockError::Held {
                resource,
                holder_ttl,
            }) => {
                assert_eq!(resource.as_str(), "e2");
                assert!(holder_ttl.is_some());
            }
            other => panic!("expected e2 held, got {other:?}"),
        }
        assert!(!exists(&mut client, "e1").await && !exists(&mut client, "e3").await);
        let e2_token = held.fencing_token();
        held.release().await;

        let lease = locker.try_acquire_all(["e3", "e2", "e1"]).await.unwrap();
        assert!(lease.fencing_token_of(&"e2".into()).unwrap() > e2_token);
        for member in ["e1", "e2", "e3"] {
            assert!(exists(&mut client, member).await, "{member} missing");
        }
        lease.extend().await.unwrap();
        client.delete(key("e3"), None).await.unwrap();
        match lease.extend().await {
            Err(LockError::Lost { cause, .. }) => assert_eq!(cause, LostCause::KeyLost),
            other => panic!("expected the set lost, got {other:?}"),
        }
        lease.release().await;
        for member in ["e1", "e2", "e3"] {
            assert!(!exists(&mut client, member).await, "{member} left behind");
        }
        let again = locker.try_acquire_all(["e1", "e2"]).await.unwrap();
        assert_eq!(again.release().await, ReleaseOutcome::Released);
        for member in ["e1", "e2"] {
            assert!(!exists(&mut client, member).await, "{member} left behind");
        }
    }
}
