//! The rounds of a lease over a set, on every node at once: as `lock/round.rs` does
//! for one resource, with each node's set calls.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;

use crate::error::NodeFailure;
use crate::lock::health::Health;
use crate::lock::round::{watched, NodeSet, Nodes, OwnerTally, Stragglers};
use crate::node::NodeCalls;
use crate::node::{AcquireSetReply, AcquireSetRequest, LockKeys, Node, NodeFuture, Owner};

/// The per-node answers of one set acquire round.
pub(crate) struct SetTally {
    /// Nodes that granted the whole set, with each member's fence counter.
    pub(crate) won: Vec<(usize, Vec<u64>)>,
    /// Nodes on which someone else holds a member.
    pub(crate) held: Vec<usize>,
    /// The first member (in canonical order) a node found held.
    pub(crate) first_held: Option<usize>,
    /// The largest remaining ttl reported by a holder.
    pub(crate) holder_ttl: Option<Duration>,
    pub(crate) failures: Vec<NodeFailure>,
}

impl Nodes {
    /// One set acquire round on every node, started at `started`; decided as
    /// [`Nodes::acquire`] decides.
    pub(crate) async fn acquire_set(
        &self,
        started: Instant,
        request: &AcquireSetRequest<'_>,
    ) -> (SetTally, Stragglers<AcquireSetReply>) {
        let mut tally = SetTally {
            won: Vec::with_capacity(self.len()),
            held: Vec::new(),
            first_held: None,
            holder_ttl: None,
            failures: Vec::new(),
        };
        let quorum = self.quorum();
        let mut stragglers = Stragglers {
            calls: Vec::new(),
            answered: NodeSet::default(),
        };
        let seen = &mut stragglers.answered;
        let calls = &mut stragglers.calls;
        self.fan_out_keeping(
            started,
            0..self.len(),
            self.timeout(),
            Some(calls),
            |index, _| {
                let owner = request.owner.for_node(index);
                self.list[index].clone().acquire_set(&AcquireSetRequest {
                    owner: &owner,
                    ..*request
                })
            },
            |index, answer, pending| {
                seen.insert(index);
                match answer {
                    Ok(AcquireSetReply::Acquired { fences }) => tally.won.push((index, fences)),
                    Ok(AcquireSetReply::Held { member, pttl }) => {
                        tally.held.push(index);
                        tally.holder_ttl = tally.holder_ttl.max(pttl);
                        tally.first_held = Some(tally.first_held.map_or(member, |m| m.min(member)));
                    }
                    Err(error) => tally.failures.push(NodeFailure {
                        node: self.name(index),
                        error,
                    }),
                }
                let won = tally.won.len();
                let answered = won + tally.held.len();
                crate::lock::quorum::acquisition_decided(quorum, won, answered, pending)
            },
        )
        .await;
        (tally, stragglers)
    }

    /// Raises every member's fence counter to its token on the given nodes; returns how
    /// many confirmed.
    pub(crate) async fn raise_fences(
        &self,
        targets: Vec<usize>,
        keys: &[LockKeys],
        tokens: &[u64],
        fence_ttl: Duration,
        deadline: Instant,
        needed: usize,
    ) -> (usize, Vec<NodeFailure>) {
        let mut confirmed = 0;
        let mut failures = Vec::new();
        let timeout = self
            .timeout()
            .min(deadline.saturating_duration_since(Instant::now()));
        self.fan_out(
            targets,
            timeout,
            |_, node| node.raise_fences(keys, tokens, fence_ttl),
            |index, answer, pending| {
                match answer {
                    Ok(()) => confirmed += 1,
                    Err(error) => failures.push(NodeFailure {
                        node: self.name(index),
                        error,
                    }),
                }
                confirmed >= needed || confirmed + pending < needed
            },
        )
        .await;
        (confirmed, failures)
    }

    /// One extend round over a set: a node says yes only when every member is ours.
    pub(crate) async fn extend_set(
        &self,
        keys: &[LockKeys],
        owner: &Owner,
        ttl: Duration,
        timeout: Duration,
    ) -> OwnerTally {
        self.owner_round(timeout, |index, node| {
            node.extend_set(keys, &owner.for_node(index), ttl)
        })
        .await
    }

    /// One release round over a set, waiting for every node as [`Nodes::release`] does.
    pub(crate) async fn release_set(&self, keys: &[LockKeys], owner: &Owner) -> OwnerTally {
        let mut tally = OwnerTally::default();
        self.fan_out(
            0..self.len(),
            self.timeout(),
            |index, node| node.release_set(keys, &owner.for_node(index)),
            |index, answer, _| {
                tally.add(answer, || self.name(index));
                false
            },
        )
        .await;
        tally
    }

    /// Releases a failed set attempt on the given nodes in the background, each only
    /// after that node's acquire among `stragglers` has finished (see
    /// [`Nodes::release_after`]), without waking anyone.
    pub(crate) fn release_set_after(
        &self,
        mut stragglers: Stragglers<AcquireSetReply>,
        targets: impl IntoIterator<Item = usize>,
        keys: &[LockKeys],
        owner: &Owner,
    ) {
        let mut wanted = vec![false; self.len()].into_boxed_slice();
        for index in targets {
            wanted[index] = true;
        }
        let late = std::mem::take(&mut stragglers.calls);
        // Nothing was granted to anyone here: wake no waiter.
        let quiet: Arc<[LockKeys]> = keys
            .iter()
            .map(|keys| LockKeys {
                channel: String::new(),
                ..keys.clone()
            })
            .collect();
        let cleanup = SetCleanup {
            nodes: self.list.clone(),
            health: self.health.clone(),
            timeout: self.timeout(),
            keys: quiet,
            owner: owner.clone(),
        };
        // The calls are made here, as `release_after`'s are: a node may act when called.
        let now: Vec<(usize, NodeFuture<bool>)> = (0..self.len())
            .filter(|&index| wanted[index] && stragglers.answered.contains(index))
            .map(|index| (index, cleanup.call(index)))
            .collect();
        if now.is_empty() && late.is_empty() {
            return;
        }
        self.background.finish(Box::pin(async move {
            let cleanup = &cleanup;
            let wanted = &wanted;
            let released_now = now
                .into_iter()
                .map(|(index, release)| cleanup.finish(index, release).boxed());
            // A straggler's node is released (or not) once its acquire has finished.
            let released_late = late.into_iter().map(|acquire| {
                async move {
                    match acquire.await {
                        // Someone else's key: nothing of ours to release.
                        (_, Ok(AcquireSetReply::Held { .. })) => {}
                        (index, _) if wanted[index] => {
                            cleanup.finish(index, cleanup.call(index)).await;
                        }
                        _ => {}
                    }
                }
                .boxed()
            });
            let steps: FuturesUnordered<_> = released_now.chain(released_late).collect();
            steps.for_each(|()| async {}).await;
        }));
    }
}

/// What a failed set attempt's cleanup needs, owned by its future.
struct SetCleanup {
    nodes: Box<[Arc<dyn Node>]>,
    health: Box<[Arc<Health>]>,
    timeout: Duration,
    keys: Arc<[LockKeys]>,
    owner: Owner,
}

impl SetCleanup {
    fn call(&self, index: usize) -> NodeFuture<bool> {
        self.nodes[index].release_set(&self.keys, &self.owner.for_node(index))
    }

    /// Awaits one node's release, bounded by the node timeout, its answer recorded in
    /// the node's health (the outcome itself changes nothing: the keys expire anyway).
    async fn finish(&self, index: usize, release: NodeFuture<bool>) {
        let _ = watched(self.health[index].clone(), self.timeout, release).await;
    }
}
