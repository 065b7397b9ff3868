//! Fan-out to the nodes: every operation goes to all nodes at once, each bounded by
//! the per-node timeout, and the caller stops listening as soon as the outcome is
//! decided rather than waiting for the slowest node. The calls still running then
//! finish in the background (each within its timeout, in the locker's driver task:
//! see `background.rs`), so every node that can answer
//! gets every command: a lease is held, renewed and released on all healthy nodes, not
//! only on the fastest majority (redis-rs does not even send a request whose future
//! was dropped before the connection picked it up).

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;

use crate::error::{ConfigError, NodeError, NodeFailure};
use crate::lock::attempt::{Pending, Stragglers};
use crate::lock::health::{Health, NodeState};
use crate::lock::target::Target;
use crate::lock::{background::Background, metrics, LockError};
use crate::node::{Acquire, LockMode, Node, NodeFuture, Owner, PerKey, Resource, Vote, Waiter};

/// The nodes of a locker and the majority they need.
pub(crate) struct Nodes {
    pub(crate) list: Box<[Arc<dyn Node>]>,
    /// Per node, fed by every call made through [`watched`].
    pub(crate) health: Box<[Arc<Health>]>,
    quorum: usize,
    /// Whether a majority keep a wait queue ([`Capabilities::wait_queue`](crate::node::Capabilities::wait_queue)), read once when the
    /// locker is built: waiters are then served in order, else every release wakes
    /// every waiter and the retry policy's backoff applies.
    queued: bool,
    timeout: Duration,
    /// Finishes the calls no caller waits for any more.
    pub(crate) background: Background,
}

/// The per-node answers of one acquire round.
#[derive(Default)]
pub(crate) struct AcquireTally {
    /// Nodes that granted every member, with their fence counters.
    pub(crate) won: Vec<(usize, PerKey<u64>)>,
    /// Nodes on which someone else holds a member.
    pub(crate) held: Vec<usize>,
    /// The first member (in canonical order) a node found held.
    pub(crate) first_held: Option<usize>,
    /// The largest remaining ttl reported by a holder.
    pub(crate) holder_ttl: Option<Duration>,
    /// The mode of shared holders found holding it in another mode than asked.
    pub(crate) other_mode: Option<LockMode>,
    pub(crate) failures: Vec<NodeFailure>,
}

/// The per-node answers of an extend or release round.
#[derive(Default)]
pub(crate) struct OwnerTally {
    /// Nodes on which our key was still ours (and was extended or deleted).
    pub(crate) yes: usize,
    /// Nodes on which our key was gone or belonged to someone else.
    pub(crate) no: usize,
    pub(crate) failures: Vec<NodeFailure>,
}

impl OwnerTally {
    pub(crate) fn add(&mut self, answer: Result<bool, NodeError>, node: impl FnOnce() -> Arc<str>) {
        match answer {
            Ok(true) => self.yes += 1,
            Ok(false) => self.no += 1,
            Err(error) => self.failures.push(NodeFailure {
                node: node(),
                error,
            }),
        }
    }
}

impl Nodes {
    pub(crate) fn new(list: Vec<Arc<dyn Node>>, timeout: Duration) -> Self {
        let quorum = super::quorum::of(list.len());
        let health = list
            .iter()
            .map(|node| Arc::new(Health::new(node.name().into(), timeout)))
            .collect();
        let queued = list
            .iter()
            .filter(|node| node.capabilities().wait_queue)
            .count()
            >= quorum;
        Nodes {
            list: list.into_boxed_slice(),
            health,
            quorum,
            queued,
            timeout,
            background: Background::default(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    pub(crate) fn quorum(&self) -> usize {
        self.quorum
    }

    /// A locker's refusal of nodes without a capability it needs: `Ok` when every node
    /// `has` it, else `why`, naming the others.
    pub(crate) fn require(
        &self,
        has: impl Fn(&dyn Node) -> bool,
        why: &str,
    ) -> Result<(), ConfigError> {
        let missing: Vec<&str> = self
            .each()
            .filter(|node| !has(&***node))
            .map(|node| node.name())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::new(format!("{why}: {}", missing.join(", "))))
        }
    }

    pub(crate) fn queued(&self) -> bool {
        self.queued
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn each(&self) -> impl Iterator<Item = &Arc<dyn Node>> {
        self.list.iter()
    }

    pub(crate) fn name(&self, index: usize) -> Arc<str> {
        self.list[index].name().into()
    }

    /// Too few of the nodes answered for `resource`.
    pub(crate) fn unavailable(
        &self,
        resource: &Resource,
        answered: usize,
        quorum: usize,
        failures: Vec<NodeFailure>,
    ) -> LockError {
        LockError::Unavailable {
            resource: resource.clone(),
            nodes: self.len(),
            answered,
            quorum,
            failures,
        }
    }

    pub(crate) fn failure(&self, index: usize, error: NodeError) -> NodeFailure {
        NodeFailure {
            node: self.name(index),
            error,
        }
    }

    /// What the locker last saw of each node.
    pub(crate) fn states(&self) -> Vec<NodeState> {
        self.health.iter().map(|h| h.state()).collect()
    }

    /// One acquire round of `ask` on every node, started at `started` (the instant
    /// the lease's validity counts from; the calls time out a node timeout after it).
    /// Returns once a majority granted it, or once it is certain that none can and
    /// whether that is contention or failure, with the calls still in flight then.
    pub(crate) async fn acquire(
        &self,
        started: Instant,
        ask: &Acquire<'_>,
    ) -> (AcquireTally, Stragglers<Vote>) {
        let mut tally = AcquireTally {
            won: Vec::with_capacity(self.list.len()),
            ..AcquireTally::default()
        };
        let quorum = super::quorum::for_mode(self.list.len(), ask.mode);
        let mut stragglers = Stragglers::default();
        self.fan_out_keeping(
            started,
            0..self.list.len(),
            self.timeout,
            Some(&mut stragglers.calls),
            |index, node| {
                // Each node gets its own owner value (see `Owner::for_node`).
                let owner = ask.owner.for_node(index);
                node.acquire(&Acquire {
                    owner: &owner,
                    ..*ask
                })
            },
            |index, answer, pending| {
                match answer {
                    Ok(Vote::Granted { fences }) => tally.won.push((index, fences)),
                    Ok(Vote::Held { member, pttl }) => {
                        tally.held.push(index);
                        tally.holder_ttl = tally.holder_ttl.max(pttl);
                        tally.first_held = Some(tally.first_held.map_or(member, |m| m.min(member)));
                    }
                    Ok(Vote::OtherMode { held }) => {
                        tally.held.push(index);
                        tally.other_mode = Some(held);
                    }
                    Err(error) => tally.failures.push(self.failure(index, error)),
                }
                let won = tally.won.len();
                let answered = won + tally.held.len();
                // Refused without a grant: wait for every answer, as a late grant tells
                // a split vote (retried, see `Redlock::attempt`) from a holder's refusal.
                let refused_so_far = won == 0 && answered >= quorum;
                super::quorum::acquisition_decided(quorum, won, answered, pending)
                    && !(refused_so_far && pending > 0)
            },
        )
        .await;
        (tally, stragglers)
    }

    /// Raises each member's fence counter to its token on the given nodes; returns how
    /// many confirmed.
    pub(crate) async fn raise(
        &self,
        targets: Vec<usize>,
        target: &Target,
        tokens: &[u64],
        deadline: Instant,
        needed: usize,
        fence_ttl: Duration,
    ) -> (usize, Vec<NodeFailure>) {
        let mut confirmed = 0;
        let mut failures = Vec::new();
        let timeout = self
            .timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        self.fan_out(
            targets,
            timeout,
            |_, node| node.raise_fences(target.keys(), tokens, fence_ttl),
            |index, answer, pending| {
                match answer {
                    Ok(()) => confirmed += 1,
                    Err(error) => failures.push(self.failure(index, error)),
                }
                super::quorum::count_decided(needed, confirmed, pending)
            },
        )
        .await;
        (confirmed, failures)
    }

    /// One extend round: decided once a majority extended, or a majority said the key
    /// is no longer ours, or neither can happen any more. A node says yes to a set only
    /// when every member is ours.
    pub(crate) async fn extend(
        &self,
        target: &Target,
        owner: &Owner,
        ttl: Duration,
        timeout: Duration,
    ) -> OwnerTally {
        let quorum = target.quorum(self.list.len());
        self.owner_round(Some(quorum), timeout, |index, node| {
            let owner = owner.for_node(index);
            let extended = node.extend(&[target.hold(&owner)], ttl);
            Box::pin(async move {
                extended
                    .await?
                    .pop()
                    .unwrap_or_else(|| Err(NodeError::Protocol("no answer to an extend".into())))
            })
        })
        .await
    }

    /// One release round. Unlike the other rounds it waits for every node (each within
    /// the timeout), not only until the outcome is decided: whoever acquires next —
    /// often the caller itself, or the next waiter of its local queue — must not find
    /// our key on a straggler. A straggling release can even be overtaken on its own
    /// connection, e.g. when the script is reloaded after `NOSCRIPT` while the next
    /// acquire goes out; one node down then turns that leftover key into a spurious
    /// [`Held`](crate::LockError::Held).
    ///
    /// `waiter`: the lease was won by this waiter's attempt (see
    /// [`Release::AsWaiter`](crate::node::Release::AsWaiter)).
    pub(crate) async fn release(
        &self,
        target: &Target,
        owner: &Owner,
        waiter: Option<&Waiter>,
    ) -> OwnerTally {
        self.owner_round(None, self.timeout, |index, node| {
            target.release(node, &owner.for_node(index), waiter)
        })
        .await
    }

    /// A round of yes/no answers on every node: decided once either side has `quorum`
    /// or neither can reach it any more; with no quorum, once every node answered.
    async fn owner_round(
        &self,
        quorum: Option<usize>,
        timeout: Duration,
        call: impl FnMut(usize, &dyn Node) -> NodeFuture<bool>,
    ) -> OwnerTally {
        let mut tally = OwnerTally::default();
        self.fan_out(
            0..self.list.len(),
            timeout,
            call,
            |index, answer, pending| {
                tally.add(answer, || self.name(index));
                quorum
                    .is_some_and(|q| super::quorum::tally_decided(q, tally.yes, tally.no, pending))
            },
        )
        .await;
        tally
    }

    /// Calls `call` on the `targets` concurrently and feeds every answer to `decided`
    /// (with the number of calls still pending) until it returns `true`; the calls
    /// still pending then finish in the background.
    pub(crate) async fn fan_out<T: Send + 'static>(
        &self,
        targets: impl IntoIterator<Item = usize, IntoIter: ExactSizeIterator>,
        timeout: Duration,
        call: impl FnMut(usize, &dyn Node) -> NodeFuture<T>,
        decided: impl FnMut(usize, Result<T, NodeError>, usize) -> bool,
    ) {
        self.fan_out_keeping(Instant::now(), targets, timeout, None, call, decided)
            .await;
    }

    /// [`fan_out`](Self::fan_out) of a round that started at `started` (its calls time
    /// out `timeout` after it), handing the calls still pending to `keep` (when given)
    /// instead of to the background.
    pub(crate) async fn fan_out_keeping<T: Send + 'static>(
        &self,
        started: Instant,
        targets: impl IntoIterator<Item = usize, IntoIter: ExactSizeIterator>,
        timeout: Duration,
        keep: Option<&mut Vec<(usize, Pending<T>)>>,
        mut call: impl FnMut(usize, &dyn Node) -> NodeFuture<T>,
        mut decided: impl FnMut(usize, Result<T, NodeError>, usize) -> bool,
    ) {
        let mut targets = targets.into_iter();
        if targets.len() == 1 {
            // The single-node lock: nothing to fan out, nothing to leave behind.
            if let Some(only) = targets.next() {
                let call = call(only, &*self.list[only]);
                let answer = watched(self.health[only].clone(), started, timeout, call).await;
                decided(only, answer, 0);
            }
            return;
        }
        // A handful of calls, polled in turn on every wake-up: cheaper than a
        // `FuturesUnordered`, which allocates its queue and a task per call on every
        // round. They start together, so one timer bounds them all (a timer per call
        // cost a registration each), and they stay the boxes the nodes made until the
        // round is decided: only those still running then are wrapped, to finish alone.
        let deadline = started + timeout;
        let mut calls: Vec<(usize, NodeFuture<T>)> = targets
            .map(|index| (index, call(index, &*self.list[index])))
            .collect();
        let expired = tokio::time::sleep_until(deadline);
        let mut expired = std::pin::pin!(expired);
        while !calls.is_empty() {
            let next = std::future::poll_fn(|cx| {
                if let Poll::Ready(answer) = next_answer(&mut calls, cx) {
                    return Poll::Ready(Some(answer));
                }
                expired.as_mut().poll(cx).map(|()| None)
            })
            .await;
            let Some((index, answer)) = next else {
                // Out of time: every call still running has timed out, in node order;
                // each is recorded, and fed to `decided` until it decides.
                let mut undecided = true;
                while !calls.is_empty() {
                    let (index, _) = calls.remove(0);
                    let answer = Err(NodeError::Timeout(timeout));
                    observe(&self.health[index], started, &answer);
                    undecided = undecided && !decided(index, answer, calls.len());
                }
                return;
            };
            observe(&self.health[index], started, &answer);
            if decided(index, answer, calls.len()) {
                break;
            }
        }
        if calls.is_empty() {
            return;
        }
        let pending = calls.into_iter().map(|(index, call)| {
            let answer = watched(self.health[index].clone(), started, timeout, call);
            (index, Box::pin(answer) as Pending<T>)
        });
        match keep {
            Some(keep) => keep.extend(pending),
            None => {
                let pending: FuturesUnordered<_> = pending.map(|(_, call)| call).collect();
                self.background
                    .finish(Box::pin(pending.for_each(|_| async {})));
            }
        }
    }
}

/// The first of `calls` to answer, taken out of it, with its node's index. The calls
/// are polled, and kept, in the order they were made: of the answers ready together,
/// those of the nodes listed first count first, as a `FuturesUnordered` takes them.
fn next_answer<T>(
    calls: &mut Vec<(usize, NodeFuture<T>)>,
    cx: &mut Context<'_>,
) -> Poll<(usize, Result<T, NodeError>)> {
    for at in 0..calls.len() {
        if let Poll::Ready(answer) = calls[at].1.as_mut().poll(cx) {
            let (index, _) = calls.remove(at);
            return Poll::Ready((index, answer));
        }
    }
    Poll::Pending
}

/// Records a call's answer in its node's `health` (and, when it failed, in the metrics,
/// under the node's name the health keeps).
fn observe<T>(health: &Health, started: Instant, answer: &Result<T, NodeError>) {
    health.observe(started.into_std(), answer);
    if let Err(error) = answer {
        metrics::node_error(health.name(), error);
    }
}

/// `call` to a node, made at `started` and bounded by `timeout` from then, its answer
/// recorded in the node's `health` (and, when it failed, in the metrics). One reading
/// of the clock serves the timeout and the node's latency.
pub(crate) async fn watched<T>(
    health: Arc<Health>,
    started: Instant,
    timeout: Duration,
    call: NodeFuture<T>,
) -> Result<T, NodeError> {
    let answer = match tokio::time::timeout_at(started + timeout, call).await {
        Ok(answer) => answer,
        Err(_) => Err(NodeError::Timeout(timeout)),
    };
    observe(&health, started, &answer);
    answer
}
