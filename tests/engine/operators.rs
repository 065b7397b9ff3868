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

use support::node_calls::{Call, Forwarding};
use support::{eventually, RedisServer};
use tower_redlock::node::ResourceKeys;
use tower_redlock::{
    node::Node, LockError, LockOptions, LostCause, MemoryNode, RedisNode, Redlock, ReleaseOutcome,
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
// 1. An evicting maxmemory-policy is refused at connect
// ---------------------------------------------------------------------------------

/// Fails if `connect` accepts an evicting node (the lock keys it would evict let a
/// second holder in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_node_is_refused_at_connect_unless_accepted() {
    for policy in ["allkeys-lru", "volatile-ttl"] {
        let server = RedisServer::builder()
            .arg("--maxmemory", "64mb")
            .arg("--maxmemory-policy", policy)
            .start();
        let error = Redlock::connect([server.url()], LockOptions::default())
            .await
            .expect_err("an evicting node was accepted");
        let message = error.to_string();
        for expected in [
            policy,
            "noeviction",
            "accept_evicting_nodes",
            &server.addr().to_string(),
        ] {
            assert!(message.contains(expected), "{message} (missing {expected})");
        }
        // Accepted on request: it then shows (and is logged) as a risk.
        let locker = Redlock::connect(
            [server.url()],
            LockOptions::default().accept_evicting_nodes(true),
        )
        .await
        .unwrap();
        let warning = locker.node_states()[0].setup_warning.clone();
        assert!(warning.is_some_and(|w| w.contains(policy)));
        locker.try_acquire("ops:evicting").await.unwrap();
    }
}

/// The periodic check finds a policy changed after connect, and sees it fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_changed_later_is_found_by_the_periodic_check() {
    let server = RedisServer::start();
    let options = LockOptions::default().setup_check_interval(Duration::from_millis(100));
    let locker = Redlock::connect([server.url()], options).await.unwrap();
    assert_eq!(locker.node_states()[0].setup_warning, None);
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lfu"]);
    eventually("the periodic check finds the policy", LIMIT, || {
        locker.node_states()[0]
            .setup_warning
            .as_deref()
            .is_some_and(|w| w.contains("allkeys-lfu"))
    })
    .await;
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    eventually("the periodic check sees it fixed", LIMIT, || {
        locker.node_states()[0].setup_warning.is_none()
    })
    .await;
}

// ---------------------------------------------------------------------------------
// 2. A replica is refused at connect
// ---------------------------------------------------------------------------------

/// Fails if `connect` accepts a replica, on which every acquisition fails with
/// `READONLY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_refused_at_connect() {
    let master = RedisServer::start();
    let replica = RedisServer::builder()
        .arg("--replicaof", format!("127.0.0.1 {}", master.port()))
        .start();
    let error = Redlock::connect([master.url(), replica.url()], LockOptions::default())
        .await
        .expect_err("a replica was accepted");
    let message = error.to_string();
    assert!(message.contains("replica"), "{message}");
    assert!(
        message.starts_with("invalid lock configuration: node 1"),
        "{message}"
    );
    assert!(message.contains(&replica.addr().to_string()), "{message}");
    Redlock::connect([master.url()], LockOptions::default())
        .await
        .unwrap();
}

/// What replay's records survive depends on persistence: a server reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_reports_whether_it_persists_its_keys() {
    let volatile = RedisServer::start();
    let aof = RedisServer::builder().appendonly(true).start();
    let rdb = RedisServer::builder().save_schedule("3600 1").start();
    let probe = ResourceKeys {
        lock: "redlock:{probe}".into(),
        fence: "redlock:{probe}:fence".into(),
        channel: "redlock:{probe}:released".into(),
    };
    for (server, persists) in [(&volatile, false), (&aof, true), (&rdb, true)] {
        let node = RedisNode::open(server.url().as_str()).unwrap();
        let setups = node.server_setup(&probe).await.unwrap();
        assert_eq!(setups[0].persists, Some(persists), "{setups:?}");
    }
}

// ---------------------------------------------------------------------------------
// 3. A restricted ACL user
// ---------------------------------------------------------------------------------

/// Creates ACL user `name` (password `pw`) with `rules` and returns its URL.
fn acl_user(server: &RedisServer, name: &str, rules: &[&str]) -> String {
    let mut args = vec!["ACL", "SETUSER", name, "reset", "on", ">pw"];
    args.extend_from_slice(rules);
    server.cmd(&args);
    format!("redis://{name}:pw@127.0.0.1:{}/0", server.port())
}

/// Redis 7's default for a new user has no channel permission: the release pops the
/// queued waiter and its `PUBLISH` is refused (`NOPERM`). Fails if that stops the
/// script before the key is deleted (the release then answers `Unconfirmed` and the
/// key stays its ttl).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_deletes_the_key_when_the_wake_up_is_refused() {
    let server = RedisServer::start();
    let url = acl_user(&server, "nochannels", &["~redlock:*", "+@all"]);
    let locker = Redlock::connect([url], LockOptions::default())
        .await
        .expect("a user without channels is accepted (waiters poll)");
    let warning = locker.node_states()[0].setup_warning.clone();
    assert!(
        warning.as_deref().is_some_and(|w| w.contains("&redlock:*")),
        "{warning:?}"
    );
    let lease = locker.try_acquire("ops:acl").await.unwrap();
    // Another process's waiter, queued on the server.
    server.cmd(&["ZADD", "redlock:{ops:acl}:queue", "1", "a-waiter"]);
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    assert!(!server.exists("redlock:{ops:acl}"));
    locker.try_acquire("ops:acl").await.unwrap();
}

/// A waiter of a user without channels still gets the lock when it is released: it
/// finds it free by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channels_a_waiter_finds_the_lock_by_polling() {
    let server = RedisServer::start();
    let url = acl_user(&server, "nochannels", &["~redlock:*", "+@all"]);
    let holder = Redlock::connect([url.clone()], LockOptions::default())
        .await
        .unwrap();
    let waiter = Redlock::connect([url], LockOptions::default())
        .await
        .unwrap();
    let lease = holder.try_acquire("ops:acl-wait").await.unwrap();
    let waiting = tokio::spawn(async move { waiter.acquire("ops:acl-wait", LIMIT).await });
    eventually("the waiter queues", LIMIT, || {
        server.exists("redlock:{ops:acl-wait}:queue")
    })
    .await;
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    let won = waiting.await.unwrap().expect("the waiter got the lock");
    assert_eq!(won.release().await, ReleaseOutcome::Released);
}

/// Fails if `connect` accepts a user on which every acquisition would fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_the_scripts_or_the_keys_is_refused_at_connect() {
    let server = RedisServer::start();
    for (user, rules, missing) in [
        (
            "noscripts",
            &["~redlock:*", "&*", "+@all", "-evalsha"][..],
            "+evalsha",
        ),
        (
            "noeval",
            &["~redlock:*", "&*", "+@all", "-eval"][..],
            "+eval",
        ),
        ("otherkeys", &["~other:*", "&*", "+@all"][..], "~redlock:*"),
    ] {
        let url = acl_user(&server, user, rules);
        let error = Redlock::connect([url], LockOptions::default())
            .await
            .expect_err(user);
        let message = error.to_string();
        assert!(message.contains(missing), "{user}: {message}");
        assert!(message.contains("ACL SETUSER"), "{user}: {message}");
    }
}

/// Fails if `connect` accepts a server on which a command the locker sends is renamed
/// or removed (`rename-command`, as managed services and hardening guides do): every
/// acquisition would then fail with "unknown command".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_a_needed_command_is_refused_at_connect() {
    for (command, renamed) in [("EVALSHA", ""), ("PEXPIRE", "pexpire-hidden"), ("EVAL", "")] {
        let server = RedisServer::builder()
            .raw_args(["--rename-command", command, renamed])
            .start();
        let error = Redlock::connect([server.url()], LockOptions::default())
            .await
            .expect_err(command);
        let message = error.to_string();
        assert!(
            message.contains(&format!("no command {command}")),
            "{message}"
        );
        assert!(message.contains("rename-command"), "{message}");
    }
    // A user that may not ask `COMMAND INFO`: the probes' "unknown command" tell.
    let server = RedisServer::builder()
        .raw_args(["--rename-command", "EVALSHA", ""])
        .start();
    let url = acl_user(&server, "nocommand", &["~*", "&*", "+@all", "-command"]);
    let error = Redlock::connect([url], LockOptions::default())
        .await
        .expect_err("a user without COMMAND");
    assert!(error.to_string().contains("no command EVALSHA"), "{error}");
}

// ---------------------------------------------------------------------------------
// 4. No option value can stop the watchdog; a failed renewal task loses its leases
// ---------------------------------------------------------------------------------

/// Fails (no renewal comes) if `acquired_at + Duration::MAX` panics the renewal task
/// at the lease's first renewal.
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

/// Fails if the panic leaves the lease counted as held (`lost()` never resolves) or
/// leaves no scheduler for later leases (the second is never renewed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_task_loses_its_leases_and_renewal_restarts() {
    let server = RedisServer::start();
    let fail = Arc::new(AtomicBool::new(true));
    // A custom node with a bug, inside the renewal task: it panics in `extend` while
    // `fail` is set.
    let node = Forwarding::new(RedisNode::open(server.url().as_str()).unwrap()).before({
        let fail = fail.clone();
        move |call| {
            assert!(
                call != Call::Extend || !fail.load(Ordering::SeqCst),
                "a node bug in extend (expected by the test)"
            )
        }
    });
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

/// Fails if `extend` renews the lease past `max_hold`.
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

/// `wait_timeout_ms` at its upper extreme on a server with a replica. Fails if a `WAIT`
/// timeout Redis refuses ("timeout is out of range") is sent: no grant would count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeouts_at_their_extremes_work() {
    let master = RedisServer::builder()
        .arg("--repl-diskless-sync-delay", "0")
        .start();
    let replica = RedisServer::builder()
        .arg("--replicaof", format!("127.0.0.1 {}", master.port()))
        .start();
    eventually("the replica is in sync", LIMIT, || {
        master
            .info_field("replication", "connected_slaves")
            .is_some_and(|n| n == "1")
            && replica
                .info_field("replication", "master_link_status")
                .is_some_and(|s| s == "up")
    })
    .await;
    // (0 is sent as 1 ms, too short for an acknowledgement to count on.)
    for ms in ["1000", &u64::MAX.to_string()] {
        let url = format!("{}?wait_replicas=1&wait_timeout_ms={ms}", master.url());
        let options = LockOptions::default().node_timeout(Duration::from_millis(500));
        let locker = Redlock::connect([url], options).await.unwrap();
        // A replica that just synced acknowledges its first writes late (up to a
        // second): a grant must come, not necessarily the first attempt's.
        let lease = Arc::new(std::sync::Mutex::new(None));
        support::eventually_async(&format!("a grant with wait_timeout_ms={ms}"), LIMIT, || {
            let (locker, lease) = (locker.clone(), lease.clone());
            async move {
                match locker.try_acquire("ops:wait").await {
                    Ok(granted) => {
                        *lease.lock().unwrap() = Some(granted);
                        true
                    }
                    Err(_) => false,
                }
            }
        })
        .await;
        let lease = lease.lock().unwrap().take().unwrap();
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
    }
}

// ---------------------------------------------------------------------------------
// 6. Extreme option values fail with a ConfigError naming the option, or work
// ---------------------------------------------------------------------------------

/// Fails (panics) if `Redlock::new` adds these durations unchecked.
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

    /// The settings of a `LockLayer` with `Replay`, each at an edge or anywhere.
    #[cfg(feature = "axum")]
    #[derive(Debug, Clone)]
    struct LayerSettings {
        retention: Duration,
        unknown: Option<Duration>,
        max_body: usize,
        max_request_body: usize,
        max_key_len: usize,
        queue_limit: usize,
        wait: Option<Duration>,
        hold_through_body: bool,
    }

    #[cfg(feature = "axum")]
    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![Just(0), Just(1), Just(usize::MAX), any::<usize>()]
    }

    #[cfg(feature = "axum")]
    fn layer_settings() -> impl Strategy<Value = LayerSettings> {
        (
            duration(),
            proptest::option::of(duration()),
            size(),
            size(),
            size(),
            size(),
            proptest::option::of(duration()),
            any::<bool>(),
        )
            .prop_map(
                |(
                    retention,
                    unknown,
                    max_body,
                    max_request_body,
                    max_key_len,
                    queue_limit,
                    wait,
                    hold_through_body,
                )| {
                    LayerSettings {
                        retention,
                        unknown,
                        max_body,
                        max_request_body,
                        max_key_len,
                        queue_limit,
                        wait,
                        hold_through_body,
                    }
                },
            )
    }

    /// Two requests with one key through a layer with `settings` on a memory node: each
    /// is answered by the handler, the replay or a problem of the layer, never with a
    /// panic nor a 5xx.
    #[cfg(feature = "axum")]
    fn answers_requests(settings: LayerSettings) -> Result<(), TestCaseError> {
        use axum::{body::Body, routing::post, Router};
        use http::{Request, StatusCode};
        use tower::ServiceExt;
        use tower_redlock::http::{
            key::header,
            replay::{Replay, UnknownOutcome},
            Contention, LockLayer,
        };

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async move {
            let replay = Replay::global()
                .retention(settings.retention)
                .unknown_outcome(match settings.unknown {
                    Some(after) => UnknownOutcome::ReexecuteAfter(after),
                    None => UnknownOutcome::Refuse,
                })
                .max_body(settings.max_body)
                .max_request_body(settings.max_request_body);
            let contention = match settings.wait {
                Some(timeout) => Contention::Wait { timeout },
                None => Contention::Reject,
            };
            let layer = LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
                .contention(contention)
                .max_key_len(settings.max_key_len)
                .queue_limit(settings.queue_limit)
                .hold_through_body(settings.hold_through_body)
                .replay(replay);
            let app = Router::new()
                .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
                .route_layer(layer);
            for _ in 0..2 {
                let request = Request::post("/pay")
                    .header("Idempotency-Key", "k-1")
                    .body(Body::from("{}"))
                    .unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                prop_assert!(
                    !response.status().is_server_error(),
                    "{:?}",
                    response.status()
                );
            }
            Ok(())
        })
    }

    #[cfg(feature = "axum")]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn every_layer_and_replay_setting_answers_requests(settings in layer_settings()) {
            answers_requests(settings)?;
        }
    }
}

/// `LockLayer` and `Replay` setters at their extremes, on a Redis node: every request
/// gets an answer of the layer (no panic, no 503 from a value Redis refuses). Fails
/// if `Replay::retention(Duration::MAX)` reaches the nodes as it is: Redis refuses the
/// record's expiry (503) and a `MemoryNode` panics.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_and_replay_settings_at_their_extremes_answer_requests() {
    use axum::{body::Body, routing::post, Router};
    use http::{Request, StatusCode};
    use tower::ServiceExt;
    use tower_redlock::http::{
        key::header,
        replay::{Replay, UnknownOutcome},
        Contention, LockLayer,
    };

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
                let replay = Replay::global()
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

// ---------------------------------------------------------------------------------
// 8. A set release hands off to a waiter queued on a member
// ---------------------------------------------------------------------------------

/// A set release hands member `setx` to the single waiter queued on it, which is woken
/// (not found by its timer). Fails if the set release only deletes the member: the key
/// is then missing right after the release, and the waiter's `wakeups` stays 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_release_hands_a_member_to_its_single_waiter() {
    let server = RedisServer::start();
    let holder = Redlock::from_urls([server.url()], LockOptions::default()).unwrap();
    // Its timer never fires within the test: only a wake-up gets it the lock in time.
    let patient =
        LockOptions::default().retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(60));
    let waiter = Redlock::from_urls([server.url()], patient).unwrap();
    let set = holder.try_acquire_all(["setx", "sety"]).await.unwrap();
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.acquire("setx", LIMIT).await })
    };
    eventually("the waiter queues on the member", LIMIT, || {
        server.exists("redlock:{setx}:queue")
    })
    .await;
    assert_eq!(set.release().await, ReleaseOutcome::Released);
    // Reserved for the waiter (`~id:ticket`), or already its own.
    assert!(
        server.get("redlock:{setx}").is_some(),
        "the member was not handed over"
    );
    assert!(!server.exists("redlock:{sety}"));
    let lease = waiting.await.unwrap().unwrap();
    assert!(waiter.metrics().wakeups >= 1, "{:?}", waiter.metrics());
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

/// The same on memory nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_release_hands_a_member_to_its_single_waiter_on_memory_nodes() {
    let node = MemoryNode::new();
    let holder = Redlock::new([node.clone()], LockOptions::default()).unwrap();
    let patient =
        LockOptions::default().retry_policy(|_: u32, _: Option<Duration>| Duration::from_secs(60));
    let waiter = Redlock::new([node.clone()], patient).unwrap();
    let set = holder.try_acquire_all(["setx", "sety"]).await.unwrap();
    let contended = waiter.metrics().contended;
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.acquire("setx", LIMIT).await })
    };
    // Two attempts found it held: the waiter is subscribed, queued and sleeping.
    eventually("the waiter sleeps", LIMIT, || {
        waiter.metrics().contended >= contended + 2
    })
    .await;
    assert_eq!(set.release().await, ReleaseOutcome::Released);
    assert!(
        node.get("redlock:{setx}").is_some(),
        "the member was not handed over"
    );
    let lease = waiting.await.unwrap().unwrap();
    assert!(waiter.metrics().wakeups >= 1, "{:?}", waiter.metrics());
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

// ---------------------------------------------------------------------------------
// 9. MemoryNode's wake-up channels go when nobody listens
// ---------------------------------------------------------------------------------

/// Fails (times out) if a waiter's channel outlives its listener: 64 would stay here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_node_channels_go_when_nobody_listens() {
    let node = MemoryNode::new();
    let holder = Redlock::new([node.clone()], LockOptions::default()).unwrap();
    let waiter = Redlock::new([node.clone()], LockOptions::default()).unwrap();
    for i in 0..64 {
        let resource = format!("chan-{i}");
        let lease = holder.try_acquire(resource.as_str()).await.unwrap();
        let contended = waiter.metrics().contended;
        let waiting = {
            let waiter = waiter.clone();
            let resource = resource.clone();
            tokio::spawn(async move { waiter.acquire(resource.as_str(), LIMIT).await })
        };
        eventually("the waiter sleeps", LIMIT, || {
            waiter.metrics().contended >= contended + 2
        })
        .await;
        assert!(node.channels() >= 1);
        lease.release().await;
        waiting.await.unwrap().unwrap().release().await;
    }
    // The waiter keeps its subscriptions a moment for a next wait (the locker's
    // `LINGER`), then lets them go: nobody listens any more.
    eventually("the channels go with their listeners", LIMIT, || {
        node.channels() == 0
    })
    .await;
}

// ---------------------------------------------------------------------------------
// 7. Replay keeps the representation headers with the stored bytes
// ---------------------------------------------------------------------------------

/// A gzip response replayed from Redis keeps `Content-Encoding` (and
/// `Content-Language`) without being named in `allow_header`. Fails if the compressed
/// bytes are replayed without the header.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_the_headers_that_give_the_body_its_meaning() {
    use axum::{body::Body, routing::post, Router};
    use http::header::{CONTENT_ENCODING, CONTENT_LANGUAGE};
    use http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_redlock::http::{
        key::header,
        replay::{Replay, IDEMPOTENT_REPLAYED},
        LockLayer,
    };

    // The gzip member of an empty body: bytes that mean nothing without the header.
    const GZIP: &[u8] =
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00";
    let server = RedisServer::start();
    let locker = Redlock::connect([server.url()], LockOptions::default())
        .await
        .unwrap();
    let app = Router::new()
        .route(
            "/report",
            post(|| async {
                (
                    StatusCode::CREATED,
                    [(CONTENT_ENCODING, "gzip"), (CONTENT_LANGUAGE, "de")],
                    GZIP,
                )
            }),
        )
        .route_layer(LockLayer::new(locker, header("Idempotency-Key")).replay(Replay::global()));
    let request = || {
        Request::post("/report")
            .header("Idempotency-Key", "gz-1")
            .body(Body::empty())
            .unwrap()
    };
    let first = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = app.oneshot(request()).await.unwrap();
    assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(
        again.headers().get(CONTENT_ENCODING).map(|v| v.as_bytes()),
        Some(&b"gzip"[..])
    );
    assert_eq!(
        again.headers().get(CONTENT_LANGUAGE).map(|v| v.as_bytes()),
        Some(&b"de"[..])
    );
    let body = again.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], GZIP);
}
