//! Issue 3 on real redis-server nodes: watchdog renewal, the lost signal, and waiting
//! that wakes on release (local FIFO, cross-process wake-up, cancellation, bounds).
//!
//! No test asserts a duration. Where a test waits on a timer, the passing of that time
//! is what is tested ("still held after 5 ttls", "no renewal for 3 ttls"); every other
//! wait is on an event, bounded only against hangs.
use crate::support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use support::{eventually, RedisServer, RespValue};
use tokio::task::JoinSet;
use tower_redlock::{
    FencingToken, Lease, LockError, LockOptions, LostCause, MemoryNode, Redlock, ReleaseOutcome,
};

/// Bound on any single wait for an event, so a broken engine fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(15);

fn locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    Redlock::from_urls(servers.iter().map(|s| s.url()), options).unwrap()
}

/// Short leases, so the watchdog works many times within a test.
fn short(ttl_ms: u64) -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_millis(ttl_ms))
        .node_timeout(Duration::from_millis(50))
}

/// A retry policy whose fallback never fires within a test: only a release
/// notification can wake a waiter in time.
fn no_fallback() -> LockOptions {
    LockOptions::default().retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(60))
}

/// The lock key of the resource `resource` spells, under the default prefix.
fn lock_key(resource: &str) -> String {
    format!(
        "redlock:{{{}}}",
        tower_redlock::Resource::from(resource).as_str()
    )
}

fn channel(resource: &str) -> String {
    format!("{}:released", lock_key(resource))
}

/// The wake-up channels of the waiters of `resource` subscribed on `server`: each
/// waiting process listens on its own (`<channel>:<waiter id>`, see the wait queue).
fn waiter_channels(server: &RedisServer, resource: &str) -> Vec<String> {
    match server.cmd(&["PUBSUB", "CHANNELS", &format!("{}:*", channel(resource))]) {
        RespValue::Array(items) => items
            .iter()
            .map(|item| item.to_string_lossy().expect("a channel name"))
            .collect(),
        other => panic!("PUBSUB CHANNELS: {other:?}"),
    }
}

fn info_field(server: &RedisServer, section: &str, field: &str) -> i64 {
    let text = server
        .cmd(&["INFO", section])
        .to_string_lossy()
        .expect("INFO text");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("INFO {section} has no {field}"))
}

/// EVALSHA and EVAL calls on a node since its last `reset_stats`.
fn script_calls(server: &RedisServer) -> u64 {
    server.command_calls("evalsha") + server.command_calls("eval")
}

/// Waits for two more successful renewals of `locker`'s leases.
async fn renewed_twice_more(locker: &Redlock) {
    let seen = locker.metrics().renewals;
    eventually("two more renewals", LIMIT, || {
        locker.metrics().renewals >= seen + 2
    })
    .await;
}

async fn lost_within(lease: &Lease) -> LostCause {
    tokio::time::timeout(LIMIT, lease.lost())
        .await
        .expect("the lease was never reported lost")
}

// ---------------------------------------------------------------------------------
// Watchdog and the lost signal
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_keeps_a_lease_held_for_five_ttls() {
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_millis(600);
    let holder = locker(&servers, short(600));
    let other = locker(&servers, short(600)); // another process: its own connections
    let lease = holder.try_acquire("wd:long").await.unwrap();

    let mut probes = 0;
    let until = tokio::time::Instant::now() + ttl * 5;
    while tokio::time::Instant::now() < until {
        match other.try_acquire("wd:long").await {
            Err(LockError::Held { holder_ttl, .. }) => assert!(holder_ttl.is_some()),
            other => panic!("another process got {other:?} while the lease was held"),
        }
        probes += 1;
        tokio::time::sleep(ttl / 6).await;
    }

    assert!(probes > 5);
    assert!(lease.is_held());
    assert_eq!(lease.lost_cause(), None);
    // Held where it counts, on a majority (with a 50 ms node timeout, a loaded machine
    // may let one node's extensions time out and its key run out: that costs a vote).
    let holding = servers
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            s.get(&lock_key("wd:long")).as_deref() == Some(lease.owner_on(*i).as_str())
        })
        .count();
    assert!(holding >= 2, "our key on {holding} of 3 servers");
    // Each renewal adds at most one ttl: surviving five needs at least four.
    assert!(holder.metrics().renewals >= 4, "{:?}", holder.metrics());
    assert_eq!(holder.metrics().lost, 0);
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    other.try_acquire("wd:long").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_a_majority_loses_the_lease_for_good() {
    let mut servers = RedisServer::start_many(3);
    let holder = locker(&servers, short(600));
    let lease = holder.try_acquire("wd:pause").await.unwrap();
    let handle = lease.handle();

    // A minority down: renewals go on with the other two.
    servers[0].pause();
    renewed_twice_more(&holder).await;
    assert!(lease.is_held());
    assert_eq!(lease.lost_cause(), None);

    servers[1].pause();
    assert_eq!(lost_within(&lease).await, LostCause::RenewalFailed);
    assert!(!handle.is_held());
    assert_eq!(handle.remaining(), Duration::ZERO);
    servers[0].resume();
    servers[1].resume();

    // The renewals queued on the paused nodes now run; none may bring the lease back.
    let other = locker(&servers, short(600));
    let taken = other
        .acquire("wd:pause", LIMIT)
        .await
        .expect("the resource is free once the lost lease's keys expired");
    assert!(taken.fencing_token() > lease.fencing_token());
    assert!(!lease.is_held());
    assert_eq!(lease.lost_cause(), Some(LostCause::RenewalFailed));
    match lease.extend().await {
        Err(LockError::Lost { cause, .. }) => assert_eq!(cause, LostCause::RenewalFailed),
        other => panic!("extend of a lost lease: {other:?}"),
    }
    assert_eq!(lost_within(&lease).await, LostCause::RenewalFailed);
    let metrics = holder.metrics();
    assert_eq!(metrics.lost, 1);
    assert!(metrics.renewal_failures >= 1, "{metrics:?}");
    // The lost lease's release must not touch the new holder's keys (a majority has
    // them; the running node may still have had the old key when `taken` was won).
    assert_eq!(lease.release().await, ReleaseOutcome::NotHeld);
    let key = lock_key("wd:pause");
    let holding = servers
        .iter()
        .enumerate()
        .filter(|(i, s)| s.get(&key).as_deref() == Some(taken.owner_on(*i).as_str()))
        .count();
    assert!(holding >= 2, "{holding} nodes hold the new lease");
}

async fn key_tampered_on_a_majority(tamper: impl Fn(&RedisServer, &str)) -> Vec<RedisServer> {
    let servers = RedisServer::start_many(3);
    let holder = locker(&servers, short(600));
    let lease = holder.try_acquire("wd:tamper").await.unwrap();
    let key = lock_key("wd:tamper");
    // Acquire returns at a majority; the third node's SET may still be on its way.
    eventually("every node holds the key", LIMIT, || {
        servers.iter().all(|s| s.exists(&key))
    })
    .await;
    // On a minority only: the majority still renews it.
    tamper(&servers[0], &key);
    renewed_twice_more(&holder).await;
    assert!(lease.is_held());
    assert_eq!(lease.lost_cause(), None);
    tamper(&servers[1], &key);

    assert_eq!(lost_within(&lease).await, LostCause::KeyLost);
    assert!(!lease.is_held());
    match lease.extend().await {
        Err(LockError::Lost { cause, .. }) => assert_eq!(cause, LostCause::KeyLost),
        other => panic!("extend of a lost lease: {other:?}"),
    }
    assert_eq!(holder.metrics().lost, 1);
    // Compare-and-delete: keys that are not ours stay.
    assert_eq!(lease.release().await, ReleaseOutcome::NotHeld);
    servers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_key_on_a_majority_is_key_lost() {
    let servers = key_tampered_on_a_majority(|s, key| {
        assert_eq!(s.cmd(&["DEL", key]), RespValue::Integer(1));
    })
    .await;
    assert!(!servers[0].exists(&lock_key("wd:tamper")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overwriting_the_key_on_a_majority_is_key_lost() {
    let servers = key_tampered_on_a_majority(|s, key| s.set(key, "someone-else")).await;
    for s in &servers[..2] {
        assert_eq!(
            s.get(&lock_key("wd:tamper")).as_deref(),
            Some("someone-else")
        );
    }
}

/// Waits until the lease was renewed at least twice and has just been renewed again,
/// so the next renewal is a full period away.
async fn right_after_a_renewal(locker: &Redlock) {
    eventually("two renewals", LIMIT, || locker.metrics().renewals >= 2).await;
    let seen = locker.metrics().renewals;
    eventually("one more renewal", LIMIT, || {
        locker.metrics().renewals > seen
    })
    .await;
}

/// After the lease is gone: no node sees a script call for three ttls.
async fn assert_no_more_renewals(servers: &[RedisServer], locker: &Redlock, resource: &str) {
    let key = lock_key(resource);
    eventually("the key is gone everywhere", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    for s in servers {
        s.reset_stats();
    }
    let renewals = locker.metrics().renewals;
    // Three ttls are nine renewal periods: the absence over this time is the test.
    tokio::time::sleep(locker.options().get_ttl() * 3).await;
    for s in servers {
        assert_eq!(script_calls(s), 0, "{:?}", s.info_commandstats());
        assert_eq!(s.command_calls("pexpire"), 0);
    }
    assert_eq!(locker.metrics().renewals, renewals);
    assert_eq!(locker.local_resources(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_lease_stops_its_renewals() {
    let servers = RedisServer::start_many(3);
    let holder = locker(&servers, short(300));
    let lease = holder.try_acquire("wd:drop").await.unwrap();
    let handle = lease.handle();
    right_after_a_renewal(&holder).await;
    drop(lease);
    assert_no_more_renewals(&servers, &holder, "wd:drop").await;
    assert_eq!(holder.metrics().released, 1);
    assert!(!handle.is_held());
    assert_eq!(handle.lost_cause(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_lease_stops_its_watchdog() {
    let servers = RedisServer::start_many(3);
    let holder = locker(&servers, short(300));
    let lease = holder.try_acquire("wd:release").await.unwrap();
    let handle = lease.handle();
    right_after_a_renewal(&holder).await;
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    assert_no_more_renewals(&servers, &holder, "wd:release").await;
    assert_eq!(handle.lost_cause(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_ends_the_lease_and_its_key_expires() {
    let servers = RedisServer::start_many(3);
    let holder = locker(
        &servers,
        short(600).max_hold(Some(Duration::from_millis(1500))),
    );
    let lease = holder.try_acquire("wd:max-hold").await.unwrap();
    assert_eq!(lost_within(&lease).await, LostCause::MaxHoldReached);
    assert!(!lease.is_held());
    // Still holding the `Lease` value: nobody releases, the keys expire by themselves.
    let key = lock_key("wd:max-hold");
    eventually("the keys expire", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    assert!(holder.metrics().renewals >= 1);
    assert_eq!(holder.metrics().lost, 1);
    let other = locker(&servers, short(600));
    other.try_acquire("wd:max-hold").await.unwrap();
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_watchdog_the_lease_expires() {
    let servers = RedisServer::start_many(3);
    let holder = locker(&servers, short(600).watchdog(false));
    let lease = holder.try_acquire("wd:off").await.unwrap();
    // A manual extension still works while the lease is valid.
    assert!(lease.extend().await.unwrap() > Duration::ZERO);
    assert_eq!(lost_within(&lease).await, LostCause::Expired);
    assert!(!lease.is_held());
    assert!(matches!(
        lease.extend().await,
        Err(LockError::Lost {
            cause: LostCause::Expired,
            ..
        })
    ));
    let key = lock_key("wd:off");
    eventually("the keys expire", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    let metrics = holder.metrics();
    assert_eq!(
        metrics.renewals, 1,
        "only the manual extension: {metrics:?}"
    );
    assert_eq!(metrics.lost, 1);

    // Nobody watched this one run out: `extend` says why, as `lost()` would.
    let unwatched = holder.try_acquire("wd:off:2").await.unwrap();
    tokio::time::sleep(holder.options().get_ttl()).await; // the ttl passing is the test
    assert!(matches!(
        unwatched.extend().await,
        Err(LockError::Lost {
            cause: LostCause::Expired,
            ..
        })
    ));
    assert_eq!(lost_within(&unwatched).await, LostCause::Expired);
}

// ---------------------------------------------------------------------------------
// Waiting: hand-off, FIFO, wake-up, cancellation, bounds
// ---------------------------------------------------------------------------------

/// Shared between every task of every locker: at most one inside, and fencing tokens
/// strictly increase from one holder to the next.
#[derive(Default)]
struct Exclusion {
    inside: AtomicUsize,
    last_token: Mutex<Option<FencingToken>>,
    entries: AtomicUsize,
}

impl Exclusion {
    fn enter(&self, token: FencingToken) {
        assert_eq!(self.inside.fetch_add(1, Ordering::SeqCst), 0, "overlap");
        let mut last = self.last_token.lock().unwrap();
        assert!(
            last.is_none_or(|last| token > last),
            "{last:?} then {token}"
        );
        *last = Some(token);
        self.entries.fetch_add(1, Ordering::SeqCst);
    }

    fn leave(&self) {
        assert_eq!(self.inside.fetch_sub(1, Ordering::SeqCst), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_tasks_in_two_lockers_all_acquire_in_turn() {
    const TASKS: usize = 16;
    const ROUNDS: usize = 8;
    let servers = RedisServer::start_many(3);
    let lockers = [
        locker(&servers, support::patient()),
        locker(&servers, support::patient()),
    ];
    let exclusion = Arc::new(Exclusion::default());
    let mut tasks = JoinSet::new();
    for i in 0..TASKS {
        let locker = lockers[i % 2].clone();
        let exclusion = exclusion.clone();
        tasks.spawn(async move {
            for _ in 0..ROUNDS {
                let lease = locker
                    .acquire("handoff", Duration::from_secs(120))
                    .await
                    .expect("every task acquires");
                exclusion.enter(lease.fencing_token());
                tokio::time::sleep(Duration::from_millis(1)).await; // the critical section
                exclusion.leave();
                assert_eq!(lease.release().await, ReleaseOutcome::Released);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(exclusion.entries.load(Ordering::SeqCst), TASKS * ROUNDS);
    for locker in &lockers {
        assert_eq!(locker.metrics().acquired, (TASKS * ROUNDS / 2) as u64);
        assert_eq!(locker.local_resources(), 0);
    }
    let key = lock_key("handoff");
    eventually("no lock key left", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
}

type Acquire = Pin<Box<dyn Future<Output = Result<Lease, LockError>> + Send>>;

/// Polls a future once, so it takes its place in the local queue right now.
async fn poll_once(fut: &mut Acquire) {
    let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
    assert!(first.is_pending(), "acquired while the resource was held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_locker_acquire_in_the_order_they_queued() {
    const WAITERS: usize = 8;
    let servers = RedisServer::start_many(3);
    let holder = locker(&servers, support::patient());
    let waiters = locker(&servers, support::patient());
    let lease = holder.try_acquire("fifo").await.unwrap();

    // Join the queue in a known sequence while another process holds the resource: the
    // first becomes the head contending at the nodes, the others queue behind it.
    let mut queued: Vec<Acquire> = Vec::new();
    for _ in 0..WAITERS {
        let locker = waiters.clone();
        let mut fut: Acquire = Box::pin(async move { locker.acquire("fifo", LIMIT).await });
        poll_once(&mut fut).await;
        queued.push(fut);
    }
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = JoinSet::new();
    // Spawned in reverse, so that the spawn order cannot explain the outcome.
    for (i, fut) in queued.into_iter().enumerate().rev() {
        let order = order.clone();
        tasks.spawn(async move {
            let lease = fut.await.expect("every waiter acquires");
            order.lock().unwrap().push(i);
            lease.release().await;
        });
    }
    eventually("every waiter waits", LIMIT, || {
        waiters.metrics().waits == WAITERS as u64
    })
    .await;
    lease.release().await;
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    assert_eq!(waiters.local_resources(), 0);
}

/// `a` holds; `b` (another process on the same nodes) waits with a 60 s fallback delay
/// and a 10 s deadline. Only the release notification can let it in.
async fn release_wakes_the_other_locker(a: &Redlock, b: &Redlock) {
    let lease = a.try_acquire("wake").await.unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("wake", Duration::from_secs(10)).await })
    };
    // Two attempts found it held: the waiter is subscribed and sleeping on its fallback.
    eventually("the waiter sleeps", LIMIT, || {
        let m = b.metrics();
        m.contended >= 2 && m.waits == 1
    })
    .await;
    let token = lease.fencing_token();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    let next = waiter
        .await
        .unwrap()
        .expect("woken by the release, long before the fallback retry");
    assert!(next.fencing_token() > token);
    assert!(b.metrics().wakeups >= 1, "{:?}", b.metrics());
    next.release().await;
    assert_eq!(b.local_resources(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_process_on_redis() {
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, support::patient());
    let b = locker(&servers, no_fallback());
    release_wakes_the_other_locker(&a, &b).await;
    // The waiter's subscriptions ended with its queue (after a short linger).
    eventually("unsubscribed", LIMIT, || {
        servers
            .iter()
            .all(|s| waiter_channels(s, "wake").is_empty())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_locker_on_memory_nodes() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let a = Redlock::new(nodes.clone(), LockOptions::default()).unwrap();
    let b = Redlock::new(nodes.clone(), no_fallback()).unwrap();
    release_wakes_the_other_locker(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_subscribes_again_at_once_is_still_woken() {
    // Each round's wait starts as soon as the previous one ended: it takes over the
    // subscriptions that wait left (kept for the next one a moment), or subscribes
    // again while their unsubscribe may be on its way. Either way it must be woken.
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, support::patient());
    let b = locker(&servers, no_fallback());
    let queue = format!("{}:queue", lock_key("resubscribe"));
    // In the node's queue, or the key reserved for it there (its previous lease's
    // release may reach that node after the round's first attempt).
    let in_line = |server: &RedisServer| {
        server.cmd(&["ZCARD", &queue]) == RespValue::Integer(1)
            || server
                .get(&lock_key("resubscribe"))
                .is_some_and(|value| value.starts_with('~'))
    };
    for round in 0..20 {
        let lease = a.try_acquire("resubscribe").await.unwrap();
        let (waits, wakeups) = (b.metrics().waits, b.metrics().wakeups);
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.acquire("resubscribe", Duration::from_secs(10)).await })
        };
        // In line on every node: it joins only once subscribed, so the release below
        // hands it the key and wakes it (its retry is a minute away).
        eventually("the waiter is in line", LIMIT, || {
            servers.iter().all(in_line)
        })
        .await;
        lease.release().await;
        let next = waiter
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        // Woken, not retried (a minute away); at times twice: woken by the first node's
        // release, it may try before the others released (one more refused attempt).
        let metrics = b.metrics();
        assert_eq!(metrics.waits, waits + 1, "round {round}: {metrics:?}");
        assert!(metrics.wakeups > wakeups, "round {round}: {metrics:?}");
        next.release().await;
    }
    eventually("unsubscribed", LIMIT, || {
        servers
            .iter()
            .all(|s| waiter_channels(s, "resubscribe").is_empty())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_that_timed_out_is_not_left_on_the_node() {
    let mut servers = RedisServer::start_many(3);
    let a = locker(&servers, LockOptions::default());
    let b = locker(&servers, no_fallback());
    // A first wait opens b's pub/sub connections to every node.
    release_wakes_the_other_locker(&a, &b).await;

    let lease = a.try_acquire("sub-timeout").await.unwrap();
    servers[0].pause();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("sub-timeout", LIMIT).await })
    };
    // Its SUBSCRIBE to the paused node is on the wire, unanswered within the timeout:
    // the waiter goes on with the other two nodes.
    let waits = b.metrics().waits;
    eventually("the waiter waits", LIMIT, || b.metrics().waits > waits).await;
    servers[0].resume();
    lease.release().await;
    waiter.await.unwrap().unwrap().release().await;
    assert_eq!(b.local_resources(), 0);
    eventually("no subscription left on any node", LIMIT, || {
        servers
            .iter()
            .all(|s| waiter_channels(s, "sub-timeout").is_empty())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiters_leave_nothing_behind() {
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, support::patient());
    let b = locker(&servers, support::patient());
    let holder = a.try_acquire("dropped").await.unwrap();
    let mut waiters = Vec::new();
    for i in 0..10 {
        let locker = if i % 2 == 0 { a.clone() } else { b.clone() };
        waiters.push(tokio::spawn(async move {
            locker.acquire("dropped", Duration::from_secs(60)).await
        }));
    }
    eventually("ten waiters", LIMIT, || {
        a.metrics().waits + b.metrics().waits == 10
    })
    .await;
    eventually("the other process's head waiter subscribed", LIMIT, || {
        servers
            .iter()
            .all(|s| waiter_channels(s, "dropped").len() == 1)
    })
    .await;
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        assert!(waiter.await.unwrap_err().is_cancelled());
    }
    assert_eq!(b.local_resources(), 0);
    assert_eq!(a.local_resources(), 1, "the holder's");
    assert_eq!(holder.release().await, ReleaseOutcome::Released);
    assert_eq!(a.local_resources(), 0);
    let key = lock_key("dropped");
    eventually("no lock key and no subscription left", LIMIT, || {
        servers
            .iter()
            .all(|s| !s.exists(&key) && waiter_channels(s, "dropped").is_empty())
    })
    .await;
    b.try_acquire("dropped").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_mid_round_releases_what_landed() {
    let mut servers = RedisServer::start_many(3);
    // Long ttl: the keys must go because they are released, not because they expire.
    let options = LockOptions::default()
        .ttl(Duration::from_secs(60))
        .node_timeout(Duration::from_secs(5));
    let b = locker(&servers, options.clone());
    b.try_acquire("mid-round").await.unwrap().release().await; // connect first
    let key = lock_key("mid-round");

    servers[0].pause();
    servers[1].pause();
    let attempt = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("mid-round", Duration::from_secs(30)).await })
    };
    // The SET landed on the running node; the paused ones have it queued.
    eventually("the running node has the key", LIMIT, || {
        servers[2].exists(&key)
    })
    .await;
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    servers[0].resume();
    servers[1].resume();

    eventually("every key released", LIMIT, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    assert_eq!(b.local_resources(), 0);
    let c = locker(&servers, options);
    c.try_acquire("mid-round").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_past_its_deadline_learns_the_holder_ttl() {
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, LockOptions::default());
    let b = locker(&servers, LockOptions::default());
    let holder = a.try_acquire("deadline").await.unwrap();
    let ttl = a.options().get_ttl();
    let expect_timeout = |result: Result<Lease, LockError>, who: &str| match result {
        Err(LockError::WaitTimeout {
            holder_ttl: Some(holder_ttl),
            ..
        }) => assert!(holder_ttl <= ttl, "{who}: {holder_ttl:?}"),
        other => panic!("{who}: {other:?}"),
    };
    let short = Duration::from_millis(200);

    // Behind a holder of the same process.
    expect_timeout(a.acquire("deadline", short).await, "local waiter");
    // At the head of another process's queue, contending at the nodes.
    expect_timeout(b.acquire("deadline", short).await, "remote head");
    // Behind that head, waiting in the local queue only.
    let head = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("deadline", LIMIT).await })
    };
    let waits = b.metrics().waits;
    eventually("the head waits", LIMIT, || b.metrics().waits > waits).await;
    expect_timeout(b.acquire("deadline", short).await, "behind the remote head");

    holder.release().await;
    head.await
        .unwrap()
        .expect("the head gets it after the release");
    assert_eq!(a.local_resources(), 0);
    eventually("b's lease dropped", LIMIT, || b.local_resources() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_waiter_finds_the_queue_full() {
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, support::patient());
    let b = locker(&servers, support::patient().max_waiters(2));
    // Each waiter releases at once, so they can be joined in any order.
    let spawn_waiter = |locker: &Redlock, resource: &'static str| {
        let locker = locker.clone();
        tokio::spawn(async move {
            let lease = locker.acquire(resource, LIMIT).await?;
            lease.release().await;
            Ok::<_, LockError>(())
        })
    };
    let expect_full = |result: Result<Lease, LockError>| match result {
        Err(LockError::QueueFull { limit, .. }) => assert_eq!(limit, 2),
        other => panic!("third waiter: {other:?}"),
    };

    // The holder is local: two callers queue behind it.
    let bounded = a.with_max_waiters(2);
    let local = bounded.try_acquire("full:local").await.unwrap();
    let first = [
        spawn_waiter(&bounded, "full:local"),
        spawn_waiter(&bounded, "full:local"),
    ];
    eventually("two local waiters", LIMIT, || a.metrics().waits == 2).await;
    expect_full(bounded.acquire("full:local", LIMIT).await);
    // Unbounded clones of the same locker are not limited.
    let unbounded = spawn_waiter(&a, "full:local");
    eventually("a third local waiter", LIMIT, || a.metrics().waits == 3).await;

    // The holder is another process: the head contending at the nodes is waiting too.
    let remote = a.try_acquire("full:remote").await.unwrap();
    let second = [
        spawn_waiter(&b, "full:remote"),
        spawn_waiter(&b, "full:remote"),
    ];
    eventually("two remote waiters", LIMIT, || b.metrics().waits == 2).await;
    expect_full(b.acquire("full:remote", LIMIT).await);

    local.release().await;
    remote.release().await;
    for waiter in first.into_iter().chain(second).chain([unbounded]) {
        waiter.await.unwrap().unwrap();
    }
    assert_eq!(a.local_resources() + b.local_resources(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_renewals_losses_waits_and_wakeups() {
    let servers = RedisServer::start_many(3);
    let a = locker(&servers, short(300));
    let b = locker(
        &servers,
        short(300).retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(60)),
    );
    let lease = a.try_acquire("metrics").await.unwrap();
    eventually("renewals", LIMIT, || a.metrics().renewals >= 2).await;

    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("metrics", LIMIT).await })
    };
    eventually("b waits", LIMIT, || b.metrics().contended >= 2).await;
    lease.release().await;
    let taken = waiter.await.unwrap().unwrap();
    let m = b.metrics();
    assert_eq!((m.acquired, m.waits, m.lost), (1, 1, 0), "{m:?}");
    assert!(m.wakeups >= 1, "{m:?}");

    let key = lock_key("metrics");
    servers[0].cmd(&["DEL", &key]);
    servers[2].cmd(&["DEL", &key]);
    assert_eq!(lost_within(&taken).await, LostCause::KeyLost);
    let m = b.metrics();
    assert_eq!(m.lost, 1);
    let m_a = a.metrics();
    assert_eq!(
        (m_a.acquired, m_a.released, m_a.lost, m_a.waits),
        (1, 1, 0, 0)
    );
    assert!(m_a.renewals >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_leases_renew_over_one_connection() {
    const LEASES: usize = 10_000;
    let server = RedisServer::start();
    // Ten thousand renewals queue on one connection: under CPU load the last of a round
    // can wait long, so the node timeout is generous and the ttl leaves room for retries.
    let ttl = Duration::from_secs(5);
    let holder = Redlock::connect(
        [server.url()],
        LockOptions::default()
            .ttl(ttl)
            .node_timeout(support::PATIENT_NODE_TIMEOUT),
    )
    .await
    .unwrap();
    let leases: Vec<Lease> = stream::iter(0..LEASES)
        .map(|i| {
            let holder = holder.clone();
            async move { holder.try_acquire(format!("many-{i}")).await.unwrap() }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert_eq!(leases.len(), LEASES);
    assert_eq!(holder.local_resources(), LEASES);

    // More than two ttls: only renewals can keep them.
    tokio::time::sleep(ttl * 5 / 2).await;
    let clients = info_field(&server, "clients", "connected_clients");
    assert!(clients <= 3, "{clients} connections for {LEASES} leases");
    let lost = leases.iter().filter(|l| !l.is_held()).count();
    assert_eq!(lost, 0, "{:?}", holder.metrics());
    assert!(leases.iter().all(|l| l.lost_cause().is_none()));
    let m = holder.metrics();
    assert_eq!(m.lost, 0);
    assert!(m.renewals >= 2 * LEASES as u64, "{m:?}");

    drop(leases);
    eventually("every lease released", LIMIT, || {
        holder.local_resources() == 0
    })
    .await;
    // Ten thousand releases at once may outrun the per-node timeout; a release that
    // timed out leaves its key to expire (within one ttl).
    eventually("every lock key gone", LIMIT, || {
        server.keys("redlock:{many-*}").is_empty()
    })
    .await;
}

// ---- Pub/sub across node restarts and freezes (issue 13, items 4 and 5) -------------

/// A fallback retry far beyond every bound of these tests: a waiter that finishes in
/// time was woken by a release notification.
fn wake_up_only() -> LockOptions {
    LockOptions::default()
        .node_timeout(Duration::from_millis(100))
        .retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(3600))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_through_a_node_that_was_down_for_long() {
    let mut servers = RedisServer::start_many(3);
    let resource = "restarted";
    let key = lock_key(resource);
    // Another process holds the resource on A and B (C restarts empty anyway).
    for s in &servers[..2] {
        assert_eq!(
            s.cmd(&["SET", &key, "another-process", "PX", "600000"]),
            RespValue::Simple("OK".into())
        );
    }
    let locker = locker(&servers, wake_up_only());
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.acquire(resource, Duration::from_secs(3600)).await })
    };
    eventually("the waiter subscribed on every node", LIMIT, || {
        servers
            .iter()
            .all(|s| waiter_channels(s, resource).len() == 1)
    })
    .await;

    // C is down for longer than any reconnection attempt of a connection manager,
    // which is the point of the test (not a synchronisation).
    servers[2].kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    servers[2].restart();
    eventually(
        "the subscription is back on the restarted node",
        LIMIT,
        || waiter_channels(&servers[2], resource).len() == 1,
    )
    .await;

    // The locker's command connection to C works again too (this test is about the
    // subscription; a command connection that is still reconnecting would only turn
    // the woken waiter's vote there into a failure).
    let start = std::time::Instant::now();
    for probe in 0.. {
        let probe = format!("probe-{probe}");
        if let Ok(lease) = locker.try_acquire(probe.as_str()).await {
            // Landed within a second, or try again with another probe.
            let on_c = tokio::time::timeout(Duration::from_secs(1), async {
                while !servers[2].exists(&lock_key(&probe)) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .is_ok();
            lease.release().await;
            if on_c {
                break;
            }
        }
        assert!(start.elapsed() < LIMIT, "the locker never voted on C again");
    }

    // The holder lets go on A without a word (as if its key expired there) and
    // releases on C, publishing only there: only the subscription on C can wake the
    // waiter before its hour-long fallback.
    assert_eq!(servers[0].cmd(&["DEL", &key]), RespValue::Integer(1));
    let own = waiter_channels(&servers[2], resource).remove(0);
    servers[2].cmd(&["PUBLISH", &own, ""]);
    let lease = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the waiter was not woken through the restarted node")
        .unwrap()
        .unwrap();
    assert!(locker.metrics().wakeups >= 1);
    lease.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_giving_up_on_a_frozen_node_pile_nothing_up() {
    let mut servers = RedisServer::start_many(3);
    // A per-node timeout that a loaded machine keeps on the live nodes.
    let options = LockOptions::default().node_timeout(Duration::from_millis(500));
    let locker = locker(&servers, options);
    // Held by another process on every node, for every resource.
    let resources: Vec<String> = (0..100).map(|i| format!("frozen-{i}")).collect();
    for s in &servers {
        for resource in &resources {
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
        .acquire("frozen-0", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LockError::WaitTimeout { .. } | LockError::Unavailable { .. }
        ),
        "{err:?}"
    );
    let runtime = tokio::runtime::Handle::current().metrics();
    let baseline = runtime.num_alive_tasks();

    servers[2].pause();
    let mut waiters = JoinSet::new();
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
        // Each gives up: at its deadline, or at once should the live nodes be too
        // slow to answer on a loaded machine.
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
    // While the node is still frozen, what the waiters left behind is bounded: one
    // pub/sub upkeep task and connection per node, not one task per waiter.
    eventually("the tasks the waiters left behind end", LIMIT, || {
        runtime.num_alive_tasks() <= baseline + 10
    })
    .await;

    servers[2].resume();
    eventually("every subscription ended", LIMIT, || {
        servers.iter().all(|s| {
            matches!(s.cmd(&["PUBSUB", "CHANNELS", "*"]), RespValue::Array(ref a) if a.is_empty())
        })
    })
    .await;
    eventually("everything drained", LIMIT, || {
        runtime.num_alive_tasks() <= baseline + 10
    })
    .await;
    // And the node serves waiters again.
    for s in &servers {
        s.cmd(&["DEL", &lock_key("frozen-1")]);
    }
    locker
        .try_acquire("frozen-1")
        .await
        .unwrap()
        .release()
        .await;
}
