//! Node reliability against real `redis-server` processes (issue 19, items 1 and 2):
//! the first request after nodes restart succeeds, and a node going down (and coming
//! back) is logged once per change and readable from the locker.
//!
//! Every server is spawned by `support` on a free 127.0.0.1 port. No test sleeps to
//! synchronise: a restart returns once the server accepts connections, and every
//! check follows an operation whose answers were all awaited.
use crate::support;

use std::cell::Cell;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use support::RedisServer;
use tower_redlock::{LockOptions, NodeError, NodeStatus, Redlock, ReleaseOutcome};
use tracing_subscriber::fmt::MakeWriter;

/// Per-node timeout: generous, so a machine busy compiling cannot turn a slow answer
/// into a failed vote. Dead nodes refuse at once; no timeout is expected to fire.
const PATIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the nodes stay down in [`first_acquire_after_nodes_come_back`].
const IDLE_WHILE_DOWN: Duration = Duration::from_millis(500);

fn locker(servers: &[RedisServer]) -> Redlock {
    Redlock::from_urls(
        servers.iter().map(RedisServer::url),
        LockOptions::default().node_timeout(PATIENT_TIMEOUT),
    )
    .unwrap()
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

/// One acquisition that every node answers: the release round waits for each node, so
/// afterwards every node's connection has been used.
async fn use_every_node(locker: &Redlock, servers: &[RedisServer], resource: &str) {
    let lease = locker.try_acquire(resource).await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    for server in servers.iter().filter(|s| s.is_running()) {
        assert!(!server.exists(&lock_key(resource)));
    }
}

/// Restarts `restarted` of the servers of an idle locker whose connections are open,
/// then checks that the very first acquisition succeeds and reached every node.
async fn first_acquire_after_restart(nodes: usize, restarted: usize) {
    let mut servers = RedisServer::start_many(nodes);
    let locker = locker(&servers);
    // Every connection open, then idle.
    use_every_node(&locker, &servers, "warm").await;

    for server in servers.iter_mut().take(restarted) {
        // Returns once the new process accepts connections: the event awaited.
        server.restart();
    }

    let lease = locker
        .try_acquire("first")
        .await
        .expect("the first acquisition after the restart");
    // The restarted nodes voted too (not only the untouched ones): their broken
    // connections were re-established and the command sent again.
    // The nodes that granted it hold the key (their answers arrived).
    let key = lock_key("first");
    // Node `i` stores the lease's value for node `i`.
    let holders = servers
        .iter()
        .enumerate()
        .filter(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(*i).as_str()))
        .count();
    assert!(holders >= locker.quorum(), "{holders} nodes hold the key");
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_two_of_three_nodes_restart_succeeds() {
    first_acquire_after_restart(3, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_the_only_node_restarts_succeeds() {
    first_acquire_after_restart(1, 1).await;
}

/// Kills `killed` of the servers, lets an acquisition fail on them (their last attempt
/// to connect failed), starts them again, and checks that the very first acquisition
/// afterwards succeeds on them: a refusal from while the server was down is not taken
/// for its answer once it is back.
async fn first_acquire_after_nodes_come_back(nodes: usize, killed: usize) {
    let mut servers = RedisServer::start_many(nodes);
    let locker = locker(&servers);
    use_every_node(&locker, &servers, "warm").await;

    for server in servers.iter_mut().take(killed) {
        server.kill();
    }
    let attempt = locker.try_acquire("while-down").await;
    if killed >= locker.quorum() {
        assert!(attempt.is_err(), "no quorum while down: {attempt:?}");
    } else {
        attempt.unwrap().release().await;
    }
    // The nodes stay down a while, as in production, where they are down for minutes:
    // long enough for every attempt to connect made meanwhile to have failed. Part of
    // the scenario, not a synchronisation: no event is awaited, and a shorter wait
    // would only make the test easier.
    tokio::time::sleep(IDLE_WHILE_DOWN).await;
    for server in servers.iter_mut().take(killed) {
        server.restart();
    }

    let lease = locker
        .try_acquire("first")
        .await
        .expect("the first acquisition after the nodes came back");
    let key = lock_key("first");
    // Node `i` stores the lease's value for node `i`.
    let holders = servers
        .iter()
        .enumerate()
        .filter(|(i, s)| s.get(&key).as_deref() == Some(lease.owner_on(*i).as_str()))
        .count();
    assert!(holders >= locker.quorum(), "{holders} nodes hold the key");
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_two_of_three_nodes_come_back_succeeds() {
    first_acquire_after_nodes_come_back(3, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_the_only_node_comes_back_succeeds() {
    first_acquire_after_nodes_come_back(1, 1).await;
}

/// Connections the server accepted so far (this question's own included).
fn connections_accepted(server: &RedisServer) -> u64 {
    let total = server.info_field("stats", "total_connections_received");
    total.expect("INFO stats").parse().unwrap()
}

/// `count` acquisitions at once, each of its own resource; all must succeed.
async fn acquire_at_once(locker: &Redlock, count: usize, prefix: &str) {
    let attempts = (0..count).map(|i| {
        let locker = locker.clone();
        let resource = format!("{prefix}-{i}");
        tokio::spawn(async move {
            let lease = locker.try_acquire(&resource).await.unwrap();
            assert_eq!(lease.release().await, ReleaseOutcome::Released);
        })
    });
    for attempt in attempts.collect::<Vec<_>>() {
        attempt.await.unwrap();
    }
}

/// A node's commands share one connection: the callers that find it not made yet (the
/// first commands of a new locker) or broken (after the server restarted) wait for one
/// attempt to connect between them, rather than each making its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_at_once_share_one_new_connection() {
    let mut servers = RedisServer::start_many(1);
    let locker = locker(&servers);
    // Each difference counts the locker's connections and the second question's.
    let before = connections_accepted(&servers[0]);
    acquire_at_once(&locker, 50, "first").await;
    assert_eq!(connections_accepted(&servers[0]) - before, 1 + 1);

    servers[0].restart();
    let before = connections_accepted(&servers[0]);
    acquire_at_once(&locker, 50, "after-restart").await;
    assert_eq!(connections_accepted(&servers[0]) - before, 1 + 1);
}

// 2. A node going down is visible ---------------------------------------------------

/// The log lines of the threads that capture (see [`capturing`]), written by a
/// `tracing_subscriber::fmt` subscriber installed once as the global default. Global,
/// not per test: tracing caches per call site whether anyone listens, and a call site
/// first reached on another test's thread would stay silent for a thread-local
/// subscriber. Only the capturing threads' lines are kept: the other tests of this
/// binary log too, and a locker of theirs may name a port that one of ours took over.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

thread_local! {
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
}

/// A multi-threaded runtime whose threads' log lines [`Logs`] keeps, like those of the
/// calling thread from now on.
fn capturing() -> tokio::runtime::Runtime {
    CAPTURING.set(true);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(|| CAPTURING.set(true))
        .build()
        .unwrap()
}

impl io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Logs {
    type Writer = Box<dyn io::Write>;

    fn make_writer(&'a self) -> Self::Writer {
        if CAPTURING.get() {
            Box::new(self.clone())
        } else {
            Box::new(io::sink())
        }
    }
}

impl Logs {
    fn get() -> &'static Logs {
        static LOGS: OnceLock<Logs> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(logs.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish();
            tracing::subscriber::set_global_default(subscriber).unwrap();
            logs
        })
    }

    /// Where the log ends now: count from here to skip earlier tests' lines.
    fn mark(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Log lines since `mark` that contain `part`.
    #[cfg(feature = "axum")]
    fn lines(&self, mark: usize, part: &str) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()[mark..]).into_owned();
        text.lines()
            .filter(|line| line.contains(part))
            .map(str::to_owned)
            .collect()
    }

    /// Log lines since `mark` that contain every one of `parts`.
    fn count(&self, mark: usize, parts: &[&str]) -> usize {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()[mark..]).into_owned();
        text.lines()
            .filter(|line| parts.iter().all(|part| line.contains(part)))
            .count()
    }
}

fn statuses(locker: &Redlock) -> Vec<NodeStatus> {
    locker.node_states().iter().map(|s| s.status).collect()
}

#[test]
fn a_node_going_down_and_back_is_readable_and_logged_once_each() {
    capturing().block_on(node_going_down_and_back());
}

async fn node_going_down_and_back() {
    let logs = Logs::get();
    let mut servers = RedisServer::start_many(3);
    // Our servers' ports are ours from here on (a port may have served another test
    // before).
    let mark = logs.mark();
    let locker = locker(&servers);
    let names: Vec<String> = locker
        .node_states()
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(names.len(), 3);
    for (name, server) in names.iter().zip(&servers) {
        assert!(name.contains(&server.port().to_string()), "{name}");
    }
    // Connections open on first use: nothing is known yet.
    assert_eq!(statuses(&locker), [NodeStatus::Unknown; 3]);
    use_every_node(&locker, &servers, "before").await;
    assert_eq!(statuses(&locker), [NodeStatus::Up; 3]);

    servers[0].kill();
    for round in 0..3 {
        // A quorum holds: every lease is still granted and released.
        use_every_node(&locker, &servers, &format!("down-{round}")).await;
        let states = locker.node_states();
        assert_eq!(states[0].status, NodeStatus::Down, "{states:?}");
        assert!(
            matches!(states[0].last_error, Some(NodeError::Connection(_))),
            "{states:?}"
        );
        assert_eq!(states[1].status, NodeStatus::Up);
        assert_eq!(states[2].status, NodeStatus::Up);
    }
    let went_down = locker.node_states()[0].since;

    servers[0].restart();
    for round in 0..3 {
        use_every_node(&locker, &servers, &format!("back-{round}")).await;
        assert_eq!(statuses(&locker), [NodeStatus::Up; 3]);
    }
    let back = &locker.node_states()[0];
    assert!(back.since > went_down);
    // The error that took it down stays readable.
    assert!(matches!(back.last_error, Some(NodeError::Connection(_))));

    // Once per change, at warn and info, naming the node; nothing about the others.
    assert_eq!(logs.count(mark, &["WARN", "node down", &names[0]]), 1);
    assert_eq!(logs.count(mark, &["INFO", "node back up", &names[0]]), 1);
    for name in &names[1..] {
        assert_eq!(logs.count(mark, &["node down", name]), 0);
        assert_eq!(logs.count(mark, &["node back up", name]), 0);
    }
}

#[cfg(feature = "axum")]
#[test]
fn a_lost_quorum_is_logged_once_with_the_refusals_not_once_per_request() {
    capturing().block_on(quorum_lost_and_back());
}

#[cfg(feature = "axum")]
async fn quorum_lost_and_back() {
    use axum::{body::Body, routing::post, Router};
    use tower::ServiceExt;
    use tower_redlock::http::{key::path_param, LockLayer};

    let logs = Logs::get();
    let mut servers = RedisServer::start_many(3);
    let mark = logs.mark();
    let locker = locker(&servers);
    let names: Vec<String> = locker
        .node_states()
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    let app = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(locker.clone(), path_param("id")));
    let job = |id: usize| {
        let request = http::Request::post(format!("/jobs/{id}"));
        request.body(Body::empty()).unwrap()
    };
    use_every_node(&locker, &servers, "before").await;

    servers[0].kill();
    servers[1].kill();
    let error = locker.try_acquire("direct").await.unwrap_err();
    // True, whether or not the third node's answer came before the round was decided.
    assert!(error.to_string().contains("2 of 3 nodes failed"), "{error}");
    for id in 0..50 {
        let response = app.clone().oneshot(job(id)).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    }
    servers[0].restart();
    servers[1].restart();
    // The nodes reconnect after their backoff: poll until requests are served and
    // every node has answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while app.clone().oneshot(job(99)).await.unwrap().status() != http::StatusCode::OK
        || statuses(&locker) != [NodeStatus::Up; 3]
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the quorum never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Three warnings in all (two nodes down, the quorum lost), then one line each for
    // what came back.
    assert_eq!(logs.count(mark, &["WARN"]), 3);
    assert_eq!(logs.count(mark, &["WARN", "quorum lost"]), 1);
    for name in &names[..2] {
        assert_eq!(logs.count(mark, &["WARN", "node down", name]), 1);
        assert_eq!(logs.count(mark, &["INFO", "node back up", name]), 1);
    }
    assert_eq!(logs.count(mark, &["INFO", "quorum regained"]), 1);
    let regained = logs.lines(mark, "quorum regained");
    let refused: usize = regained[0]
        .split("refused=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{regained:?}"));
    assert!(refused >= 51, "{regained:?}");
}

/// The round trip of one node as the engine sees it (an acquisition over one node:
/// the call, the scheduling of its answer), on this machine as it is loaded now, for
/// the default node timeout (the measurements are in its docs):
/// `cargo test --all-features --test engine reconnect::node_round_trips -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test"]
async fn node_round_trips() {
    let server = RedisServer::start();
    let locker = locker(std::slice::from_ref(&server));
    let tasks = (0..16).map(|task| {
        let locker = locker.clone();
        tokio::spawn(async move {
            let mut took = Vec::with_capacity(2000);
            for i in 0..2000 {
                let started = std::time::Instant::now();
                let lease = locker.try_acquire(format!("rt-{task}-{i}")).await.unwrap();
                took.push(started.elapsed());
                lease.release().await;
            }
            took
        })
    });
    let mut took = Vec::new();
    for task in tasks.collect::<Vec<_>>() {
        took.extend(task.await.unwrap());
    }
    took.sort();
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    println!(
        "{} round trips, 16 callers: p50 {:?}, p99 {:?}, p99.9 {:?}, p99.99 {:?}, max {:?}",
        took.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(0.9999),
        took[took.len() - 1]
    );
}

/// A frozen node (SIGSTOP) in a round of three: the round is decided by the other two,
/// the frozen node's calls run out at the round's single deadline (the acquire's as a
/// call left to finish alone, the release's inside its round), and each is recorded as
/// that node's timeout: it reads as down, with a timeout at the node's full budget.
#[tokio::test]
async fn a_frozen_node_times_out_at_the_round_deadline_and_reads_as_down() {
    let mut servers = RedisServer::start_many(3);
    let locker = Redlock::from_urls(
        servers.iter().map(RedisServer::url),
        LockOptions::default().node_timeout(Duration::from_millis(200)),
    )
    .unwrap();
    use_every_node(&locker, &servers, "warm").await;
    servers[1].pause();
    let lease = locker.try_acquire("frozen").await.unwrap();
    // The release waits for every node, the frozen one until the deadline.
    let outcome = lease.release().await;
    let states = locker.node_states();
    servers[1].resume();
    assert_eq!(outcome, ReleaseOutcome::Released, "{states:?}");
    assert_eq!(
        statuses(&locker)[..],
        [NodeStatus::Up, NodeStatus::Down, NodeStatus::Up],
        "{states:?}"
    );
    assert!(
        matches!(states[1].last_error, Some(NodeError::Timeout(budget)) if budget == Duration::from_millis(200)),
        "{states:?}"
    );
    for index in [0, 2] {
        assert!(!servers[index].exists(&lock_key("frozen")));
    }
    // Thawed, it answers again and reads as up.
    use_every_node(&locker, &servers, "thawed").await;
    assert_eq!(statuses(&locker), [NodeStatus::Up; 3]);
}
