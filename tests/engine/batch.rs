//! Batched renewal (issue 16). `Node::extend_many`: one answer per entry, in order, on
//! every node kind; one round trip to a Redis server however many keys (one script per
//! 256, pipelined); the `NOSCRIPT` fallback. The renewal scheduler: one task per
//! locker, however many leases it holds, gone once none is left; leases renewed in
//! batches, not one extend each. The calls a won round leaves behind: finished without a
//! task each. (Renewal outcomes, losses and `max_hold` are in
//! `watchdog.rs`.)
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use support::RedisServer;
use tower_redlock::node::{
    Acquire, Hold, NodeFuture, Owner, Release, ReleaseSignal, ResourceKeys, Vote,
};
use tower_redlock::NodeError;
use tower_redlock::{node::Node, Lease, LockMode, LockOptions, MemoryNode, RedisNode, Redlock};

/// Over two script chunks' worth, so the pipeline carries three scripts.
const ENTRIES: usize = 600;
const HELD_TTL: Duration = Duration::from_secs(10);
const EXTENDED_TTL: Duration = Duration::from_secs(60);

/// What the batch finds for entry `i`: our key, someone else's, or nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Found {
    Ours,
    Theirs,
    Missing,
}

fn found(i: usize) -> Found {
    match i % 3 {
        0 => Found::Ours,
        1 => Found::Theirs,
        _ => Found::Missing,
    }
}

/// Takes `ENTRIES` leases on `node` (watchdog off: only the batch extends), then
/// overwrites every second third of the keys and deletes the last third.
async fn leases_on(
    node: Arc<dyn Node>,
    overwrite: impl Fn(&str),
    delete: impl Fn(&str),
) -> Vec<Lease> {
    let locker = Redlock::from_nodes(
        vec![node],
        LockOptions::default().ttl(HELD_TTL).watchdog(false),
    )
    .unwrap();
    let mut leases = Vec::with_capacity(ENTRIES);
    for i in 0..ENTRIES {
        leases.push(locker.try_acquire(format!("r{i}")).await.unwrap());
    }
    for (i, lease) in leases.iter().enumerate() {
        let key = format!("redlock:{{{}}}", lease.resource());
        match found(i) {
            Found::Ours => {}
            Found::Theirs => overwrite(&key),
            Found::Missing => delete(&key),
        }
    }
    leases
}

fn keys_of(lease: &Lease) -> ResourceKeys {
    let lock = format!("redlock:{{{}}}", lease.resource());
    ResourceKeys {
        fence: format!("{lock}:fence"),
        channel: format!("{lock}:released"),
        lock,
    }
}

async fn extend_all(node: &dyn Node, leases: &[Lease]) -> Vec<bool> {
    let keys: Vec<_> = leases.iter().map(keys_of).collect();
    let owners: Vec<Owner> = leases.iter().map(|lease| lease.owner_on(0)).collect();
    let holds: Vec<Hold<'_>> = keys
        .iter()
        .zip(&owners)
        .map(|(keys, owner)| Hold {
            keys: std::slice::from_ref(keys),
            owner,
            mode: LockMode::Exclusive,
        })
        .collect();
    node.extend(&holds, EXTENDED_TTL)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

fn check_answers(answers: &[bool]) {
    assert_eq!(answers.len(), ENTRIES);
    for (i, &extended) in answers.iter().enumerate() {
        assert_eq!(
            extended,
            found(i) == Found::Ours,
            "entry {i} ({:?})",
            found(i)
        );
    }
}

#[tokio::test]
async fn a_redis_node_extends_many_keys_in_one_round_trip_and_answers_each() {
    let server = RedisServer::start();
    let node: Arc<dyn Node> = Arc::new(RedisNode::open(server.url()).unwrap());
    let leases = leases_on(
        node.clone(),
        |key| server.set(key, "someone else"),
        |key| {
            server.cmd(&["DEL", key]);
        },
    )
    .await;
    // A server that has not seen the script yet answers NOSCRIPT to each of the three
    // scripts (256 + 256 + 88 keys); they go out again by source.
    server.reset_stats();
    check_answers(&extend_all(&*node, &leases).await);
    assert_eq!(server.command_calls("eval"), 3);
    // From then on: three scripts by hash in one pipeline, nothing else sent.
    server.reset_stats();
    check_answers(&extend_all(&*node, &leases).await);
    assert_eq!(server.command_calls("evalsha"), 3);
    assert_eq!(server.command_calls("eval"), 0);
    assert_eq!(server.command_calls("pexpire"), (ENTRIES / 3) as u64);
    for (i, lease) in leases.iter().enumerate() {
        let key = keys_of(lease).lock;
        match found(i) {
            Found::Ours => assert!(
                server.pttl(&key) > HELD_TTL.as_millis() as i64,
                "{key} not extended"
            ),
            // Someone else's key keeps its (missing) ttl; a missing key is not re-created.
            Found::Theirs => assert_eq!(server.pttl(&key), -1, "{key} touched"),
            Found::Missing => assert!(!server.exists(&key), "{key} re-created"),
        }
    }
}

#[tokio::test]
async fn a_memory_node_extends_many_keys_and_answers_each() {
    let memory = MemoryNode::new();
    let node: Arc<dyn Node> = Arc::new(memory.clone());
    let leases = leases_on(
        node.clone(),
        |key| memory.set(key, "someone else"),
        |key| memory.delete(key),
    )
    .await;
    let answers = extend_all(&*node, &leases).await;
    check_answers(&answers);
    for (i, lease) in leases.iter().enumerate() {
        let key = keys_of(lease).lock;
        match found(i) {
            Found::Ours => assert!(memory.pttl(&key).unwrap() > HELD_TTL, "{key} not extended"),
            Found::Theirs => assert_eq!(memory.pttl(&key), None, "{key} touched"),
            Found::Missing => assert_eq!(memory.get(&key), None, "{key} re-created"),
        }
    }
}

/// A node kind without a batch of its own: one call per hold.
struct PerKey(MemoryNode);

impl Node for PerKey {
    fn name(&self) -> &str {
        "per-key"
    }
    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        self.0.acquire(request)
    }
    fn extend(
        &self,
        holds: &[Hold<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let calls: Vec<_> = holds
            .iter()
            .map(|hold| self.0.extend(std::slice::from_ref(hold), ttl))
            .collect();
        Box::pin(async move {
            let answers = futures_util::future::join_all(calls).await;
            Ok(answers
                .into_iter()
                .map(|answer| answer.and_then(|mut one| one.pop().unwrap_or(Ok(false))))
                .collect())
        })
    }
    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
        self.0.release(hold, how)
    }
    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        self.0.raise_fences(keys, tokens, fence_ttl)
    }
    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        self.0.subscribe(keys)
    }
}

#[tokio::test]
async fn the_default_batch_extends_key_by_key() {
    let memory = MemoryNode::new();
    let node: Arc<dyn Node> = Arc::new(PerKey(memory.clone()));
    let leases = leases_on(
        node.clone(),
        |key| memory.set(key, "someone else"),
        |key| memory.delete(key),
    )
    .await;
    check_answers(&extend_all(&*node, &leases).await);
    // A node that is down fails every entry of the batch, not the batch.
    memory.set_available(false);
    let keys = keys_of(&leases[0]);
    let owner = leases[0].owner_on(0);
    let holds = [Hold {
        keys: std::slice::from_ref(&keys),
        owner: &owner,
        mode: LockMode::Exclusive,
    }];
    let answers = node.extend(&holds, EXTENDED_TTL).await.unwrap();
    assert!(matches!(answers[..], [Err(_)]), "{answers:?}");
}

// ---- The renewal scheduler -----------------------------------------------------------

/// Tokio tasks alive in this test's runtime (each `#[tokio::test]` has its own).
fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_leases_share_one_renewal_task_that_ends_with_the_last_lease() {
    // A memory node has no connection tasks: every task alive is the engine's.
    let locker = Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap();
    assert_eq!(alive_tasks(), 0);
    let mut leases = Vec::new();
    for i in 0..200 {
        leases.push(locker.try_acquire(format!("one-task-{i}")).await.unwrap());
    }
    assert_eq!(alive_tasks(), 1, "one renewal task for 200 leases");
    // Dropping all but one keeps the task; releasing the last one ends it.
    let last = leases.pop().unwrap();
    drop(leases);
    assert_eq!(
        last.release().await,
        tower_redlock::ReleaseOutcome::Released
    );
    support::eventually("the renewal task ended", Duration::from_secs(15), || {
        alive_tasks() == 0
    })
    .await;
    // A new lease starts a new one.
    let again = locker.try_acquire("one-task-again").await.unwrap();
    assert_eq!(alive_tasks(), 1);
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_renew_in_batches_not_one_extend_each() {
    const LEASES: u64 = 300;
    let server = RedisServer::start();
    let locker = Redlock::from_urls(
        [server.url()],
        LockOptions::default()
            .ttl(Duration::from_millis(1500))
            .node_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    let mut leases = Vec::new();
    for i in 0..LEASES {
        leases.push(locker.try_acquire(format!("batched-{i}")).await.unwrap());
    }
    server.reset_stats();
    let renewals = locker.metrics().renewals;
    // Every lease renewed at least twice.
    support::eventually(
        "two renewals of every lease",
        Duration::from_secs(15),
        || locker.metrics().renewals >= renewals + 2 * LEASES,
    )
    .await;
    let renewed = locker.metrics().renewals - renewals;
    let scripts = server.command_calls("evalsha") + server.command_calls("eval");
    // One extend each would be one script per renewal; batches are a few per tick.
    assert!(
        scripts * 10 <= renewed,
        "{scripts} scripts for {renewed} renewals"
    );
    assert!(leases.iter().all(|lease| lease.is_held()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_counts_as_renewed_on_a_node_only_when_every_member_is() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = Redlock::new(
        nodes.clone(),
        LockOptions::default().ttl(Duration::from_millis(600)),
    )
    .unwrap();
    let set = locker.try_acquire_all(["set-a", "set-b"]).await.unwrap();
    let single = locker.try_acquire("single").await.unwrap();
    let renewals = locker.metrics().renewals;
    support::eventually("renewals of both leases", Duration::from_secs(15), || {
        locker.metrics().renewals >= renewals + 4
    })
    .await;
    // One member gone on a majority: the set is lost, though its other member is
    // still extended on every node; the single lease of the same batches goes on.
    nodes[0].delete("redlock:{set-b}");
    nodes[1].delete("redlock:{set-b}");
    let cause = tokio::time::timeout(Duration::from_secs(15), set.lost())
        .await
        .expect("the set was never reported lost");
    assert_eq!(cause, tower_redlock::LostCause::KeyLost);
    let renewals = locker.metrics().renewals;
    support::eventually(
        "renewals of the single lease",
        Duration::from_secs(15),
        || locker.metrics().renewals >= renewals + 2,
    )
    .await;
    assert!(single.is_held());
    assert_eq!(single.lost_cause(), None);
}

// ---- Calls left behind by a decided round ----------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_left_behind_by_won_rounds_cost_no_task_each() {
    let mut servers = RedisServer::start_many(3);
    let locker = Redlock::from_urls(
        servers.iter().map(RedisServer::url),
        support::patient().watchdog(false),
    )
    .unwrap();
    // Connections and scripts in place, and the driver of left-behind calls started.
    locker.try_acquire("warm").await.unwrap().release().await;
    let before = alive_tasks();
    // A paused third node: every round is won by the other two, and its call stays in
    // flight (up to the node timeout) after the acquisition returned.
    servers[2].pause();
    let mut leases = Vec::new();
    for i in 0..50 {
        leases.push(locker.try_acquire(format!("left-{i}")).await.unwrap());
    }
    let during = alive_tasks();
    servers[2].resume();
    assert!(
        during <= before + 1,
        "{before} tasks before, {during} with 50 calls left behind"
    );
    for lease in leases {
        assert_eq!(
            lease.release().await,
            tower_redlock::ReleaseOutcome::Released
        );
    }
    for server in &servers {
        assert!(
            server.keys("redlock:{left-*}").is_empty(),
            "a key left behind"
        );
    }
}
