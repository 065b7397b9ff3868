//! A fenced acquisition's server work (issue 16): when granted at the floor, one SET NX,
//! one EXISTS of the wait queue, one GET of the counter and one SET of the counter with
//! its ttl (no INCR, no PEXPIRE, none of the queue's commands); when held, the same plus
//! GET holder and PTTL; a release with nobody queued, GET, EXISTS, DEL and the
//! broadcast PUBLISH; the counter's rule
//! `max(counter + 1, floor)` exact up to 2^53; a counter that is not a whole number
//! fails the attempt and leaves no key.
use crate::support;

use std::time::Duration;

use support::RedisServer;
use tower_redlock::{LockError, LockOptions, Redlock};

fn locker(server: &RedisServer) -> Redlock {
    Redlock::from_urls([server.url()], support::patient()).unwrap()
}

/// Calls of each command the script runs, since the last reset.
fn calls(server: &RedisServer) -> [u64; 6] {
    ["set", "get", "pttl", "incr", "pexpire", "exists"].map(|name| server.command_calls(name))
}

/// Calls of the wait queue's commands and of the release's, since the last reset.
fn queue_and_release_calls(server: &RedisServer) -> [u64; 6] {
    ["zrange", "zpopmin", "zadd", "del", "publish", "exists"].map(|name| server.command_calls(name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_acquire_and_its_release_run_the_fewest_commands() {
    let server = RedisServer::start();
    let holder = locker(&server);
    let other = locker(&server);
    // Scripts loaded, connections made.
    holder.try_acquire("warm").await.unwrap().release().await;
    other.try_acquire("warm").await.unwrap().release().await;

    server.reset_stats();
    let lease = holder.try_acquire("three").await.unwrap();
    // set: the lock key, then the counter; get: the counter; exists: the queue.
    assert_eq!(calls(&server), [2, 1, 0, 0, 0, 1]);
    assert_eq!(queue_and_release_calls(&server)[..3], [0, 0, 0]);

    server.reset_stats();
    let err = other.try_acquire("three").await.unwrap_err();
    assert!(matches!(err, LockError::Held { .. }), "{err}");
    // set: refused; exists: the queue; the counter's step runs anyway (one get, then one
    // set at the floor, or incr and pexpire within the same millisecond); get: the
    // holder; pttl: its ttl.
    let [set, get, pttl, incr, pexpire, exists] = calls(&server);
    assert_eq!([get, pttl, exists], [2, 1, 1]);
    assert!(
        [set, incr, pexpire] == [2, 0, 0] || [set, incr, pexpire] == [1, 1, 1],
        "{:?}",
        calls(&server)
    );

    server.reset_stats();
    lease.release().await;
    // get: the holder; exists: the queue; del; no publish: nobody waits or listens.
    assert_eq!(queue_and_release_calls(&server), [0, 0, 0, 1, 0, 1]);
    assert_eq!(server.command_calls("get"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_ahead_of_the_floor_grows_by_one_exactly() {
    let server = RedisServer::start();
    let locker = locker(&server);
    let fence = "redlock:{ahead}:fence";
    // Just under 2^53 and far ahead of any clock's floor.
    server.set(fence, "9007199254740000");
    server.reset_stats();
    let lease = locker.try_acquire("ahead").await.unwrap();
    // set: the lock key; get: the counter; incr and pexpire: the counter; exists: the queue.
    assert_eq!(calls(&server), [1, 1, 0, 1, 1, 1]);
    assert_eq!(lease.fencing_token().get(), 9_007_199_254_740_001);
    assert_eq!(server.get(fence).as_deref(), Some("9007199254740001"));
    // The counter keeps its own ttl (the fence ttl), not the lock's.
    assert!(server.pttl(fence) > LockOptions::default().get_ttl().as_millis() as i64);
    lease.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_that_is_no_whole_number_fails_and_leaves_no_key() {
    let server = RedisServer::start();
    let locker = locker(&server);
    for (resource, bad) in [("half", "1.5"), ("word", "abc"), ("below", "-3")] {
        server.set(&format!("redlock:{{{resource}}}:fence"), bad);
        let err = locker.try_acquire(resource).await.unwrap_err();
        assert!(
            err.to_string().contains("not an integer"),
            "{resource}: {err}"
        );
        assert!(
            !server.exists(&format!("redlock:{{{resource}}}")),
            "{resource}: key left"
        );
    }
    // Another type at the counter: the server's own error, and no key either.
    let reply = server.cmd(&["LPUSH", "redlock:{list}:fence", "x"]);
    assert_eq!(reply.as_int(), Some(1));
    let err = locker.try_acquire("list").await.unwrap_err();
    assert!(err.to_string().contains("WRONGTYPE"), "{err}");
    assert!(!server.exists("redlock:{list}"), "key left");
    // The resource is free for a good counter.
    server.cmd(&["DEL", "redlock:{list}:fence"]);
    let lease = tokio::time::timeout(Duration::from_secs(5), locker.try_acquire("list"))
        .await
        .unwrap()
        .unwrap();
    lease.release().await;
}
