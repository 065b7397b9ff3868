//! The batching of concurrent callers' commands on a Redis node's connection (under the
//! multi-thread runtime): every caller gets its own replies, a cancelled caller's
//! commands are not sent unless they already were, and a caller cancelled while others
//! wait on its batch leaves them their replies.
//!
//! Deterministic without sleeps: the server is paused (SIGSTOP) so that a first batch
//! stays in flight; a caller that then finds no batch open leads the next one and yields
//! once before sending it, and a caller polled meanwhile joins it.
use crate::support;

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use support::node_calls::{self, owners};
use support::RedisServer;
use tokio::sync::oneshot;
use tower_redlock::node::{Acquire, Hold, NodeFuture, Owner, Release, ResourceKeys, Vote};
use tower_redlock::{node::Node, LockMode, RedisNode};

/// The least fence value of a fenced call.
const FLOOR: u64 = 1 << 20;

/// Only a hang runs into it.
const HANG: Duration = Duration::from_secs(20);

struct Call {
    keys: ResourceKeys,
    owner: Owner,
}

fn keys(name: &str) -> ResourceKeys {
    node_calls::keys(format!("batches:{{{name}}}"))
}

impl Call {
    /// Owner index 1; rivals take 2.
    async fn new(name: &str) -> Call {
        Call {
            keys: keys(name),
            owner: owners().await.for_node(1),
        }
    }

    fn acquire(&self, node: &RedisNode, fencing: bool) -> NodeFuture<Vote> {
        node.acquire(&Acquire {
            keys: std::slice::from_ref(&self.keys),
            owner: &self.owner,
            mode: LockMode::Exclusive,
            ttl: Duration::from_secs(60),
            fence_ttl: Duration::from_secs(600),
            fencing,
            fence_floor: if fencing { FLOOR } else { 0 },
            seed_only_when_missing: false,
            waiter: None,
        })
    }

    fn release(&self, node: &RedisNode) -> NodeFuture<bool> {
        let hold = Hold {
            keys: std::slice::from_ref(&self.keys),
            owner: &self.owner,
            mode: LockMode::Exclusive,
        };
        node.release(&hold, Release::Wake)
    }

    fn owner(&self) -> String {
        self.owner.as_str().to_owned()
    }
}

/// Polls `call` once, from the calling task.
async fn poll_once<T>(call: &mut NodeFuture<T>) -> Poll<Result<T, tower_redlock::NodeError>> {
    poll_fn(|cx| Poll::Ready(Pin::new(&mut *call).poll(cx))).await
}

/// The call's reply. The hang guard is checked before the call is polled again (a
/// timeout that polled it first would drive a call nobody woke).
async fn finish<T>(call: NodeFuture<T>) -> T {
    tokio::select! {
        biased;
        () = tokio::time::sleep(HANG) => panic!("a batched call never finished"),
        reply = call => reply.expect("the node answered"),
    }
}

fn acquired(reply: Vote) -> bool {
    matches!(reply, Vote::Granted { .. })
}

/// A node connected to a paused server, with one call in flight; and that call.
async fn one_batch_in_flight(server: &mut RedisServer) -> (RedisNode, Call, NodeFuture<Vote>) {
    let node = RedisNode::open(server.url()).unwrap();
    // Connect first, so that a call's first poll hands it to the connection.
    let warm_up = Call::new("warm-up").await;
    assert!(acquired(finish(warm_up.acquire(&node, false)).await));
    server.pause();
    let first = Call::new("first").await;
    let mut in_flight = first.acquire(&node, false);
    assert!(poll_once(&mut in_flight).await.is_pending());
    (node, first, in_flight)
}

/// A paused server, a node that has not connected to it yet, and `count` callers that
/// contend for resource `name`, each with an owner value of its own.
async fn before_the_first_connection(
    name: &str,
    count: usize,
) -> (RedisServer, RedisNode, Vec<Call>) {
    let mut server = RedisServer::start();
    // Paused before the node's first command: nothing the server would answer (the
    // connection's set-up, the commands) is answered until it resumes.
    server.pause();
    let node = RedisNode::open(server.url()).unwrap();
    let owner = owners().await;
    let contenders = (0..count)
        .map(|i| Call {
            keys: keys(name),
            owner: owner.for_node(i),
        })
        .collect();
    (server, node, contenders)
}

/// Callers that find the node's connection not made yet (a new node's first callers, or
/// those that come while it reconnects) wait for it in line, and their commands reach
/// the server in the order they came, as on a connection already made. Here each of
/// them acquires the same key: the first to come must be the one granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_waiting_for_the_connection_are_sent_in_the_order_they_came() {
    let (mut server, node, contenders) = before_the_first_connection("first-come", 16).await;
    let mut calls = Vec::new();
    for contender in &contenders {
        let mut call = contender.acquire(&node, false);
        assert!(poll_once(&mut call).await.is_pending());
        // In a task of its own from now on, as each request's call would be.
        calls.push(tokio::spawn(finish(call)));
    }
    server.resume();
    let mut granted = Vec::new();
    for call in calls {
        granted.push(acquired(call.await.unwrap()));
    }
    assert_eq!(
        server.get(&contenders[0].keys.lock),
        Some(contenders[0].owner()),
        "granted, in the order they came: {granted:?}"
    );
    assert_eq!(granted.iter().filter(|g| **g).count(), 1);
}

/// A caller dropped while its command waits for the connection takes the command back:
/// it is never sent, and the callers after it keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_while_waiting_for_the_connection_is_never_sent() {
    let (mut server, node, contenders) = before_the_first_connection("taken-back", 2).await;
    let (dropped, next) = (&contenders[0], &contenders[1]);
    let mut dropped_call = dropped.acquire(&node, false);
    assert!(poll_once(&mut dropped_call).await.is_pending());
    let mut next_call = next.acquire(&node, false);
    assert!(poll_once(&mut next_call).await.is_pending());
    drop(dropped_call);
    server.resume();
    assert!(acquired(finish(next_call).await));
    assert_eq!(server.get(&next.keys.lock), Some(next.owner()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_before_sending_sends_the_others_commands_not_its_own() {
    let mut server = RedisServer::start();
    let (node, first, in_flight) = one_batch_in_flight(&mut server).await;
    let (leader, joined) = (Call::new("leader").await, Call::new("joined").await);
    let mut leading = leader.acquire(&node, false);
    // A batch is in flight: the leader yields before sending its own.
    assert!(poll_once(&mut leading).await.is_pending());
    let mut joining = joined.acquire(&node, false);
    assert!(poll_once(&mut joining).await.is_pending());
    drop(leading);
    server.resume();
    assert!(acquired(finish(joining).await));
    assert!(acquired(finish(in_flight).await));
    assert_eq!(server.get(&joined.keys.lock), Some(joined.owner()));
    assert_eq!(server.get(&first.keys.lock), Some(first.owner()));
    // Served after the joined call's batch: it would have run by now.
    assert_eq!(
        server.get(&leader.keys.lock),
        None,
        "a dropped call was sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_before_its_batch_is_sent_is_never_sent() {
    let mut server = RedisServer::start();
    let (node, _first, in_flight) = one_batch_in_flight(&mut server).await;
    let (leader, dropped) = (Call::new("leader").await, Call::new("dropped").await);
    let mut leading = leader.acquire(&node, true);
    assert!(poll_once(&mut leading).await.is_pending());
    let mut joining = dropped.acquire(&node, true);
    assert!(poll_once(&mut joining).await.is_pending());
    drop(joining);
    server.resume();
    assert!(acquired(finish(leading).await));
    assert!(acquired(finish(in_flight).await));
    assert_eq!(server.get(&leader.keys.lock), Some(leader.owner()));
    assert_eq!(
        server.get(&dropped.keys.lock),
        None,
        "a dropped call was sent"
    );
    assert!(!server.exists(&dropped.keys.fence));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_after_sending_leaves_the_others_their_replies() {
    let mut server = RedisServer::start();
    let (node, _first, in_flight) = one_batch_in_flight(&mut server).await;
    let (leader, joined) = (Call::new("leader").await, Call::new("joined").await);
    let mut leading = leader.acquire(&node, true);
    assert!(poll_once(&mut leading).await.is_pending());
    let mut joining = joined.acquire(&node, true);
    assert!(poll_once(&mut joining).await.is_pending());
    // Sends both.
    assert!(poll_once(&mut leading).await.is_pending());
    drop(leading);
    server.resume();
    assert!(acquired(finish(joining).await));
    assert!(acquired(finish(in_flight).await));
    // Sent before it was dropped: it ran.
    assert_eq!(server.get(&leader.keys.lock), Some(leader.owner()));
    assert_eq!(server.get(&joined.keys.lock), Some(joined.owner()));
}

/// A batch goes out as soon as 16 callers joined, without waiting for its leader: the
/// leader's own command, given before the batch filled, runs although the leader is
/// then dropped before it could send (unlike a batch that did not fill, above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_goes_out_without_its_leader() {
    let mut server = RedisServer::start();
    let (node, _first, in_flight) = one_batch_in_flight(&mut server).await;
    let leader = Call::new("leader").await;
    let mut leading = leader.acquire(&node, false);
    assert!(poll_once(&mut leading).await.is_pending());
    let mut joined = Vec::new();
    for i in 0..15 {
        let call = Call::new(&format!("joined:{i}")).await;
        let mut joining = call.acquire(&node, false);
        assert!(poll_once(&mut joining).await.is_pending());
        joined.push((call, joining));
    }
    drop(leading);
    server.resume();
    for (call, joining) in joined {
        assert!(acquired(finish(joining).await));
        assert_eq!(server.get(&call.keys.lock), Some(call.owner()));
    }
    assert!(acquired(finish(in_flight).await));
    assert_eq!(server.get(&leader.keys.lock), Some(leader.owner()));
}

/// The caller woken to collect a batch's replies is dropped before it is polled: the
/// duty passes to the next caller of the batch, which would otherwise wait forever
/// (each waits in a task of its own, woken only by the batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_while_woken_to_collect_hands_the_replies_on() {
    let mut server = RedisServer::start();
    let (node, _first, in_flight) = one_batch_in_flight(&mut server).await;
    let (leader, joined) = (Call::new("leader").await, Call::new("joined").await);
    let mut leading = leader.acquire(&node, false);
    assert!(poll_once(&mut leading).await.is_pending());
    let mut joining = joined.acquire(&node, false);
    assert!(poll_once(&mut joining).await.is_pending());
    let (sent_tx, sent) = oneshot::channel();
    let (woken_tx, woken) = oneshot::channel();
    let (drop_tx, drop_rx) = oneshot::channel::<()>();
    // The leader's task sends the batch (the leader, first of its callers, is the one
    // to be woken), then waits for that wake without polling the call again.
    let holder = tokio::spawn(async move {
        assert!(poll_once(&mut leading).await.is_pending());
        sent_tx.send(()).unwrap();
        let mut waited = false;
        poll_fn(|_| {
            if waited {
                return Poll::Ready(());
            }
            waited = true;
            Poll::Pending
        })
        .await;
        woken_tx.send(()).unwrap();
        drop_rx.await.unwrap();
        drop(leading);
    });
    sent.await.unwrap();
    let (waiting_tx, waiting) = oneshot::channel();
    let other = tokio::spawn(async move {
        assert!(poll_once(&mut joining).await.is_pending());
        waiting_tx.send(()).unwrap();
        finish(joining).await
    });
    waiting.await.unwrap();
    server.resume();
    tokio::time::timeout(HANG, woken)
        .await
        .expect("the first caller was never woken")
        .unwrap();
    drop_tx.send(()).unwrap();
    holder.await.unwrap();
    assert!(acquired(other.await.unwrap()));
    assert!(acquired(finish(in_flight).await));
    assert_eq!(server.get(&joined.keys.lock), Some(joined.owner()));
}

/// 64 tasks, each acquiring its own key, finding it held when acquiring it again under
/// another owner, releasing it, and finding nothing to release the second time: a reply
/// handed to the wrong caller fails one of the four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_caller_gets_its_own_replies_under_load() {
    let server = RedisServer::start();
    let node = Arc::new(RedisNode::open(server.url()).unwrap());
    for fencing in [false, true] {
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let node = node.clone();
                tokio::spawn(async move {
                    for i in 0..50 {
                        let call = Call::new(&format!("load:{fencing}:{t}:{i}")).await;
                        let Vote::Granted { fences } = finish(call.acquire(&node, fencing)).await
                        else {
                            panic!("task {t}: a fresh key was held");
                        };
                        let fence = fences[0];
                        assert_eq!(fence >= FLOOR, fencing, "task {t}: fence {fence}");
                        let rival = Call {
                            keys: call.keys.clone(),
                            owner: call.owner.for_node(2),
                        };
                        let reply = finish(rival.acquire(&node, fencing)).await;
                        assert!(!acquired(reply), "task {t}: a held key was granted");
                        assert!(finish(call.release(&node)).await);
                        assert!(!finish(call.release(&node)).await);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    }
}
