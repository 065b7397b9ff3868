//! Issue 33: what operators configure and what options accept. Each test starts its
//! servers with the configuration in question (an evicting `maxmemory-policy`, a
//! replica, a restricted ACL user) or gives an option an extreme value, and checks
//! that the locker refuses it with a `ConfigError` naming what to change, or works.
//!
//! No test asserts a duration: every wait is on an event, bounded only against hangs.
use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::{eventually, RedisServer};
use tower_redlock::node::{
    AcquireReply, AcquireRequest, ExtendEntry, LockKeys, NodeFuture, Owner, ReleaseSignal,
};
use tower_redlock::{
    LockError, LockOptions, LostCause, MemoryNode, Node, RedisNode, Redlock, ReleaseOutcome,
};

/// Bound on any single wait for an event, so a broken engine fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(15);

/// Short leases, so the watchdog works many times within a test.
fn short(ttl_ms: u64) -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_millis(ttl_ms))
        .node_timeout(Duration::from_millis(50))
}

/// Waits for two more successful renewals of `locker`'s leases.
async fn renewed_twice_more(locker: &Redlock) {
    let seen = locker.metrics().renewals;
    eventually("two more renewals", LIMIT, || {
        locker.metrics().renewals >= seen + 2
    })
    .await;
}

// ---------------------------------------------------------------------------------
// 4. No option value can stop the watchdog; a failed renewal task loses its leases
// ---------------------------------------------------------------------------------

/// Before the fix the renewal task panicked on `acquired_at + Duration::MAX` at the
/// lease's first renewal: no renewal ever came and this test timed out waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_of_duration_max_is_no_limit() {
    let server = RedisServer::start();
    let locker =
        Redlock::from_urls([server.url()], short(600).max_hold(Some(Duration::MAX))).unwrap();
    let lease = locker.try_acquire("ops:max-hold-max").await.unwrap();
    renewed_twice_more(&locker).await;
    assert_eq!(lease.lost_cause(), None);
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

/// A node that forwards to a Redis server, and panics in `extend_many` while `fail`
/// is set: a custom node with a bug, inside the renewal task.
struct PanickingRenewals {
    inner: RedisNode,
    fail: Arc<AtomicBool>,
}

impl Node for PanickingRenewals {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        self.inner.acquire(request)
    }
    fn extend(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        self.inner.extend(keys, owner, ttl)
    }
    fn extend_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, tower_redlock::NodeError>>> {
        assert!(
            !self.fail.load(Ordering::SeqCst),
            "a node bug in extend_many (expected by the test)"
        );
        self.inner.extend_many(entries, ttl)
    }
    fn release(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        self.inner.release(keys, owner)
    }
    fn raise_fence(&self, keys: &LockKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()> {
        self.inner.raise_fence(keys, token, fence_ttl)
    }
    fn subscribe(&self, keys: &LockKeys) -> NodeFuture<ReleaseSignal> {
        self.inner.subscribe(keys)
    }
}

/// Before the fix the panic left the scheduler's `running` flag set: the lease was
/// never reported lost (`lost()` timed out here) and no later lease was renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_task_loses_its_leases_and_renewal_restarts() {
    let server = RedisServer::start();
    let fail = Arc::new(AtomicBool::new(true));
    let node = PanickingRenewals {
        inner: RedisNode::open(server.url().as_str()).unwrap(),
        fail: fail.clone(),
    };
    let locker = Redlock::new([node], short(600)).unwrap();
    let first = locker.try_acquire("ops:renewal-fails:1").await.unwrap();
    let cause = tokio::time::timeout(LIMIT, first.lost())
        .await
        .expect("a lease of a failed renewal task was never reported lost");
    assert_eq!(cause, LostCause::RenewalFailed);

    fail.store(false, Ordering::SeqCst);
    let second = locker.try_acquire("ops:renewal-fails:2").await.unwrap();
    renewed_twice_more(&locker).await;
    assert_eq!(second.lost_cause(), None);
    assert_eq!(second.release().await, ReleaseOutcome::Released);
}

// ---------------------------------------------------------------------------------
// 5. Lease::extend respects max_hold
// ---------------------------------------------------------------------------------

/// Before the fix `extend` renewed the lease past `max_hold` and answered `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_by_hand_is_refused_past_max_hold() {
    let server = RedisServer::start();
    let options = short(600)
        .watchdog(false)
        .max_hold(Some(Duration::from_millis(1)));
    let locker = Redlock::from_urls([server.url()], options).unwrap();
    let lease = locker.try_acquire("ops:extend-max-hold").await.unwrap();
    match lease.extend().await {
        Err(LockError::Lost {
            cause: LostCause::MaxHoldReached,
            ..
        }) => {}
        other => panic!("extend past max_hold answered {other:?}"),
    }
    // Refused, not lost: the lease is still released as any other.
    assert_eq!(lease.release().await, ReleaseOutcome::Released);

    // Without the limit the same lease extends.
    let unlimited = Redlock::from_urls([server.url()], short(600).watchdog(false)).unwrap();
    let lease = unlimited.try_acquire("ops:extend-max-hold").await.unwrap();
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

// ---------------------------------------------------------------------------------
// 6. Extreme option values fail with a ConfigError naming the option, or work
// ---------------------------------------------------------------------------------

/// Before the fix both panicked in `Redlock::new` (`Duration` overflow).
#[tokio::test]
async fn duration_max_timeouts_are_refused_by_name() {
    for (name, options) in [
        (
            "node_timeout",
            LockOptions::default().node_timeout(Duration::MAX),
        ),
        (
            "min_validity",
            LockOptions::default().min_validity(Duration::MAX),
        ),
    ] {
        let error = Redlock::new([MemoryNode::new()], options).expect_err(name);
        assert!(error.to_string().contains(name), "{error}");
    }
}

mod extremes {
    use super::*;
    use proptest::prelude::*;

    /// Durations at the edges: zero, one nanosecond, one millisecond, the defaults'
    /// order of magnitude, and the largest.
    fn duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::from_nanos(1)),
            Just(Duration::from_millis(1)),
            Just(Duration::from_millis(50)),
            Just(Duration::from_secs(10)),
            Just(Duration::from_secs(u64::MAX)),
            Just(Duration::MAX),
            any::<u64>().prop_map(Duration::from_nanos),
        ]
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), Just("{".to_owned()), ".{0,12}"]
    }

    #[derive(Debug, Clone)]
    enum Set {
        Ttl(Duration),
        NodeTimeout(Duration),
        DriftFactor(f64),
        MinValidity(Duration),
        KeyPrefix(String),
        FenceTtl(Duration),
        Watchdog(bool),
        MaxHold(Option<Duration>),
        MaxWaiters(usize),
        Fencing(bool),
        RetryPolicy(Duration),
    }

    impl Set {
        fn name(&self) -> &'static str {
            match self {
                Set::Ttl(_) => "ttl",
                Set::NodeTimeout(_) => "node_timeout",
                Set::DriftFactor(_) => "drift_factor",
                Set::MinValidity(_) => "min_validity",
                Set::KeyPrefix(_) => "key_prefix",
                Set::FenceTtl(_) => "fence_ttl",
                Set::Watchdog(_) => "watchdog",
                Set::MaxHold(_) => "max_hold",
                Set::MaxWaiters(_) => "max_waiters",
                Set::Fencing(_) => "fencing",
                Set::RetryPolicy(_) => "retry_policy",
            }
        }

        fn apply(self, options: LockOptions) -> LockOptions {
            match self {
                Set::Ttl(v) => options.ttl(v),
                Set::NodeTimeout(v) => options.node_timeout(v),
                Set::DriftFactor(v) => options.drift_factor(v),
                Set::MinValidity(v) => options.min_validity(v),
                Set::KeyPrefix(v) => options.key_prefix(v),
                Set::FenceTtl(v) => options.fence_ttl(v),
                Set::Watchdog(v) => options.watchdog(v),
                Set::MaxHold(v) => options.max_hold(v),
                Set::MaxWaiters(v) => options.max_waiters(v),
                Set::Fencing(v) => options.fencing(v),
                Set::RetryPolicy(v) => options.retry_policy(move |_: u32, _: Option<Duration>| v),
            }
        }
    }

    fn setter() -> impl Strategy<Value = Set> {
        prop_oneof![
            duration().prop_map(Set::Ttl),
            duration().prop_map(Set::NodeTimeout),
            prop_oneof![
                Just(0.0),
                Just(-0.0),
                Just(0.49),
                Just(0.5),
                Just(f64::NAN),
                Just(f64::INFINITY),
                Just(f64::MIN_POSITIVE),
                any::<f64>()
            ]
            .prop_map(Set::DriftFactor),
            duration().prop_map(Set::MinValidity),
            text().prop_map(Set::KeyPrefix),
            duration().prop_map(Set::FenceTtl),
            any::<bool>().prop_map(Set::Watchdog),
            proptest::option::of(duration()).prop_map(Set::MaxHold),
            prop_oneof![Just(0), Just(1), Just(usize::MAX), any::<usize>()]
                .prop_map(Set::MaxWaiters),
            any::<bool>().prop_map(Set::Fencing),
            duration().prop_map(Set::RetryPolicy),
        ]
    }

    /// A locker built from `sets` on a memory node either is refused with a message
    /// naming one of the options set, or takes, extends, waits for and releases
    /// leases, and renews them, without a panic.
    fn builds_or_names(sets: Vec<Set>) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async move {
            let names: Vec<&str> = sets.iter().map(Set::name).collect();
            let options = sets
                .into_iter()
                .fold(LockOptions::default(), |options, set| set.apply(options));
            let locker = match Redlock::new([MemoryNode::new()], options) {
                Ok(locker) => locker,
                Err(error) => {
                    let message = error.to_string();
                    prop_assert!(
                        names.iter().any(|name| message.contains(name)),
                        "{message} names none of {names:?}"
                    );
                    return Ok(());
                }
            };
            // Whatever the nodes answer, nothing panics: the outcome is a lease or an
            // error, with time passing (the clock is paused: it jumps to each timer).
            if let Ok(lease) = locker.try_acquire("prop").await {
                let waiter = locker.acquire("prop", Duration::from_secs(1));
                let ttl = locker.options().get_ttl();
                let (_, _) = tokio::join!(waiter, async {
                    tokio::time::sleep(ttl.saturating_mul(3)).await;
                    let _ = lease.extend().await;
                    lease.release().await
                });
            }
            let _ = locker.acquire("prop", Duration::MAX).await;
            Ok(())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn every_option_value_is_refused_by_name_or_works(
            sets in proptest::collection::vec(setter(), 1..4),
        ) {
            builds_or_names(sets)?;
        }

        #[test]
        fn node_urls_of_any_text_are_refused_or_built(url in prop_oneof![
            Just(String::new()),
            Just("redis://".to_owned()),
            Just("redis://:@".to_owned()),
            Just("redis://h:99999999999999999999".to_owned()),
            Just("redis-sentinel://".to_owned()),
            Just("redis+cluster://".to_owned()),
            "(redis|rediss|redis\\+cluster|redis-sentinel|etcd)://.{0,24}",
            ".{0,24}",
        ]) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async { tower_redlock::node_from_url(&url).map(drop) }).ok();
        }
    }
}

/// `LockLayer` and `Replay` setters at their extremes, on a Redis node: every request
/// gets an answer of the layer (no panic, no 503 from a value Redis refuses). Before
/// the fix `Replay::retention(Duration::MAX)` made every replayed request answer 503
/// here (Redis refused the record's expiry) and panic on a `MemoryNode`.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_and_replay_settings_at_their_extremes_answer_requests() {
    use axum::{body::Body, routing::post, Router};
    use http::{Request, StatusCode};
    use tower::ServiceExt;
    use tower_redlock::http::{header, Contention, LockLayer, Replay, UnknownOutcome};

    let server = RedisServer::start();
    let durations = [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_secs(u64::MAX),
        Duration::MAX,
    ];
    let mut case = 0;
    for retention in durations {
        for (wait, sizes) in durations.into_iter().zip([0, 1, usize::MAX, usize::MAX]) {
            case += 1;
            for memory in [false, true] {
                let locker = if memory {
                    Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap()
                } else {
                    Redlock::from_urls([server.url()], LockOptions::default()).unwrap()
                };
                let replay = Replay::new()
                    .retention(retention)
                    .unknown_outcome(UnknownOutcome::ReexecuteAfter(retention))
                    .max_body(sizes)
                    .max_request_body(sizes);
                let layer = LockLayer::new(locker, header("Idempotency-Key"))
                    .contention(Contention::Wait { timeout: wait })
                    .max_key_len(sizes)
                    .queue_limit(sizes)
                    .replay(replay);
                let app = Router::new()
                    .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
                    .route_layer(layer);
                let key = format!("ops-{case}-{memory}");
                for _ in 0..2 {
                    let request = Request::post("/pay")
                        .header("Idempotency-Key", &key)
                        .body(Body::from("{}"))
                        .unwrap();
                    let response = app.clone().oneshot(request).await.unwrap();
                    assert_ne!(
                        response.status(),
                        StatusCode::SERVICE_UNAVAILABLE,
                        "retention {retention:?}, wait {wait:?}, sizes {sizes}, memory {memory}"
                    );
                }
            }
        }
    }
}
