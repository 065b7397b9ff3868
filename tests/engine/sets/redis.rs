//! Sets on real `redis-server` nodes: one script per node and operation, exclusion
//! under contention, nodes down, a lease lost, a restart from a snapshot.
use super::*;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use support::history::History;
use support::RedisServer;

/// A locker over the servers: a separate "process" with its own connections.
fn redis_locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    Redlock::from_urls(servers.iter().map(RedisServer::url), options).unwrap()
}

/// The lock keys on a server (fence counters, and wait queues with a waiting set's mark,
/// may stay: they are not locks).
fn lock_keys(server: &RedisServer) -> Vec<String> {
    server
        .keys("redlock:*")
        .into_iter()
        .filter(|k| !k.ends_with(":fence") && !k.ends_with(":queue"))
        .collect()
}

async fn no_lock_keys_left(servers: &[RedisServer]) {
    eventually("no lock key left on any node", LIMIT, || {
        servers
            .iter()
            .filter(|s| s.is_running())
            .all(|s| lock_keys(s).is_empty())
    })
    .await;
}

/// Overlapping sets over four accounts, named in opposite orders by many tasks on two
/// lockers (two "processes"): every task finishes, no two sections overlap on any
/// member, and each member's tokens grow (the history checker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_sets_in_opposite_orders_never_deadlock_or_overlap() {
    const TASKS: usize = 16;
    const ROUNDS: usize = 10;
    let servers = RedisServer::start_many(3);
    let lockers = [
        redis_locker(&servers, support::patient()),
        redis_locker(&servers, support::patient()),
    ];
    // The last one is a single resource (the ordinary path), meeting the sets on `acct:2`.
    let sets: [&[&str]; 5] = [
        &["acct:1", "acct:2"],
        &["acct:2", "acct:1"],
        &["acct:3", "acct:2", "acct:1"],
        &["acct:1", "acct:4", "acct:3"],
        &["acct:2", "acct:2"],
    ];
    let history = History::new("overlapping sets");
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let locker = lockers[i % 2].clone();
        let set = sets[i % sets.len()];
        let (history, done) = (history.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let lease = locker
                    .acquire_all(set.iter().copied(), Duration::from_secs(60))
                    .await
                    .unwrap();
                let mut sections: Vec<_> = lease
                    .fencing_tokens()
                    .map(|(resource, token)| {
                        history.begin(resource.as_str(), token.get(), format!("task {i}"))
                    })
                    .collect();
                tokio::task::yield_now().await;
                for section in &mut sections {
                    assert!(section.write(), "a member's write was refused");
                }
                let held = lease.is_held();
                for section in sections {
                    section.end(!held);
                }
                assert_eq!(lease.release().await, ReleaseOutcome::Released);
            }
            done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), TASKS);
    let summary = history.check();
    let sections: usize = (0..TASKS)
        .map(|i| {
            let mut members = sets[i % sets.len()].to_vec();
            members.sort_unstable();
            members.dedup();
            members.len() * ROUNDS
        })
        .sum();
    assert_eq!(summary.cycles, sections as u64);
    for locker in &lockers {
        assert_eq!(locker.local_resources(), 0);
    }
    no_lock_keys_left(&servers).await;
}

/// One node down: the set is granted by the other two; two down: refused as
/// unavailable, and nothing of it stays on the node that answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_survives_a_node_down_and_is_refused_without_a_majority() {
    let mut servers = RedisServer::start_many(3);
    let locker = redis_locker(&servers, support::patient());
    servers[0].kill();
    let lease = locker.try_acquire_all(["x", "y", "z"]).await.unwrap();
    for server in &servers[1..] {
        for member in ["x", "y", "z"] {
            assert!(server.exists(&lock_key(member)), "{member} missing");
        }
    }
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    no_lock_keys_left(&servers).await;

    servers[1].kill();
    match locker.try_acquire_all(["x", "y", "z"]).await {
        Err(LockError::Unavailable {
            answered, quorum, ..
        }) => {
            // The round ends once no majority is possible: the two dead nodes' refusals
            // may both come before the live node's answer.
            assert_eq!(quorum, 2);
            assert!(answered <= 1, "{answered} nodes answered");
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
    // The live node granted the set, answering before the round ended or after: the
    // failed attempt takes it back either way.
    no_lock_keys_left(&servers).await;
    assert_eq!(locker.local_resources(), 0);
}

/// One member's key deleted on a majority: the whole lease is lost, and its release
/// leaves nothing on any node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_whose_member_is_gone_on_a_majority_is_lost_on_redis() {
    let servers = RedisServer::start_many(3);
    let locker = redis_locker(&servers, support::patient().watchdog(false));
    let lease = locker.try_acquire_all(["p", "q"]).await.unwrap();
    // The acquire returns at a majority; the third node's call may still be on its way,
    // and landing after the DELs below it would put `q` back there.
    eventually("the set on every node", LIMIT, || {
        servers
            .iter()
            .all(|s| s.exists(&lock_key("p")) && s.exists(&lock_key("q")))
    })
    .await;
    assert!(lease.extend().await.is_ok());
    servers[0].cmd(&["DEL", &lock_key("q")]);
    servers[2].cmd(&["DEL", &lock_key("q")]);
    match lease.extend().await {
        Err(LockError::Lost { cause, .. }) => assert_eq!(cause, LostCause::KeyLost),
        other => panic!("expected the set lost, got {other:?}"),
    }
    lease.release().await;
    no_lock_keys_left(&servers).await;
}

/// Script calls (`EVALSHA`, and `EVAL` after `NOSCRIPT`) a server has run.
fn script_calls(server: &RedisServer) -> u64 {
    server.command_calls("evalsha") + server.command_calls("eval")
}

/// One script per node for the whole set: acquiring, extending and releasing five
/// members cost one call each per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_costs_one_call_per_node_and_operation_on_redis() {
    let servers = RedisServer::start_many(3);
    let locker = redis_locker(&servers, support::patient().watchdog(false));
    // Loads the scripts and opens the connections.
    let warm = locker.try_acquire_all(["w1", "w2"]).await.unwrap();
    warm.extend().await.unwrap();
    warm.release().await;
    no_lock_keys_left(&servers).await;
    for server in &servers {
        server.reset_stats();
    }
    let members = ["m1", "m2", "m3", "m4", "m5"];
    let lease = locker.try_acquire_all(members).await.unwrap();
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    // An extend call may still be on its way to the slowest node.
    eventually("three script calls on every node", LIMIT, || {
        servers.iter().all(|s| script_calls(s) >= 3)
    })
    .await;
    for server in &servers {
        assert_eq!(script_calls(server), 3, "port {}", server.port());
    }
}

/// A member held by someone else: the set is refused naming it, and no other member is
/// ever written on any node (the script checks every member before it writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_member_refuses_the_whole_set_on_redis() {
    let servers = RedisServer::start_many(3);
    let holder = redis_locker(&servers, support::patient());
    let locker = redis_locker(&servers, support::patient());
    let b = holder.try_acquire("b").await.unwrap();
    match locker.try_acquire_all(["c", "b", "a"]).await {
        Err(LockError::Held {
            resource,
            holder_ttl,
        }) => {
            assert_eq!(resource.as_str(), "b");
            assert!(holder_ttl.is_some());
        }
        other => panic!("expected b held, got {other:?}"),
    }
    for server in &servers {
        assert!(
            !server.exists(&lock_key("a")),
            "a written on {}",
            server.port()
        );
        assert!(
            !server.exists(&lock_key("c")),
            "c written on {}",
            server.port()
        );
    }
    b.release().await;
    let lease = locker.try_acquire_all(["c", "b", "a"]).await.unwrap();
    assert_eq!(names(lease.resources()), ["a", "b", "c"]);
    let b_token = lease.fencing_token_of(&"b".into()).unwrap();
    lease.release().await;
    let b_again = holder.try_acquire("b").await.unwrap();
    assert!(b_again.fencing_token() > b_token);
    b_again.release().await;
    no_lock_keys_left(&servers).await;
}

/// Acquires and releases the set `{p, q}` once; returns each member's token.
async fn set_tokens(locker: &Redlock) -> Vec<u64> {
    let lease = locker.try_acquire_all(["q", "p"]).await.unwrap();
    let tokens = lease.fencing_tokens().map(|(_, t)| t.get()).collect();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    tokens
}

/// A node restarted from an RDB snapshot comes back with every member's fence counter
/// behind: each member's token must still exceed all its earlier ones (the clock floor
/// applies per member, as in tests/engine/persistence.rs for one resource).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_members_token_grows_after_a_restart_from_an_rdb_snapshot() {
    let mut servers = vec![RedisServer::start()];
    let locker = redis_locker(&servers, support::patient());
    let mut seen: Vec<Vec<u64>> = Vec::new();
    let mut check = |tokens: Vec<u64>, after: &str| {
        for (member, &token) in tokens.iter().enumerate() {
            let max = seen.iter().map(|t| t[member]).max().unwrap_or(0);
            assert!(token > max, "{after}: member {member}: {token} after {max}");
        }
        seen.push(tokens);
    };
    for _ in 0..3 {
        check(set_tokens(&locker).await, "first acquisitions");
    }
    servers[0].save();
    for _ in 0..3 {
        check(set_tokens(&locker).await, "after SAVE");
    }
    // SIGKILL and start: the server loads the RDB file, three grants behind.
    servers[0].restart();
    support::eventually_async("the node votes again", LIMIT, || async {
        match locker.try_acquire_all(["probe-1", "probe-2"]).await {
            Ok(lease) => lease.release().await == ReleaseOutcome::Released,
            Err(_) => false,
        }
    })
    .await;
    for _ in 0..2 {
        check(set_tokens(&locker).await, "after the restart");
    }
}

/// The members of a resource's wait queue on a server, head first.
/// Subscribes to `channel` on `server` (subscribed when this returns) and counts the
/// messages published there, until the server goes away.
fn published_on(server: &RedisServer, channel: &str) -> Arc<AtomicUsize> {
    let mut conn = support::resp::Connection::open(server.addr(), Duration::from_secs(60))
        .expect("connect a subscriber");
    let reply = conn.call_str(&["SUBSCRIBE", channel]).expect("SUBSCRIBE");
    assert!(!reply.is_error(), "SUBSCRIBE: {reply:?}");
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    std::thread::spawn(move || {
        while let Ok(message) = conn.read() {
            let kind = message
                .as_array()
                .and_then(|m| m.first()?.as_str().map(str::to_owned));
            if kind.as_deref() == Some("message") {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    count
}

fn queue_members(server: &RedisServer, resource: &str) -> Vec<String> {
    match server.cmd(&[
        "ZRANGE",
        &format!("redlock:{{{resource}}}:queue"),
        "0",
        "-1",
    ]) {
        support::resp::RespValue::Array(items) => items
            .iter()
            .filter_map(|item| item.to_string_lossy())
            .collect(),
        other => panic!("ZRANGE answered {other:?}"),
    }
}

/// A release with nobody queued publishes nothing (the cheap release), so a set waiting
/// on Redis nodes marks the members' wait queues ('*', after every waiter): the release
/// that reaches the mark wakes it on the member's channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_set_marks_the_queues_and_a_release_wakes_it() {
    let servers = RedisServer::start_many(3);
    let holder = redis_locker(&servers, support::patient());
    // A fallback retry far beyond the test (the locker keeps it under a quarter of
    // the queue's ttl, to keep the mark alive).
    let waiter_locker = redis_locker(
        &servers,
        support::patient().retry_policy(|_, _| Duration::from_secs(600)),
    );
    let b = holder.try_acquire("b").await.unwrap();
    let waiter = {
        let locker = waiter_locker.clone();
        tokio::spawn(async move {
            locker
                .acquire_all(["a", "b"], Duration::from_secs(60))
                .await
        })
    };
    // The second attempt, right after subscribing, comes after the marks.
    eventually("the set waits", LIMIT, || {
        waiter_locker.metrics().contended >= 2
    })
    .await;
    for server in &servers {
        assert_eq!(queue_members(server, "b"), ["*"]);
        assert!(server.pttl("redlock:{b}:queue") > 0, "the mark expires");
    }
    // Counted on the channel itself: a count of every PUBLISH on the server would also
    // count a stray client of another test whose server had this port before.
    let published: Vec<_> = servers
        .iter()
        .map(|server| published_on(server, "redlock:{b}:released"))
        .collect();
    let refused_before = waiter_locker.metrics().contended;
    b.release().await;
    let lease = tokio::time::timeout(LIMIT, waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(names(lease.resources()), ["a", "b"]);
    // Woken by the release, not by its retry timer (2.5 s away): every attempt since
    // came from a wake-up. Woken by the first node's release, the waiter may try before
    // the others have released, be refused, and be woken again by theirs.
    let metrics = waiter_locker.metrics();
    assert!(metrics.wakeups >= 1, "{metrics:?}");
    assert_eq!(
        metrics.contended - refused_before,
        metrics.wakeups - 1,
        "an attempt not woken by a release: {metrics:?}"
    );
    // Every node's release reached the mark and published on `b`'s channel, once.
    let mut seen = Vec::new();
    eventually("each release published on b's channel, once", LIMIT, || {
        let counts: Vec<_> = published.iter().map(|n| n.load(Ordering::SeqCst)).collect();
        if counts != seen {
            eprintln!("messages on b's channel, per node: {counts:?}");
            seen = counts;
        }
        seen.iter().all(|&n| n == 1)
    })
    .await;
    lease.release().await;
    no_lock_keys_left(&servers).await;
}

/// The mark orders no one: a caller finding the key free is granted (the mark stays
/// for the listeners), a waiter queues before it and is handed the key first, and the
/// release after the last waiter publishes on the resource's channel and ends the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_comes_after_every_waiter() {
    let servers = RedisServer::start_many(1);
    let server = &servers[0];
    let queue = "redlock:{c}:queue";
    let mark = || server.cmd(&["ZADD", queue, "+inf", "*"]);
    mark();
    let first = redis_locker(&servers, support::patient());
    let lease = first.try_acquire("c").await.unwrap();
    assert_eq!(queue_members(server, "c"), ["*"]);
    // A waiter of another process queues ahead of the mark.
    let second = redis_locker(&servers, support::patient());
    let waiter = {
        let second = second.clone();
        tokio::spawn(async move { second.acquire("c", Duration::from_secs(60)).await })
    };
    eventually("the waiter queues", LIMIT, || {
        queue_members(server, "c").len() == 2
    })
    .await;
    assert_eq!(queue_members(server, "c")[1], "*");
    server.reset_stats();
    lease.release().await;
    let lease = tokio::time::timeout(LIMIT, waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // Handed to the waiter (one publish, on its own channel); the mark stays.
    assert_eq!(server.command_calls("publish"), 1);
    assert_eq!(queue_members(server, "c"), ["*"]);
    lease.release().await;
    // The mark reached: the broadcast, and no queue left.
    assert_eq!(server.command_calls("publish"), 2);
    assert!(!server.exists(queue));
    no_lock_keys_left(&servers).await;
}
