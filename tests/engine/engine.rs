//! The lock engine against real `redis-server` nodes (issue 2): mutual exclusion,
//! quorum with dead and paused nodes, owner-only release and extend, fencing across
//! changing majorities, script and connection recovery, options, drop and contention.
//!
//! Every server is spawned by `support` on a free 127.0.0.1 port. No test sleeps to
//! synchronise: outcomes are awaited, and Redis is polled with a bound.
use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{eventually, eventually_async, RedisServer, RespValue};
use tower_redlock::{
    LockError, LockOptions, MemoryNode, NodeError, Redlock, ReleaseOutcome, Resource,
};

/// Per-node timeout where nodes are paused (or the ttl is short): short, so a node
/// that never answers costs little.
const NODE_TIMEOUT: Duration = Duration::from_millis(100);
/// Per-node timeout where every live node is expected to answer: no timeout fires in
/// those tests (dead nodes refuse at once), and a machine stalled for 100 ms must not
/// turn a slow answer into a missing key.
const PATIENT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound of the polls of Redis: half the default ttl, so that a key that vanishes
/// within it was deleted, not expired.
const LIMIT: Duration = Duration::from_secs(5);
/// Bound of a reconnection after restarts.
const RECONNECT_LIMIT: Duration = Duration::from_secs(10);

fn options() -> LockOptions {
    LockOptions::default().node_timeout(NODE_TIMEOUT)
}

fn patient() -> LockOptions {
    LockOptions::default().node_timeout(PATIENT_TIMEOUT)
}

/// A locker over the servers: a separate "process" with its own connections.
fn locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    Redlock::from_urls(servers.iter().map(RedisServer::url), options).unwrap()
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

fn fence_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}:fence")
}

/// The lock keys on a server: fence counters may stay (they are not locks), and so may
/// the probes of [`warm_up`] (see there).
fn lock_keys(server: &RedisServer) -> Vec<String> {
    server
        .keys("redlock:*")
        .into_iter()
        .filter(|k| !k.ends_with(":fence") && !k.starts_with("redlock:{probe-"))
        .collect()
}

async fn no_lock_keys_left(servers: &[&RedisServer]) {
    eventually("no lock key left on any node", LIMIT, || {
        servers.iter().all(|s| lock_keys(s).is_empty())
    })
    .await;
}

fn all(servers: &[RedisServer]) -> Vec<&RedisServer> {
    servers.iter().collect()
}

fn fence(server: &RedisServer, resource: &str) -> u64 {
    server
        .get(&fence_key(resource))
        .unwrap_or_else(|| panic!("no fence counter for {resource} on port {}", server.port()))
        .parse()
        .unwrap()
}

/// Waits until `locker`'s acquisitions land on `server`: its connection is open
/// (connections open on first use, and reopen on first use after a restart).
///
/// Each probe uses a fresh resource: while a connection is being opened, redis-rs may
/// send the commands queued for it in any order, so a probe's release can overtake
/// its acquire and leave the probe key behind until it expires.
async fn until_node_votes(locker: &Redlock, server: &RedisServer) {
    static PROBES: AtomicUsize = AtomicUsize::new(0);
    eventually_async("the node takes part", RECONNECT_LIMIT, || async {
        let resource = format!("probe-{}", PROBES.fetch_add(1, Ordering::Relaxed));
        let probe = lock_key(&resource);
        let Ok(lease) = locker.try_acquire(resource).await else {
            return false;
        };
        // This lease's value on whichever node `server` is: all share the random part.
        let owner = lease.owner()[..38].to_owned();
        // The node's answer may still be in flight when the majority decided.
        let landed = tokio::time::timeout(Duration::from_secs(1), async {
            loop {
                if server.get(&probe).is_some_and(|v| v.starts_with(&owner)) {
                    return;
                }
                tokio::time::sleep(support::POLL_INTERVAL).await;
            }
        })
        .await
        .is_ok();
        lease.release().await;
        landed
    })
    .await;
}

/// Opens `locker`'s connection to every server, so that later commands to one node
/// run in the order they were sent.
async fn warm_up(locker: &Redlock, servers: &[RedisServer]) {
    for server in servers {
        until_node_votes(locker, server).await;
    }
}

async fn acquire_and_release(locker: &Redlock, resource: &str) -> u64 {
    let lease = locker.try_acquire(resource).await.unwrap();
    let token = lease.fencing_token().get();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    token
}

// 1. Mutual exclusion ------------------------------------------------------------

/// 32 tasks × 20 rounds on one resource, half of them on each of two lockers with
/// their own connections, so that Redis — not the local queue — excludes them.
async fn mutual_exclusion(nodes: usize) {
    const TASKS: usize = 32;
    const ROUNDS: usize = 20;
    let servers = RedisServer::start_many(nodes);
    let lockers = [locker(&servers, patient()), locker(&servers, patient())];
    for locker in &lockers {
        warm_up(locker, &servers).await;
    }
    let before = lockers.each_ref().map(|l| l.metrics());
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::<u64>::with_capacity(TASKS * ROUNDS)));
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let locker = lockers[i % 2].clone();
        let (inside, tokens) = (inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let lease = locker
                    .acquire("exclusive", Duration::from_secs(60))
                    .await
                    .unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                {
                    let mut tokens = tokens.lock().unwrap();
                    let token = lease.fencing_token().get();
                    if let Some(&last) = tokens.last() {
                        assert!(token > last, "token {token} after {last}");
                    }
                    tokens.push(token);
                }
                assert!(lease.is_held());
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                assert_eq!(inside.fetch_sub(1, Ordering::SeqCst), 1);
                assert_eq!(lease.release().await, ReleaseOutcome::Released);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(tokens.lock().unwrap().len(), TASKS * ROUNDS);
    let mut contended = 0;
    for (locker, before) in lockers.iter().zip(before) {
        let after = locker.metrics();
        assert_eq!(
            after.acquired - before.acquired,
            (TASKS * ROUNDS / 2) as u64
        );
        contended += after.contended - before.contended;
        assert_eq!(locker.local_resources(), 0);
    }
    // The two lockers did meet at the nodes: the exclusion above was Redis's doing.
    assert!(contended > 0);
    no_lock_keys_left(&all(&servers)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_across_two_lockers_on_three_nodes() {
    mutual_exclusion(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_across_two_lockers_on_one_node() {
    mutual_exclusion(1).await;
}

// 2. Quorum with dead nodes ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_node_of_three_is_tolerated() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    let key = lock_key("tolerant");

    // A lease taken on all three nodes reaches all three, also with extend.
    let lease = locker.try_acquire("tolerant").await.unwrap();
    eventually("the key on every node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(i).as_str()))
    })
    .await;
    for s in &servers {
        assert_eq!(s.cmd(&["PEXPIRE", &key, "3000"]), RespValue::Integer(1));
    }
    lease.extend().await.unwrap();
    eventually("extend refreshed the ttl on every node", LIMIT, || {
        servers.iter().all(|s| s.pttl(&key) > 3000)
    })
    .await;

    // It survives the loss of one node while held.
    servers[0].kill();
    lease.extend().await.unwrap();
    assert!(lease.is_held());
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    assert!(!servers[1].exists(&key) && !servers[2].exists(&key));

    // And a new lease works on the two survivors.
    let lease = locker.try_acquire("tolerant").await.unwrap();
    for (i, s) in servers.iter().enumerate().skip(1) {
        assert_eq!(s.get(&key).as_deref(), Some(lease.owner_on(i).as_str()));
        assert_eq!(s.cmd(&["PEXPIRE", &key, "3000"]), RespValue::Integer(1));
    }
    lease.extend().await.unwrap();
    for s in &servers[1..] {
        assert!(s.pttl(&key) > 3000, "not extended on port {}", s.port());
    }
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    for s in &servers[1..] {
        assert!(!s.exists(&key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dead_nodes_of_three_are_unavailable_not_held() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    let dead: Vec<String> = servers[..2]
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    servers[0].kill();
    servers[1].kill();

    let err = locker.try_acquire("doomed").await.unwrap_err();
    let LockError::Unavailable {
        nodes,
        answered,
        quorum,
        failures,
        ..
    } = &err
    else {
        panic!("expected Unavailable, got {err:?}");
    };
    assert_eq!((*nodes, *quorum), (3, 2));
    assert!(*answered <= 1, "{err}");
    assert!(!err.is_contention());
    assert_eq!(failures.len(), 2, "{err}");
    for addr in &dead {
        assert!(
            failures.iter().any(|f| f.node.contains(addr.as_str())),
            "{addr} not among the failures: {err}"
        );
        assert!(err.to_string().contains(addr.as_str()), "{err}");
    }

    // A waiting acquire does not wait for a store that cannot decide.
    let err = locker
        .acquire("doomed", Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");

    // The survivor granted the lock and got it back: nothing stays locked there.
    no_lock_keys_left(&[&servers[2]]).await;
    assert_eq!(locker.local_resources(), 0);
}

// 3. Paused nodes ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_does_not_block_the_lock() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, options());
    warm_up(&locker, &servers).await;

    servers[0].pause();
    let lease = locker.try_acquire("paused").await.unwrap();
    for (i, s) in servers.iter().enumerate().skip(1) {
        assert_eq!(
            s.get(&lock_key("paused")).as_deref(),
            Some(lease.owner_on(i).as_str())
        );
    }
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);

    // The commands queued on the paused node run in order when it resumes: the late
    // SET is followed by its release, so nothing stays locked there.
    servers[0].resume();
    no_lock_keys_left(&all(&servers)).await;
    acquire_and_release(&locker, "paused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_paused_nodes_of_three_are_unavailable() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, options());
    warm_up(&locker, &servers).await;

    servers[0].pause();
    servers[1].pause();
    let err = locker.try_acquire("frozen").await.unwrap_err();
    let LockError::Unavailable { failures, .. } = &err else {
        panic!("expected Unavailable, got {err:?}");
    };
    assert_eq!(failures.len(), 2, "{err}");
    assert!(
        failures
            .iter()
            .all(|f| matches!(f.error, NodeError::Timeout(_))),
        "{err}"
    );

    servers[0].resume();
    servers[1].resume();
    no_lock_keys_left(&all(&servers)).await;
    acquire_and_release(&locker, "frozen").await;
}

// 4. Release and extend touch only the owner's key -------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_cannot_release_or_extend_the_next_holders_lock() {
    let servers = RedisServer::start_many(3);
    let stale_locker = locker(
        &servers,
        options().watchdog(false).ttl(Duration::from_secs(1)),
    );
    let other = locker(&servers, patient());
    warm_up(&stale_locker, &servers).await;
    warm_up(&other, &servers).await;
    let key = lock_key("expiring");

    let stale = stale_locker.try_acquire("expiring").await.unwrap();
    eventually("the stale lease's keys expire", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    let holder = other.try_acquire("expiring").await.unwrap();
    eventually("the new holder's key on every node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(holder.owner_on(i).as_str()))
    })
    .await;

    let err = stale.extend().await.unwrap_err();
    assert!(matches!(err, LockError::Lost { .. }), "{err:?}");
    assert!(!stale.is_held());
    assert_eq!(stale.release().await, ReleaseOutcome::NotHeld);

    for (i, s) in servers.iter().enumerate() {
        assert_eq!(s.get(&key).as_deref(), Some(holder.owner_on(i).as_str()));
        // Still the new holder's 10 s ttl, not the stale lease's 1 s.
        assert!(s.pttl(&key) > 1000, "ttl changed on port {}", s.port());
    }
    assert!(holder.is_held());
    assert_eq!(holder.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_keys_were_taken_over_cannot_touch_them() {
    let servers = RedisServer::start_many(3);
    // Long ttl for the stale lease, short for the new holder: an extend by the stale
    // lease would show as a ttl above 2 s on the new holder's key.
    let stale_locker = locker(
        &servers,
        patient().watchdog(false).ttl(Duration::from_secs(10)),
    );
    let other = locker(&servers, patient().ttl(Duration::from_secs(2)));
    warm_up(&stale_locker, &servers).await;
    warm_up(&other, &servers).await;
    let key = lock_key("taken");

    let stale = stale_locker.try_acquire("taken").await.unwrap();
    eventually("the stale lease's key on every node", LIMIT, || {
        servers.iter().all(|s| s.exists(&key))
    })
    .await;
    // The keys vanish (as on expiry or data loss) and someone else takes the lock,
    // while the stale lease's own validity has not run out yet.
    for s in &servers {
        assert_eq!(s.cmd(&["DEL", &key]), RespValue::Integer(1));
    }
    let holder = other.try_acquire("taken").await.unwrap();
    eventually("the new holder's key on every node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(holder.owner_on(i).as_str()))
    })
    .await;
    assert!(stale.is_held(), "locally the stale lease still looks valid");

    let err = stale.extend().await.unwrap_err();
    assert!(
        matches!(
            err,
            LockError::Lost {
                cause: tower_redlock::LostCause::KeyLost,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!stale.is_held());
    assert_eq!(stale.lost_cause(), Some(tower_redlock::LostCause::KeyLost));
    assert_eq!(stale.release().await, ReleaseOutcome::NotHeld);

    for (i, s) in servers.iter().enumerate() {
        assert_eq!(s.get(&key).as_deref(), Some(holder.owner_on(i).as_str()));
        assert!(s.pttl(&key) <= 2000, "the stale lease extended the new key");
    }
    assert_eq!(holder.release().await, ReleaseOutcome::Released);
    no_lock_keys_left(&all(&servers)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_returns_once_no_node_has_the_key() {
    // A release that returned as soon as a majority answered would leave the key on
    // the third node for a while — long enough, when the script must be reloaded there
    // after NOSCRIPT, for the next acquire to be overtaken by it: with one node down,
    // that acquire would then find our own key and report Held.
    let servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    let key = lock_key("again");
    for _ in 0..20 {
        let lease = locker.try_acquire("again").await.unwrap();
        eventually("the key on every node", LIMIT, || {
            servers.iter().all(|s| s.exists(&key))
        })
        .await;
        for s in &servers {
            assert!(s.cmd(&["SCRIPT", "FLUSH"]).is_ok());
        }
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
        for s in &servers {
            assert!(!s.exists(&key), "key left on port {}", s.port());
        }
    }
}

// 5. Fencing -----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_across_changing_majorities_and_lost_counters() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    let res = "fenced";
    let mut tokens = vec![acquire_and_release(&locker, res).await];

    // Majority {B, C}.
    servers[0].kill();
    tokens.push(acquire_and_release(&locker, res).await);

    // Majority {A, C}, A restarted empty: its counter is re-created from the clock,
    // C carries the order over.
    servers[0].restart();
    until_node_votes(&locker, &servers[0]).await;
    servers[1].kill();
    let token = acquire_and_release(&locker, res).await;
    tokens.push(token);
    for s in [&servers[0], &servers[2]] {
        assert_eq!(fence(s, res), token, "counter not written back");
    }

    // Majority {A, B}, B restarted empty: A carries the order over (write-back).
    servers[1].restart();
    until_node_votes(&locker, &servers[1]).await;
    servers[2].kill();
    let token = acquire_and_release(&locker, res).await;
    tokens.push(token);
    for s in [&servers[0], &servers[1]] {
        assert_eq!(fence(s, res), token, "counter not written back");
    }

    // Every counter gone (expired): the clock restart still lands above.
    servers[2].restart();
    until_node_votes(&locker, &servers[2]).await;
    for s in &servers {
        s.cmd(&["DEL", &fence_key(res)]);
    }
    tokens.push(acquire_and_release(&locker, res).await);

    for pair in tokens.windows(2) {
        assert!(pair[1] > pair[0], "tokens do not increase: {tokens:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_increase_after_the_fence_counter_expires() {
    let servers = RedisServer::start_many(1);
    let ttl = Duration::from_secs(1);
    let locker = locker(&servers, options().ttl(ttl).fence_ttl(ttl));
    warm_up(&locker, &servers).await;
    let first = acquire_and_release(&locker, "short-fence").await;
    let second = acquire_and_release(&locker, "short-fence").await;
    assert!(second > first);
    eventually("the fence counter expires", LIMIT, || {
        !servers[0].exists(&fence_key("short-fence"))
    })
    .await;
    let third = acquire_and_release(&locker, "short-fence").await;
    assert!(third > second, "{third} after {second}");
}

// 6. Scripts and connections recover -------------------------------------------------

fn noscript_errors(server: &RedisServer) -> u64 {
    let info = server
        .cmd(&["INFO", "errorstats"])
        .to_string_lossy()
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("errorstat_NOSCRIPT:count="))
        .map_or(0, |n| n.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_script_flush() {
    let servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    let lease = locker.try_acquire("flushed").await.unwrap();
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);

    for s in &servers {
        assert!(s.cmd(&["SCRIPT", "FLUSH"]).is_ok());
        s.reset_stats();
    }
    let lease = locker.try_acquire("flushed").await.unwrap();
    let key = lock_key("flushed");
    eventually("the key on every node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(i).as_str()))
    })
    .await;
    for s in &servers {
        assert!(s.cmd(&["SCRIPT", "FLUSH"]).is_ok());
    }
    lease.extend().await.unwrap();
    for s in &servers {
        assert!(s.cmd(&["SCRIPT", "FLUSH"]).is_ok());
    }
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    no_lock_keys_left(&all(&servers)).await;
    // The flushes did bite: every node refused the acquire's, the extend's and the
    // release's EVALSHA and was served the script again.
    eventually("every node saw NOSCRIPT", LIMIT, || {
        servers.iter().all(|s| noscript_errors(s) >= 3)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_acquire_is_cleaned_up_after_it_lands() {
    // Two dead nodes decide the round (unavailable) while the acquire on the third is
    // still on its way, held back by a proxy, and that node has lost the acquire
    // script but not the release script: the acquire's EVALSHA meets NOSCRIPT and its
    // EVAL goes out one round trip later. A cleanup release sent as soon as the round
    // was decided would reach the node between the two, find nothing, and the late
    // acquire would then keep the key for its whole (long) ttl.
    let mut servers = RedisServer::start_many(3);
    let proxy = support::proxy::Proxy::start(servers[2].addr());
    let urls = [servers[0].url(), servers[1].url(), proxy.url()];
    let locker = Redlock::from_urls(urls, patient().ttl(Duration::from_secs(60))).unwrap();
    warm_up(&locker, &servers).await;
    servers[0].kill();
    servers[1].kill();
    let late = &servers[2];
    assert!(late.cmd(&["SCRIPT", "FLUSH"]).is_ok());
    let release = concat!(
        include_str!("../../src/node/redis/scripts/held.lua"),
        include_str!("../../src/node/redis/scripts/release.lua"),
        include_str!("../../src/node/redis/scripts/hand_off.lua"),
        include_str!("../../src/node/redis/scripts/release_queued.lua")
    );
    let loaded = late.cmd(&["SCRIPT", "LOAD", release]);
    assert!(matches!(loaded, RespValue::Bulk(_)), "{loaded:?}");
    late.reset_stats();
    proxy.set_latency(support::proxy::Latency::Fixed(Duration::from_millis(200)));

    let err = locker.try_acquire("late").await.unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    // The acquire did land there (the fence counter is written with the key)...
    eventually("the late acquire ran", LIMIT, || {
        late.exists(&fence_key("late")) && noscript_errors(late) >= 1
    })
    .await;
    // ...and was released after it, well before its ttl.
    eventually("the late key released", LIMIT, || {
        !late.exists(&lock_key("late"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_released_at_once_is_released_after_a_late_acquire() {
    // As above, but the two fast nodes grant the lease and it is released at once,
    // while the third node's acquire still waits for its NOSCRIPT retry.
    let servers = RedisServer::start_many(3);
    let proxy = support::proxy::Proxy::start(servers[2].addr());
    let urls = [servers[0].url(), servers[1].url(), proxy.url()];
    let locker = Redlock::from_urls(urls, patient().ttl(Duration::from_secs(60))).unwrap();
    warm_up(&locker, &servers).await;
    let late = &servers[2];
    assert!(late.cmd(&["SCRIPT", "FLUSH"]).is_ok());
    let release = concat!(
        include_str!("../../src/node/redis/scripts/held.lua"),
        include_str!("../../src/node/redis/scripts/release.lua"),
        include_str!("../../src/node/redis/scripts/hand_off.lua"),
        include_str!("../../src/node/redis/scripts/release_queued.lua")
    );
    let loaded = late.cmd(&["SCRIPT", "LOAD", release]);
    assert!(matches!(loaded, RespValue::Bulk(_)), "{loaded:?}");
    proxy.set_latency(support::proxy::Latency::Fixed(Duration::from_millis(200)));

    let lease = locker.try_acquire("quick").await.unwrap();
    lease.release().await;
    eventually("the late acquire ran", LIMIT, || {
        late.exists(&fence_key("quick"))
    })
    .await;
    no_lock_keys_left(&all(&servers)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_locker_works_after_every_node_restarts() {
    let mut servers = RedisServer::start_many(3);
    let locker = locker(&servers, patient());
    warm_up(&locker, &servers).await;
    acquire_and_release(&locker, "reborn").await;

    for s in &mut servers {
        s.restart();
    }
    // Connections reconnect on first use: the first attempts may fail.
    eventually_async("the locker works again", RECONNECT_LIMIT, || async {
        let Ok(lease) = locker.try_acquire("reborn").await else {
            return false;
        };
        let extended = lease.extend().await.is_ok();
        lease.release().await == ReleaseOutcome::Released && extended
    })
    .await;
    // And on every node again, scripts included.
    warm_up(&locker, &servers).await;
    let lease = locker.try_acquire("reborn-again").await.unwrap();
    let key = lock_key("reborn-again");
    eventually("the key on every restarted node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(i).as_str()))
    })
    .await;
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    // (Attempts during the reconnection may have left keys of "reborn" behind: redis-rs
    // may send the commands queued during a reconnection out of order.)
    eventually("the key is released on every node", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
}

// 7. Options and resource names ------------------------------------------------------

/// Lock keys on all servers together.
fn locker_keys(servers: &[RedisServer]) -> usize {
    servers.iter().map(|s| lock_keys(s).len()).sum()
}

fn config_error(options: LockOptions) -> String {
    Redlock::new([MemoryNode::new()], options)
        .unwrap_err()
        .to_string()
}

#[tokio::test]
async fn bad_options_are_rejected_with_a_reason() {
    let message = config_error(
        LockOptions::default()
            .ttl(Duration::from_millis(50))
            .node_timeout(Duration::from_millis(50)),
    );
    assert!(
        message.contains("ttl") && message.contains("leaves no validity"),
        "{message}"
    );
    let message = config_error(LockOptions::default().node_timeout(Duration::ZERO));
    assert!(
        message.contains("node_timeout must be greater than zero"),
        "{message}"
    );
    let message = config_error(LockOptions::default().key_prefix("app{x}:"));
    assert!(
        message.contains("key_prefix") && message.contains("braces"),
        "{message}"
    );
    let message = config_error(LockOptions::default().ttl(Duration::ZERO));
    assert!(message.contains("ttl must be between"), "{message}");
    let message = config_error(LockOptions::default().fence_ttl(Duration::from_secs(1)));
    assert!(message.contains("fence_ttl"), "{message}");

    let message = Redlock::new(Vec::<MemoryNode>::new(), LockOptions::default())
        .unwrap_err()
        .to_string();
    assert!(message.contains("at least one node"), "{message}");
    let message = Redlock::connect(Vec::<String>::new(), LockOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(message.contains("at least one node"), "{message}");
    let message = Redlock::connect(["not a url"], LockOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(message.contains("URL"), "{message}");
    assert!(
        message.starts_with("invalid lock configuration: "),
        "{message}"
    );
}

#[test]
fn a_locker_needs_a_runtime() {
    let err = Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap_err();
    assert!(err.to_string().contains("Tokio runtime"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_whose_parts_concatenate_alike_lock_independently() {
    let servers = RedisServer::start_many(3);
    let (one, two) = (locker(&servers, patient()), locker(&servers, patient()));
    warm_up(&one, &servers).await;
    warm_up(&two, &servers).await;
    let pairs = [
        (Resource::new("ab").join("c"), Resource::new("a").join("bc")),
        (Resource::new("a:b"), Resource::new("a").join("b")),
        (Resource::new("a{b}"), Resource::new("a").join("b")),
    ];
    for (a, b) in pairs {
        assert_ne!(a, b);
        // One process holds both.
        let first = one.try_acquire(&a).await.unwrap();
        let second = one.try_acquire(&b).await.unwrap();
        assert_eq!(first.release().await, ReleaseOutcome::Released);
        assert_eq!(second.release().await, ReleaseOutcome::Released);

        // Two processes hold one each, with distinct keys on every node.
        let first = one.try_acquire(&a).await.unwrap();
        let second = two.try_acquire(&b).await.unwrap();
        let (key_a, key_b) = (lock_key(a.as_str()), lock_key(b.as_str()));
        assert_ne!(key_a, key_b);
        eventually("both keys on every node", LIMIT, || {
            servers.iter().enumerate().all(|(i, s)| {
                s.get(&key_a).as_deref() == Some(first.owner_on(i).as_str())
                    && s.get(&key_b).as_deref() == Some(second.owner_on(i).as_str())
            })
        })
        .await;
        assert_eq!(locker_keys(&servers), 2 * servers.len());
        // Each name is really held.
        assert!(matches!(
            two.try_acquire(&a).await,
            Err(LockError::Held { .. })
        ));
        assert!(matches!(
            one.try_acquire(&b).await,
            Err(LockError::Held { .. })
        ));
        assert_eq!(first.release().await, ReleaseOutcome::Released);
        assert_eq!(second.release().await, ReleaseOutcome::Released);
    }
}

// 8. Drop releases ---------------------------------------------------------------------

async fn drop_releases(nodes: usize) {
    let servers = RedisServer::start_many(nodes);
    let (locker, other) = (locker(&servers, patient()), locker(&servers, patient()));
    warm_up(&locker, &servers).await;
    warm_up(&other, &servers).await;
    let key = lock_key("dropped");
    let lease = locker.try_acquire("dropped").await.unwrap();
    eventually("the key on every node", LIMIT, || {
        servers.iter().all(|s| s.exists(&key))
    })
    .await;
    assert!(matches!(
        other.try_acquire("dropped").await,
        Err(LockError::Held { .. })
    ));
    drop(lease);
    eventually("the dropped lease's key is deleted", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    eventually("the local queue is gone", LIMIT, || {
        locker.local_resources() == 0
    })
    .await;
    // Released, not expired: the ttl is 10 s.
    acquire_and_release(&other, "dropped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_lease_releases_it_on_three_nodes() {
    drop_releases(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_lease_releases_it_on_one_node() {
    drop_releases(1).await;
}

// 9. Contention reports the holder's ttl -------------------------------------------------

async fn held_reports_holder_ttl(nodes: usize) {
    let servers = RedisServer::start_many(nodes);
    let ttl = Duration::from_secs(5);
    let (locker, other) = (
        locker(&servers, patient().ttl(ttl)),
        locker(&servers, patient().ttl(ttl)),
    );
    warm_up(&locker, &servers).await;
    warm_up(&other, &servers).await;
    let lease = locker.try_acquire("busy").await.unwrap();

    // From another process: the nodes' PTTL.
    let err = other.try_acquire("busy").await.unwrap_err();
    let LockError::Held { holder_ttl, .. } = &err else {
        panic!("expected Held, got {err:?}");
    };
    let remaining = holder_ttl.expect("the holder's ttl");
    assert!(!remaining.is_zero() && remaining <= ttl, "{remaining:?}");
    assert!(err.is_contention());
    assert_eq!(err.holder_ttl(), *holder_ttl);

    // From this process: the local lease's validity.
    let err = locker.try_acquire("busy").await.unwrap_err();
    let remaining = err.holder_ttl().expect("the local holder's ttl");
    assert!(!remaining.is_zero() && remaining <= ttl, "{remaining:?}");

    // A wait that times out says the same.
    let err = other
        .acquire("busy", Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::WaitTimeout { .. }), "{err:?}");
    let remaining = err.holder_ttl().expect("the holder's ttl");
    assert!(!remaining.is_zero() && remaining <= ttl, "{remaining:?}");

    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_carries_the_holders_ttl_on_three_nodes() {
    held_reports_holder_ttl(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_carries_the_holders_ttl_on_one_node() {
    held_reports_holder_ttl(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_an_acquisition_is_one_set_per_node() {
    let servers = RedisServer::start_many(3);
    let locker = locker(&servers, options().fencing(false));
    warm_up(&locker, &servers).await;
    for s in &servers {
        s.reset_stats();
    }
    let lease = locker.try_acquire("unfenced").await.unwrap();
    assert_eq!(lease.fencing_token().get(), 0);
    let err = locker.try_acquire("unfenced").await.unwrap_err();
    assert!(matches!(err, LockError::Held { .. }), "{err}");
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    support::eventually("every node answered", LIMIT, || {
        servers.iter().all(|s| s.command_calls("set") >= 1)
    })
    .await;
    for s in &servers {
        assert!(
            !s.exists(&fence_key("unfenced")),
            "a fence counter was made"
        );
        assert_eq!(s.command_calls("incr"), 0);
    }
    // Mutual exclusion does not depend on fencing.
    let other = locker.clone();
    let again = other.try_acquire("unfenced").await.unwrap();
    assert_eq!(again.fencing_token().get(), 0);
}

// ---- One server, one vote (issue 13, item 2) ----------------------------------------

#[tokio::test]
async fn the_same_address_twice_is_refused_at_construction() {
    let server = RedisServer::start();
    let other = RedisServer::start();
    let port = server.port();
    let first = format!("redis://127.0.0.1:{port}");
    // The same server, written differently: scheme and host case, trailing slash,
    // database index (two databases of one server are still one server).
    for second in [
        first.clone(),
        format!("REDIS://127.0.0.1:{port}/"),
        format!("redis://127.0.0.1:{port}/0"),
        format!("redis://127.0.0.1:{port}/3"),
    ] {
        let urls = [first.clone(), other.url(), second.clone()];
        let message = Redlock::from_urls(&urls, options())
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("same server") && message.contains(&format!("127.0.0.1:{port}")),
            "{second}: {message}"
        );
        // `connect` refuses it before connecting.
        let message = Redlock::connect(&urls, options())
            .await
            .unwrap_err()
            .to_string();
        assert!(message.contains("same server"), "{second}: {message}");
    }
    // The default port is explicit in the comparison (nothing connects here).
    let message = Redlock::from_urls(["redis://localhost", "redis://LocalHost:6379/"], options())
        .unwrap_err()
        .to_string();
    assert!(message.contains("localhost:6379"), "{message}");
    // Cluster seeds and sentinel sets: the same set in another order is the same node.
    let (a, b) = (server.port(), other.port());
    let message = Redlock::from_urls(
        [
            format!("redis+cluster://127.0.0.1:{a},127.0.0.1:{b}"),
            format!("redis+cluster://127.0.0.1:{b},127.0.0.1:{a}/"),
        ],
        options(),
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("same server"), "{message}");
    let message = Redlock::from_urls(
        [
            format!("redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/locks"),
            format!("redis+sentinel://127.0.0.1:{b},127.0.0.1:{a}/locks"),
        ],
        options(),
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("same server"), "{message}");
    // Another master behind the same sentinels is another node.
    Redlock::from_urls(
        [
            format!("redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/locks"),
            format!("redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/other"),
        ],
        options(),
    )
    .unwrap();
}

#[tokio::test]
async fn connect_refuses_one_server_under_two_names() {
    let servers = RedisServer::start_many(2);
    let port = servers[0].port();
    let urls = [
        format!("redis://localhost:{port}"),
        servers[1].url(),
        format!("redis://127.0.0.1:{port}"),
    ];
    let message = Redlock::connect(&urls, patient())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("same server")
            && message.contains(&format!("localhost:{port}"))
            && message.contains(&format!("127.0.0.1:{port}")),
        "{message}"
    );
    // Distinct servers pass, also with one of them down.
    let mut down = RedisServer::start();
    down.kill();
    Redlock::connect([servers[0].url(), servers[1].url(), down.url()], patient())
        .await
        .unwrap();
}

#[tokio::test]
async fn one_server_under_two_names_never_votes_twice() {
    // Two names for one server and a dead third node: one server is up, which is not
    // a majority of three, so no lease may be granted. `from_urls` does not connect,
    // so it cannot see that the two names are one server: the votes must tell.
    let server = RedisServer::start();
    let mut dead = RedisServer::start();
    dead.kill();
    let port = server.port();
    let locker = Redlock::from_urls(
        [
            format!("redis://localhost:{port}"),
            format!("redis://127.0.0.1:{port}"),
            dead.url(),
        ],
        patient(),
    )
    .unwrap();
    for attempt in 0..3 {
        let resource = format!("twice-{attempt}");
        match locker.try_acquire(resource.as_str()).await {
            Ok(lease) => panic!("one server granted a lease twice: {lease:?}"),
            Err(LockError::Held { .. } | LockError::Unavailable { .. }) => {}
            Err(other) => panic!("unexpected error: {other:?}"),
        }
        // Nothing is left behind: the attempt released what it set.
        eventually("the attempt cleaned up", LIMIT, || {
            !server.exists(&lock_key(&resource))
        })
        .await;
    }
}

// ---- A cancelled release still releases (issue 13, item 3) ---------------------------

#[tokio::test]
async fn a_cancelled_release_still_releases() {
    let servers = RedisServer::start_many(3);
    // A ttl far beyond the polls below: only a release can remove the keys in time.
    let locker = locker(&servers, patient().ttl(Duration::from_secs(60)));
    warm_up(&locker, &servers).await;
    let lease = locker.try_acquire("cancelled").await.unwrap();
    let key = lock_key("cancelled");
    eventually("the key on every node", LIMIT, || {
        servers
            .iter()
            .enumerate()
            .all(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(i).as_str()))
    })
    .await;
    // The release is polled once (it is the first branch), then dropped when the
    // shutdown branch, ready at once, wins: as in a server's graceful shutdown.
    let shutdown = std::future::ready(());
    tokio::select! {
        biased;
        outcome = lease.release() => panic!("released within one poll: {outcome:?}"),
        () = shutdown => {}
    }
    eventually("the cancelled release deleted every key", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    // And the local queue let go: the resource can be taken again at once.
    let again = locker.try_acquire("cancelled").await.unwrap();
    assert_eq!(again.release().await, ReleaseOutcome::Released);
}
