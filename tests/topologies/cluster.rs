//! Nodes that are more than one server (issue 9): a Redis Cluster as one vote, a
//! Sentinel-managed master followed across failovers, replica acknowledgement (`WAIT`),
//! ACL and password authentication, and TLS.
//!
//! Every server is spawned on a free 127.0.0.1 port by `support` (clusters with
//! `redis-cli --cluster create`, sentinels with `redis-server --sentinel`). Outcomes are
//! awaited and Redis is polled with a bound; the one sleep paces a loop of attempts
//! during a failover. A waiter's fallback retry is set to two minutes, so a wake-up in
//! time can only come from a release notification.
use crate::support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::sentinel::SentinelNodeConnectionInfo;
use redis::RedisConnectionInfo;
use support::cluster::{wait_replicas_online, RedisCluster, SentinelGroup};
use support::{eventually, eventually_async, RedisServer, RespValue};
use tokio::time::Instant;
use tower_redlock::{
    node_from_url, FencingToken, Lease, LockError, LockOptions, NodeError, Redlock, ReleaseOutcome,
    SentinelNode,
};

/// Bound of every poll and of every wait for a wake-up.
const LIMIT: Duration = Duration::from_secs(10);
/// A fallback retry delay no test waits for: only a release notification can wake a
/// waiter in time.
const NEVER: Duration = Duration::from_secs(120);

fn options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(8))
        .node_timeout(Duration::from_millis(250))
}

/// A second, independent locker ("another process") that only wakes up on release
/// notifications.
fn waiter(url: &str) -> Redlock {
    Redlock::from_urls([url], options().retry_policy(|_, _| NEVER)).unwrap()
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

fn channel(resource: &str) -> String {
    format!("redlock:{{{resource}}}:released")
}

/// A storage that accepts a write only with a token at least as large as every token
/// it accepted before (the fencing check of the protected resource), and records who
/// wrote.
#[derive(Default, Clone)]
struct FencedStorage(Arc<Mutex<Writes>>);

/// The largest token accepted, and every accepted write (writer, token).
type Writes = (u64, Vec<(&'static str, u64)>);

impl FencedStorage {
    fn write(&self, who: &'static str, token: FencingToken) -> bool {
        let token = u64::from(token);
        let mut state = self.0.lock().unwrap();
        if token < state.0 {
            return false;
        }
        state.0 = token;
        state.1.push((who, token));
        true
    }

    /// Never two holders accepted: writers never alternate back, and two writers never
    /// share a token.
    fn assert_one_holder_at_a_time(&self) {
        let state = self.0.lock().unwrap();
        let mut seen: Vec<(&str, u64)> = Vec::new();
        for &(who, token) in &state.1 {
            match seen.last() {
                Some(&(last, last_token)) if last == who => assert_eq!(last_token, token),
                _ => {
                    assert!(
                        seen.iter().all(|&(w, t)| w != who && t != token),
                        "two holders accepted: {:?}",
                        state.1
                    );
                    seen.push((who, token));
                }
            }
        }
    }
}

/// Waits until `count` waiters are subscribed to their wake-up channels for the
/// resource of `channel` (sharded or not) on `server`: each waiting process listens on
/// its own, `<channel>:<waiter id>` (the wait queue).
async fn subscribed(server: &RedisServer, channel: &str, sharded: bool, count: i64) {
    eventually("the waiter to subscribe", LIMIT, || {
        waiters_subscribed(server, channel, sharded) == count
    })
    .await;
}

/// Clients subscribed to the waiters' channels of the resource of `channel` on `server`.
fn waiters_subscribed(server: &RedisServer, channel: &str, sharded: bool) -> i64 {
    let (list, count) = if sharded {
        ("SHARDCHANNELS", "SHARDNUMSUB")
    } else {
        ("CHANNELS", "NUMSUB")
    };
    let pattern = format!("{channel}:*");
    let RespValue::Array(names) = server.cmd(&["PUBSUB", list, &pattern]) else {
        return 0;
    };
    names
        .iter()
        .filter_map(RespValue::to_string_lossy)
        .map(|name| match server.cmd(&["PUBSUB", count, &name]) {
            RespValue::Array(items) => items.get(1).and_then(RespValue::as_int).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

/// Blocking set-up work (starting servers, failovers) off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Issue 13 item 5 for a cluster: waiters that give up while the master of their
/// shard is frozen (SIGSTOP) leave no task per waiter parked on SSUBSCRIBE or
/// SUNSUBSCRIBE, and everything drains once the master resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_waiters_giving_up_on_a_frozen_master_pile_nothing_up() {
    let mut cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let any = cluster.nodes[0].port();
    // Two more votes, which stay up: they say "held", so the waiters wait (and
    // subscribe on every node) instead of failing for want of a majority.
    let servers = RedisServer::start_many(2);
    let urls = [cluster.url(), servers[0].url(), servers[1].url()];
    let locker = Redlock::from_urls(
        urls,
        LockOptions::default().node_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    // 100 resources on one master, each held by another process.
    let frozen = cluster.master_of_slot(cluster.slot(&lock_key("frozen-0")), any);
    let resources: Vec<String> = (0..)
        .map(|i| format!("frozen-{i}"))
        .filter(|r| cluster.master_of_slot(cluster.slot(&lock_key(r)), any) == frozen)
        .take(100)
        .collect();
    for resource in &resources {
        cluster.node(frozen).cmd(&[
            "SET",
            &lock_key(resource),
            "another-process",
            "PX",
            "600000",
        ]);
        for s in &servers {
            s.cmd(&[
                "SET",
                &lock_key(resource),
                "another-process",
                "PX",
                "600000",
            ]);
        }
    }
    // One wait first, so every connection of the locker is open.
    let err = locker
        .acquire(resources[0].as_str(), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::WaitTimeout { .. }), "{err:?}");
    let runtime = tokio::runtime::Handle::current().metrics();
    let baseline = runtime.num_alive_tasks();

    cluster.node_mut(frozen).pause();
    let mut waiters = tokio::task::JoinSet::new();
    for resource in &resources {
        let locker = locker.clone();
        let resource = resource.clone();
        waiters.spawn(async move {
            locker
                .acquire(resource.as_str(), Duration::from_secs(1))
                .await
        });
    }
    while let Some(outcome) = waiters.join_next().await {
        let err = outcome.unwrap().unwrap_err();
        assert!(
            matches!(
                err,
                LockError::WaitTimeout { .. } | LockError::Unavailable { .. }
            ),
            "{err:?}"
        );
    }
    assert_eq!(locker.local_resources(), 0);
    // While the master is still frozen, what the waiters left behind is bounded: the
    // pub/sub upkeep and the cluster client's own tasks, not one task per waiter.
    eventually("the tasks the waiters left behind end", LIMIT, || {
        runtime.num_alive_tasks() <= baseline + 10
    })
    .await;

    cluster.node_mut(frozen).resume();
    eventually("every sharded subscription ended", LIMIT, || {
        resources
            .iter()
            .all(|r| waiters_subscribed(cluster.node(frozen), &channel(r), true) == 0)
    })
    .await;
    eventually("everything drained", LIMIT, || {
        runtime.num_alive_tasks() <= baseline + 10
    })
    .await;
    // And the shard serves waiters again, woken by the release.
    cluster.node(frozen).cmd(&["DEL", &lock_key(&resources[1])]);
    for s in &servers {
        s.cmd(&["DEL", &lock_key(&resources[1])]);
    }
    let lease = Arc::new(Mutex::new(None));
    eventually_async("the resumed master to grant", LIMIT, || {
        let locker = locker.clone();
        let resource = resources[1].clone();
        let lease = lease.clone();
        async move {
            let granted = locker.try_acquire(resource.as_str()).await.ok();
            let ok = granted.is_some();
            *lease.lock().unwrap() = granted;
            ok
        }
    })
    .await;
    let lease = lease.lock().unwrap().take().unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_is_one_vote_across_slots_with_acl_and_sharded_wake_ups() {
    let cluster = blocking(|| RedisCluster::builder(3, 0).password("clusterpw").start()).await;
    cluster.on_every_node(&[
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">lockerpw",
        "~redlock:*",
        "&redlock:*",
        "+@all",
    ]);
    let url = cluster.url_with_credentials(Some("locker:lockerpw"));
    let a = Redlock::connect([&url], options()).await.unwrap();
    let b = waiter(&url);
    assert_eq!(a.node_count(), 1);
    assert_eq!(a.quorum(), 1);
    let any = cluster.nodes[0].port();

    // Many resources, spread over the slots of every master.
    let mut masters = HashSet::new();
    for i in 0..48 {
        let resource = format!("order-{i}");
        let key = lock_key(&resource);
        let lease = a.try_acquire(resource.as_str()).await.unwrap();
        let master = cluster.master_of_slot(cluster.slot(&key), any);
        masters.insert(master);
        assert_eq!(
            cluster.node(master).get(&key).as_deref(),
            Some(lease.owner())
        );
        assert!(cluster.node(master).exists(&format!("{key}:fence")));
        let err = b.try_acquire(resource.as_str()).await.unwrap_err();
        assert!(
            matches!(
                err,
                LockError::Held {
                    holder_ttl: Some(_),
                    ..
                }
            ),
            "{err}"
        );
        let remaining = lease.extend().await.unwrap();
        assert!(remaining > Duration::from_secs(7), "{remaining:?}");
        assert!(cluster.node(master).pttl(&key) > 7000);
        let token = lease.fencing_token();
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
        assert!(!cluster.node(master).exists(&key));
        let next = b.try_acquire(resource.as_str()).await.unwrap();
        assert!(next.fencing_token() > token);
        assert_eq!(next.release().await, ReleaseOutcome::Released);
    }
    assert_eq!(masters.len(), 3, "resources should land on every master");

    // Cross-locker wake-up on one resource per master: the waiter's fallback retry is
    // two minutes away, so only the SPUBLISH of the release can wake it.
    let mut per_master: Vec<(u16, String)> = Vec::new();
    for i in 0.. {
        let resource = format!("wake-{i}");
        let master = cluster.master_of_slot(cluster.slot(&lock_key(&resource)), any);
        if per_master.iter().all(|(m, _)| *m != master) {
            per_master.push((master, resource));
        }
        if per_master.len() == 3 {
            break;
        }
    }
    for (master, resource) in &per_master {
        let lease = a.try_acquire(resource.as_str()).await.unwrap();
        let token = lease.fencing_token();
        let b2 = b.clone();
        let r = resource.clone();
        let waiting = tokio::spawn(async move { b2.acquire(r.as_str(), LIMIT).await });
        subscribed(cluster.node(*master), &channel(resource), true, 1).await;
        let released = Instant::now();
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
        let next = waiting.await.unwrap().unwrap();
        assert!(
            released.elapsed() < Duration::from_secs(2),
            "woken after {:?}",
            released.elapsed()
        );
        assert!(next.fencing_token() > token);
        next.release().await;
    }
    // (Each waiter was woken by the notification, or found the lock free in its
    // immediate retry right after subscribing; never by its fallback retry.)
    assert!(b.metrics().waits >= 3, "{:?}", b.metrics());
    assert_eq!(b.local_resources(), 0);

    // The subscription ends with the last waiter.
    for (master, resource) in &per_master {
        subscribed(cluster.node(*master), &channel(resource), true, 0).await;
    }

    // Wrong credentials: a clear error, never a panic.
    let wrong = cluster.url_with_credentials(Some("locker:wrong"));
    let locker = Redlock::connect([&wrong], options()).await.unwrap();
    let err = locker.try_acquire("order-1").await.unwrap_err();
    let LockError::Unavailable { failures, .. } = &err else {
        panic!("expected Unavailable, got {err}");
    };
    assert_eq!(failures.len(), 1);
    let text = err.to_string().to_lowercase();
    assert!(
        text.contains("auth") || text.contains("wrongpass") || text.contains("password"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_keeps_the_lease_or_loses_it_never_two_holders() {
    let cluster = Arc::new(blocking(|| RedisCluster::start(3, 1)).await);
    let url = cluster.url();
    let a = Redlock::connect([&url], options()).await.unwrap();
    let b = waiter(&url);
    let storage = FencedStorage::default();
    let resource = "failover";
    let key = lock_key(resource);
    let any = cluster.nodes[0].port();
    let master = cluster.master_of_slot(cluster.slot(&key), any);
    let replica = cluster.replicas_of(master)[0];

    let lease = a.try_acquire(resource).await.unwrap();
    let t1 = lease.fencing_token();
    assert!(storage.write("a", t1));
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire(resource, Duration::from_secs(30)).await })
    };
    subscribed(cluster.node(master), &channel(resource), true, 1).await;

    // A coordinated failover of the shard that holds the lock, while it is held.
    let c = cluster.clone();
    blocking(move || c.failover(replica)).await;
    assert_eq!(cluster.master_of_slot(cluster.slot(&key), any), replica);

    // The lease is kept (the key was replicated before the failover) or reported lost;
    // either way the other locker is not granted the lock while the lease holds.
    match lease.extend().await {
        Ok(_) => {
            assert_eq!(
                cluster.node(replica).get(&key).as_deref(),
                Some(lease.owner())
            );
            assert!(lease.is_held());
            assert!(storage.write("a", t1));
        }
        Err(e) => {
            assert!(matches!(e, LockError::Lost { .. }), "{e}");
        }
    }
    assert!(!waiting.is_finished() || !lease.is_held());

    // The old master ended the waiter's sharded subscription when it lost the slot;
    // the waiter subscribed again within the shard (on the new master or on the
    // demoted one, which gets the new master's SPUBLISH as its replica), so the release
    // wakes it long before its fallback retry.
    eventually(
        "the waiter to subscribe again within the shard",
        LIMIT,
        || {
            cluster
                .nodes
                .iter()
                .map(|n| waiters_subscribed(n, &channel(resource), true))
                .sum::<i64>()
                == 1
        },
    )
    .await;
    let released = Instant::now();
    lease.release().await;
    let next = tokio::time::timeout(LIMIT, waiting)
        .await
        .expect("the waiter was not woken after the failover")
        .unwrap()
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "{:?}",
        released.elapsed()
    );
    let t2 = next.fencing_token();
    assert!(t2 > t1, "{t2} after {t1}");
    assert!(storage.write("b", t2));
    assert!(
        !storage.write("a", t1),
        "the old holder's token must be refused"
    );
    storage.assert_one_holder_at_a_time();
    next.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_locker_follows_the_new_master_after_a_failover() {
    let group = Arc::new(blocking(|| SentinelGroup::start_with(Some("grouppw"))).await);
    let old = group.master_port();
    let sentinels = [format!("redis://{}", group.sentinel.addr())];
    // With credentials for the master: through the URL form, and through the builder.
    let url = group.url();
    let locker = Redlock::connect([&url], options()).await.unwrap();
    let node = SentinelNode::with_master_info(
        sentinels.clone(),
        "m",
        SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(RedisConnectionInfo::default().set_password("grouppw")),
    )
    .unwrap()
    .check_interval(Some(Duration::from_millis(200)));
    let by_builder = Redlock::new([node.clone()], options()).unwrap();
    let resource = "idle";
    let key = lock_key(resource);
    let lease = locker.try_acquire(resource).await.unwrap();
    assert_eq!(group.server(old).get(&key).as_deref(), Some(lease.owner()));
    let token = lease.fencing_token();
    lease.release().await;
    by_builder
        .try_acquire(resource)
        .await
        .unwrap()
        .release()
        .await;
    assert_eq!(node.current_master(), Some(format!("127.0.0.1:{old}")));

    // Without credentials for the master, the sentinel's answer cannot be verified.
    let without_password = SentinelNode::open(sentinels, "m").unwrap();
    let err = Redlock::new([without_password], options())
        .unwrap()
        .try_acquire(resource)
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("auth"), "{err}");

    // A waiter subscribed on the old master, for a lock held across the failover.
    let held = locker.try_acquire("wake").await.unwrap();
    let b = waiter(&url);
    let waiting = tokio::spawn(async move { b.acquire("wake", Duration::from_secs(30)).await });
    subscribed(group.server(old), &channel("wake"), false, 1).await;
    // The lock key has reached the replica that the failover promotes.
    let g = group.clone();
    blocking(move || wait_replicas_online(g.server(old), 1)).await;

    let g = group.clone();
    let new = blocking(move || g.failover()).await;
    assert_ne!(new, old);

    // The locker asks the sentinels again (background check or READONLY) and writes
    // to the new master, even while the old one still accepts writes.
    eventually_async("the locker to follow the new master", LIMIT, || {
        let locker = &locker;
        let group = &group;
        let key = &key;
        async move {
            let Ok(lease) = locker.try_acquire(resource).await else {
                return false;
            };
            let on_new = group.server(new).get(key).as_deref() == Some(lease.owner());
            assert!(lease.fencing_token() > token);
            lease.release().await;
            on_new
        }
    })
    .await;
    eventually("the builder's node to follow", LIMIT, || {
        node.current_master() == Some(format!("127.0.0.1:{new}"))
    })
    .await;

    // The waiter's subscription moved to the new master: the release there (the old
    // master does not forward it before it is demoted) wakes it at once.
    subscribed(group.server(new), &channel("wake"), false, 1).await;
    assert!(!waiting.is_finished());
    let released = Instant::now();
    assert_eq!(held.release().await, ReleaseOutcome::Released);
    let next = tokio::time::timeout(LIMIT, waiting)
        .await
        .expect("the waiter was not woken after the failover")
        .unwrap()
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "{:?}",
        released.elapsed()
    );
    next.release().await;

    let g = group.clone();
    blocking(move || g.wait_demoted(old)).await;
    let lease = locker.try_acquire(resource).await.unwrap();
    assert_eq!(group.server(new).get(&key).as_deref(), Some(lease.owner()));
    lease.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_during_a_held_lease_never_two_holders() {
    let group = Arc::new(blocking(SentinelGroup::start).await);
    let old = group.master_port();
    let url = group.url();
    // The holder counts a grant only once the replica has it, so the failover (which
    // promotes that replica) cannot lose it; the other locker does not wait.
    let a = Redlock::connect(
        [format!("{url}?wait_replicas=1&wait_timeout_ms=100")],
        options(),
    )
    .await
    .unwrap();
    let b = Redlock::connect([&url], options()).await.unwrap();
    let storage = FencedStorage::default();
    let resource = "held";
    let key = lock_key(resource);

    // Setup, not under test: the replica's first acknowledgement (a replica that just
    // synced is not counted until then), and a first grant, which on a loaded machine
    // (master lookup, connection, script load) can outlast one node timeout: under two
    // busy loops it failed about one run in four, before the node batched too.
    let g = group.clone();
    let acked = blocking(move || {
        let master = g.server(old);
        master.set("replica-acknowledged", "1");
        master.cmd(&["WAIT", "1", "10000"])
    })
    .await;
    assert_eq!(
        acked,
        RespValue::Integer(1),
        "the replica never acknowledged"
    );
    // Waiting, not trying: a timed-out attempt may hold the key until its cleanup
    // release gets through.
    let mut attempts = 0;
    let lease = loop {
        match a.acquire(resource, Duration::from_secs(10)).await {
            Ok(lease) => break lease,
            Err(e) if attempts < 20 => {
                attempts += 1;
                eprintln!("first grant, attempt {attempts}: {e}");
            }
            Err(e) => panic!("no first grant in {attempts} attempts: {e}"),
        }
    };
    let t1 = lease.fencing_token();
    assert!(storage.write("a", t1));
    // Acknowledged by the replica before the grant was counted.
    let replica = group.servers.iter().find(|s| s.port() != old).unwrap();
    assert_eq!(replica.get(&key).as_deref(), Some(lease.owner()));

    let g = group.clone();
    let failover = tokio::task::spawn_blocking(move || g.failover());
    // While the failover runs and settles, both sides keep trying: the holder writes
    // while its lease is held, the other writes whenever it wins the lock.
    let mut b_lease: Option<Lease> = None;
    let until = Instant::now() + Duration::from_secs(4);
    let mut a_writes_after_failover = 0;
    while Instant::now() < until || !failover.is_finished() {
        if lease.is_held() && storage.write("a", t1) && failover.is_finished() {
            a_writes_after_failover += 1;
        }
        if b_lease.is_none()
            && let Ok(won) = b.try_acquire(resource).await
        {
            assert!(
                !lease.is_held() || won.fencing_token() > t1,
                "a second holder with token {} <= {t1} while the first still holds",
                won.fencing_token()
            );
            b_lease = Some(won);
        }
        if let Some(won) = &b_lease {
            storage.write("b", won.fencing_token());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let new = failover.await.unwrap();
    assert_ne!(new, old);
    storage.assert_one_holder_at_a_time();
    // The lease was kept (the key reached the promoted replica) or reported lost.
    if lease.is_held() {
        assert!(b_lease.is_none(), "both hold the lock");
        assert!(a_writes_after_failover > 0);
    }
    let still_held = lease.is_held();
    lease.release().await;
    let next = match b_lease {
        Some(lease) => lease,
        None => {
            let deadline = Instant::now() + LIMIT;
            loop {
                match b.try_acquire(resource).await {
                    Ok(won) => break won,
                    Err(e) => assert!(
                        Instant::now() < deadline,
                        "the other locker never got the lock: {e}"
                    ),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(next.fencing_token() > t1, "kept: {still_held}");
    assert!(storage.write("b", next.fencing_token()));
    assert!(!storage.write("a", t1));
    storage.assert_one_holder_at_a_time();
    next.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requirepass_acl_users_and_wrong_passwords() {
    let server = blocking(|| RedisServer::builder().password("s3cret").start()).await;
    let reply = server.cmd(&[
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">lockerpw",
        "~redlock:*",
        "&redlock:*",
        "+@all",
    ]);
    assert!(reply.is_ok(), "{reply:?}");
    let addr = server.addr();
    let resource = "auth";

    for url in [
        format!("redis://:s3cret@{addr}/0"),
        format!("redis://default:s3cret@{addr}/0"),
        format!("redis://locker:lockerpw@{addr}/0"),
    ] {
        let locker = Redlock::connect([&url], options()).await.unwrap();
        let lease = locker.try_acquire(resource).await.unwrap();
        assert_eq!(
            server.get(&lock_key(resource)).as_deref(),
            Some(lease.owner())
        );
        // Waiting (and so subscribing) works for an ACL user limited to its channels.
        let other = waiter(&url);
        let waiting = tokio::spawn(async move { other.acquire(resource, LIMIT).await });
        subscribed(&server, &channel(resource), false, 1).await;
        lease.release().await;
        let next = waiting.await.unwrap().unwrap();
        next.release().await;
    }

    // The user's key pattern is enforced: `connect` names the pattern it lacks, and a
    // locker built without that check is refused by the server on every request.
    let url = format!("redis://locker:lockerpw@{addr}/0");
    let refused = Redlock::connect([&url], options().key_prefix("other:"))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("~other:*"), "{refused}");
    let limited = Redlock::from_urls([&url], options().key_prefix("other:")).unwrap();
    let err = limited.try_acquire(resource).await.unwrap_err();
    assert!(err.to_string().to_lowercase().contains("noperm"), "{err}");

    for (url, says) in [
        (format!("redis://locker:wrong@{addr}/0"), "auth"),
        (format!("redis://:wrong@{addr}/0"), "auth"),
        (format!("redis://{addr}/0"), "auth"),
    ] {
        let locker = Redlock::connect([&url], options()).await.unwrap();
        let err = locker.try_acquire(resource).await.unwrap_err();
        let LockError::Unavailable { failures, .. } = &err else {
            panic!("{url}: expected Unavailable, got {err}");
        };
        assert!(
            matches!(failures[0].error, NodeError::Connection(_)),
            "{url}: {:?}",
            failures[0].error
        );
        let text = err.to_string().to_lowercase();
        assert!(text.contains(says), "{url}: {err}");
        assert!(
            !text.contains("lockerpw") && !text.contains("s3cret"),
            "{err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_counts_only_acknowledged_grants() {
    let master = blocking(|| {
        RedisServer::builder()
            .arg("--repl-diskless-sync-delay", "0")
            .start()
    })
    .await;
    let port = master.port();
    let mut replica = blocking(move || {
        RedisServer::builder()
            .raw_args([
                "--replicaof".to_owned(),
                "127.0.0.1".to_owned(),
                port.to_string(),
            ])
            .start()
    })
    .await;
    let master = blocking(move || {
        wait_replicas_online(&master, 1);
        master
    })
    .await;
    // The replica's acknowledgement may take a while on a machine busy with the whole
    // suite (50 ms, and 200 ms inside a 250 ms node timeout, were seen to run out): a
    // second, inside a node timeout of three.
    let url = format!("{}?wait_replicas=1&wait_timeout_ms=1000", master.url());
    let patient = options().node_timeout(Duration::from_secs(3));
    let locker = Redlock::connect([&url], patient).await.unwrap();
    let resource = "replicated";
    let key = lock_key(resource);

    // Granted only once the replica acknowledged: the replica already has the key.
    let lease = locker.try_acquire(resource).await.unwrap();
    assert_eq!(replica.get(&key).as_deref(), Some(lease.owner()));
    lease.extend().await.unwrap();
    assert!(replica.pttl(&key) > 7000);
    lease.release().await;

    // With the replica stopped, no grant counts, and the unacknowledged key is released.
    replica.pause();
    let err = locker.try_acquire(resource).await.unwrap_err();
    let LockError::Unavailable { failures, .. } = &err else {
        panic!("expected Unavailable, got {err}");
    };
    // The node answered when `WAIT` gave up, not when the node timeout ran out.
    let text = failures[0].error.to_string();
    assert!(text.contains("0 replica(s), 1 required"), "{text}");
    eventually("the unacknowledged key to be released", LIMIT, || {
        !master.exists(&key)
    })
    .await;
    // A node without the option is not affected.
    let plain = Redlock::connect([master.url()], options()).await.unwrap();
    plain.try_acquire(resource).await.unwrap().release().await;

    replica.resume();
    eventually_async("grants to count again", LIMIT, || async {
        match locker.try_acquire(resource).await {
            Ok(lease) => {
                lease.release().await;
                true
            }
            Err(_) => false,
        }
    })
    .await;
}

#[tokio::test]
async fn urls_name_every_node_kind_without_secrets() {
    for (url, name) in [
        ("redis://:pw@127.0.0.1:1/0", "redis://127.0.0.1:1/0"),
        (
            "redis+cluster://user:pw@127.0.0.1:1,127.0.0.1:2/",
            "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        ),
        (
            "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/1",
            "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster",
        ),
    ] {
        assert_eq!(node_from_url(url).unwrap().name(), name);
    }
    assert!(node_from_url("memcached://127.0.0.1").is_err());
    // A locker over three kinds at once.
    let locker = Redlock::connect(
        [
            "redis://127.0.0.1:1/0",
            "redis+cluster://127.0.0.1:2",
            "redis+sentinel://127.0.0.1:3/m",
        ],
        LockOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(locker.quorum(), 2);
}

/// TLS with a private CA: `rediss://` through redis-rs's rustls support (feature `tls`).
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca() {
    use std::process::Command;

    /// Removes the certificates' directory, also when the test fails.
    struct TempDir(std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = std::env::temp_dir().join(format!("tower-redlock-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir = TempDir(dir);
    let dir = &dir.0;
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl is needed for the TLS test");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=tower-redlock test CA",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);

    let tls_port = support::cluster::spare_port();
    let path = |name: &str| dir.join(name).display().to_string();
    let server = {
        let (cert, key, ca) = (path("server.crt"), path("server.key"), path("ca.crt"));
        blocking(move || {
            RedisServer::builder()
                .password("tlspw")
                .arg("--tls-port", tls_port.to_string())
                .arg("--tls-cert-file", cert)
                .arg("--tls-key-file", key)
                .arg("--tls-ca-cert-file", ca)
                .arg("--tls-auth-clients", "no")
                .start()
        })
        .await
    };
    let url = format!("rediss://:tlspw@127.0.0.1:{tls_port}/0");

    // Trusting the private CA.
    let ca = std::fs::read(dir.join("ca.crt")).unwrap();
    let client = redis::Client::build_with_tls(
        url.as_str(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )
    .unwrap();
    let node = tower_redlock::RedisNode::from_client(client).unwrap();
    let locker = Redlock::new([node], options()).unwrap();
    let lease = locker.try_acquire("tls").await.unwrap();
    assert_eq!(server.get(&lock_key("tls")).as_deref(), Some(lease.owner()));
    lease.release().await;

    // The URL alone trusts only the public roots: the private CA is refused, clearly.
    let locker = Redlock::connect([&url], options()).await.unwrap();
    let err = locker.try_acquire("tls").await.unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
    drop(server);
}

/// A cluster node's connections set `TCP_NODELAY` as a standalone node's do, and
/// `tcp_nodelay=false` on its URL turns it off: read back from this process's sockets
/// to the cluster's masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sockets_carry_tcp_nodelay() {
    for expected in [true, false] {
        let cluster = blocking(|| RedisCluster::start(3, 0)).await;
        let url = if expected {
            cluster.url()
        } else {
            format!("{}?tcp_nodelay=false", cluster.url())
        };
        let locker = Redlock::connect([&url], options()).await.unwrap();
        for resource in ["a", "b", "c", "d", "e", "f"] {
            locker.try_acquire(resource).await.unwrap().release().await;
        }
        let nodelay: Vec<bool> = cluster
            .nodes
            .iter()
            .flat_map(|node| support::sockets::nodelay_to(node.port()))
            .collect();
        assert!(!nodelay.is_empty(), "no connection to the cluster");
        assert!(
            nodelay.iter().all(|&on| on == expected),
            "{nodelay:?}, expected {expected}"
        );
    }
}
