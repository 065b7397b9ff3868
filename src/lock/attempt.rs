//! One attempt at a [`Target`]: a round on every node, the fence write-back when the
//! nodes' counters disagree, the validity check, and the cleanup of an attempt that
//! failed or was cancelled. The same for one resource and for a set; the target says
//! which node calls to make.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;
use tokio::time::Instant;

use super::background::Leftover;
use super::health::Health;
use super::lease::{LeaseInner, StatusCell};
use super::metrics;
use super::round::{watched, Nodes};
use super::target::Target;
use super::{fencing, LockError, Redlock, Shared};
use crate::node::{Acquire, Node, NodeError, NodeFuture, Owner, PerKey, Vote, Waiter};

/// How many times a caller that does not wait runs an attempt lost to a split vote
/// again, after a short random delay, before it is refused (Redlock's rule).
pub(super) const SPLIT_RETRIES: u32 = 3;

impl Redlock {
    /// One Redlock round over `target` (plus the fence write-back when needed); the
    /// caller holds every member's local turn. `waiter`: the caller waits, and joins
    /// the wait queues if refused. `split`: set when the round was lost to a split
    /// vote (concurrent attempts each won some nodes, none a quorum): it names no
    /// holder, and a caller that does not wait runs it again ([`SPLIT_RETRIES`]).
    #[tracing::instrument(name = "redlock.acquire", level = "debug", skip_all, fields(resource = %target.resources()[0], members = target.resources().len()))]
    pub(super) async fn attempt(
        &self,
        target: &Target,
        waiter: Option<&Waiter>,
        split: &mut bool,
    ) -> Result<Won, LockError> {
        let shared = &self.shared;
        let options = &shared.options;
        let nodes = &shared.nodes;
        let resource = &target.resources()[0];
        let owner = Owner::random();
        let start = Instant::now();
        let in_flight = ReleaseIfDropped::new(nodes, target, &owner, Stragglers::default());
        let ask = Acquire {
            keys: target.keys(),
            owner: &owner,
            mode: target.mode(),
            ttl: options.ttl,
            fencing: options.fencing,
            fence_ttl: options.fence_ttl,
            fence_floor: fencing::round_floor(options.fencing),
            seed_only_when_missing: options.seed_only_when_missing,
            // Only one resource's exclusive waiter joins the nodes' wait queues.
            waiter: waiter.filter(|_| target.queues()),
        };
        let (tally, stragglers) = nodes.acquire(start, &ask).await;
        in_flight.disarm();
        let quorum = target.quorum(nodes.len());
        if tally.won.len() + tally.held.len() >= quorum {
            shared.quorum.answered();
        }
        let valid_until = start + options.ttl - options.drift();
        // Every node that may hold our keys: all but those that said someone else holds
        // a member, which keep nothing of the request (a straggler saying so is skipped
        // when it answers).
        let cleanup = |stragglers: Stragglers<Vote>| {
            let targets = (0..nodes.len()).filter(|i| !tally.held.contains(i));
            nodes.release_after(stragglers, targets, target, &owner, waiter);
        };
        // A majority asked and not won in time: a retry may do, or the store is down.
        let too_slow = |validity, why: &str| {
            shared.metrics.too_slow.inc();
            tracing::warn!(%resource, ?validity, elapsed = ?start.elapsed(), "{why}");
            Err(LockError::ValidityExpired {
                resource: resource.clone(),
                validity,
                min_validity: options.min_validity,
            })
        };
        let unavailable = |answered, failures| {
            shared.metrics.unavailable.inc();
            let error = nodes.unavailable(resource, answered, quorum, failures);
            shared.quorum.refused(answered, nodes.len(), quorum, &error);
            Err(error)
        };
        if tally.won.len() < quorum {
            let answered = tally.won.len() + tally.held.len();
            cleanup(stragglers);
            if let Some(held) = tally.other_mode {
                return Err(LockError::ModeMismatch {
                    resource: resource.clone(),
                    held,
                    asked: target.mode(),
                });
            }
            if answered >= quorum {
                // Nodes granted us while others refused: contenders of the same moment
                // split the votes (a quorum-holder's nodes refuse every one of ours;
                // the round waits for every answer before calling it that).
                *split = !tally.won.is_empty();
                shared.metrics.contended.inc();
                let member = tally.first_held.unwrap_or(0);
                let held = target.resources().get(member).unwrap_or(resource);
                tracing::debug!(resource = %held, held = tally.held.len(), won = tally.won.len(), elapsed = ?start.elapsed(), "resource held");
                return Err(LockError::Held {
                    resource: held.clone(),
                    holder_ttl: tally.holder_ttl,
                });
            }
            return unavailable(answered, tally.failures);
        }

        // Each member's token: the highest of its counters among the nodes that granted.
        let members = target.resources().len();
        let mut tokens = target.each(|_| 0u64);
        for (_, fences) in &tally.won {
            for (token, &fence) in tokens.iter_mut().zip(fences.iter()) {
                *token = (*token).max(fence);
            }
        }
        let behind: Vec<usize> = tally
            .won
            .iter()
            .filter(|(_, fences)| {
                fences.len() != members || fences.iter().zip(tokens.iter()).any(|(f, t)| f < t)
            })
            .map(|&(index, _)| index)
            .collect();
        let mut stragglers = stragglers;
        if !behind.is_empty() {
            // Write-back: a majority must hold every member's token before the lease
            // counts.
            let level = tally.won.len() - behind.len();
            let in_flight = ReleaseIfDropped::new(nodes, target, &owner, stragglers);
            let needed = quorum - level.min(quorum);
            let (confirmed, failures) = nodes
                .raise(
                    behind,
                    target,
                    &tokens,
                    valid_until,
                    needed,
                    options.fence_ttl,
                )
                .await;
            stragglers = in_flight.disarm();
            if level + confirmed < quorum {
                cleanup(stragglers);
                let validity = valid_until.saturating_duration_since(Instant::now());
                if validity <= options.min_validity {
                    // The write-back was cut short by the validity deadline: a majority
                    // answered, too slowly. Not an unavailable store; worth a retry.
                    return too_slow(validity, "fence write-back ran out of validity");
                }
                return unavailable(level + confirmed, failures);
            }
        }

        let validity = valid_until.saturating_duration_since(Instant::now());
        if validity <= options.min_validity {
            cleanup(stragglers);
            return too_slow(validity, "majority won too slowly");
        }
        shared.metrics.acquired.inc();
        tracing::debug!(%resource, members, votes = tally.won.len(), token = tokens[0], elapsed = ?start.elapsed(), "lease acquired");
        Ok(Won {
            owner,
            tokens,
            acquired_at: start,
            valid_until,
            stragglers: stragglers.detach(nodes),
            // Where our attempt did not win (refused, or not answered in time), it may
            // have reached the node before the previous holder's release: that release
            // then queued or reserved us there too late, and ours undoes it.
            waiter: waiter.filter(|_| tally.won.len() < nodes.len()).cloned(),
        })
    }
}

/// A won round, not yet a lease: the caller adds the target, which it owns and hands
/// over rather than have it copied.
pub(super) struct Won {
    owner: Owner,
    tokens: PerKey<u64>,
    acquired_at: Instant,
    valid_until: Instant,
    stragglers: Option<watch::Receiver<()>>,
    waiter: Option<Waiter>,
}

impl Won {
    pub(super) fn into_lease(self, shared: &Arc<Shared>, target: Target) -> Arc<LeaseInner> {
        Arc::new(LeaseInner {
            locker: shared.clone(),
            target,
            tokens: self.tokens,
            owner: self.owner,
            acquired_at: self.acquired_at,
            status: StatusCell::new(self.valid_until),
            stragglers: self.stragglers,
            waiter: self.waiter,
        })
    }
}

/// Releases an attempt's keys on every node, in the background, when the attempt is
/// dropped while a round is in flight (a cancelled `acquire`): a `SET` sent before the
/// drop may land after it, and would otherwise block the resource for a whole ttl. A
/// dropped redis-rs call is never resent, so a release sent now follows on each
/// connection whatever was written; the `stragglers` are waited for.
struct ReleaseIfDropped<'a> {
    nodes: &'a Nodes,
    target: &'a Target,
    owner: &'a Owner,
    stragglers: Option<Stragglers<Vote>>,
}

impl<'a> ReleaseIfDropped<'a> {
    fn new(
        nodes: &'a Nodes,
        target: &'a Target,
        owner: &'a Owner,
        stragglers: Stragglers<Vote>,
    ) -> Self {
        ReleaseIfDropped {
            nodes,
            target,
            owner,
            stragglers: Some(stragglers),
        }
    }

    /// The round finished: its outcome is handled by the caller.
    fn disarm(mut self) -> Stragglers<Vote> {
        self.stragglers.take().unwrap_or_default()
    }
}

impl Drop for ReleaseIfDropped<'_> {
    fn drop(&mut self) {
        // Without a runtime (it is shutting down) nothing can be sent; the keys expire.
        if let Some(stragglers) = self.stragglers.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            let all = 0..self.nodes.len();
            self.nodes
                .release_after(stragglers, all, self.target, self.owner, None);
        }
    }
}

impl Nodes {
    /// Releases `target` on the given nodes in the background (cleanup of a failed
    /// attempt), each only after that node's acquire among `stragglers` has finished: a
    /// release that overtook it would find nothing, and the late acquire would then
    /// hold the keys until their ttl. Every step is bounded by the node timeout.
    /// `waiter`: the attempt was a waiter's, whose key goes back to it
    /// ([`Release::HandBack`](crate::node::Release::HandBack)).
    pub(crate) fn release_after(
        &self,
        mut stragglers: Stragglers<Vote>,
        targets: impl IntoIterator<Item = usize>,
        target: &Target,
        owner: &Owner,
        waiter: Option<&Waiter>,
    ) {
        let mut wanted = vec![false; self.len()].into_boxed_slice();
        for index in targets {
            wanted[index] = true;
        }
        let late = std::mem::take(&mut stragglers.calls);
        // A straggler's node is released (or not) once its acquire has finished.
        let now: Vec<usize> = (0..self.len())
            .filter(|&index| wanted[index] && late.iter().all(|&(at, _)| at != index))
            .collect();
        let cleanup = Cleanup {
            nodes: self.list.clone(),
            health: self.health.clone(),
            timeout: self.timeout(),
            target: target.clone(),
            waiter: waiter.cloned(),
            owner: owner.clone(),
            wanted,
        };
        // The calls are made here, not in the task: a node may act when called
        // (`MemoryNode` does), and the attempt's caller may look right after it returns.
        let work: Vec<Step> = now
            .into_iter()
            .map(|index| Step::Now(index, cleanup.release(index)))
            .chain(
                late.into_iter()
                    .map(|(index, call)| Step::After(index, call)),
            )
            .collect();
        if work.is_empty() {
            return;
        }
        self.background.finish(Box::pin(async move {
            let cleanup = &cleanup;
            let steps: FuturesUnordered<_> =
                work.into_iter().map(|step| cleanup.run(step)).collect();
            steps.for_each(|()| async {}).await;
        }));
    }
}

/// One step of a failed attempt's cleanup.
enum Step {
    /// This release on this node: its acquire has answered.
    Now(usize, NodeFuture<bool>),
    /// Release on this node once its acquire has finished.
    After(usize, Pending<Vote>),
}

/// What a failed attempt's cleanup needs, owned by its task.
struct Cleanup {
    nodes: Box<[Arc<dyn Node>]>,
    health: Box<[Arc<Health>]>,
    timeout: Duration,
    target: Target,
    /// The attempt was this waiter's (see [`Target::undo`]).
    waiter: Option<Waiter>,
    owner: Owner,
    /// The nodes that may hold the attempt's keys.
    wanted: Box<[bool]>,
}

impl Cleanup {
    fn release(&self, index: usize) -> NodeFuture<bool> {
        let owner = self.owner.for_node(index);
        self.target
            .undo(&*self.nodes[index], &owner, self.waiter.as_ref())
    }

    async fn run(&self, step: Step) {
        let (index, release) = match step {
            Step::Now(index, release) => (index, Some(release)),
            Step::After(index, acquire) => match acquire.await {
                // Someone else's key: nothing of ours to release.
                Ok(Vote::Held { .. } | Vote::OtherMode { .. }) => return,
                _ => (index, None),
            },
        };
        if !self.wanted.get(index).copied().unwrap_or(false) {
            return;
        }
        let release = release.unwrap_or_else(|| self.release(index));
        let _ = watched(
            self.health[index].clone(),
            Instant::now(),
            self.timeout,
            release,
        )
        .await;
    }
}

/// A call still in flight when its round was decided.
pub(crate) type Pending<T> = Pin<Box<dyn Future<Output = Result<T, NodeError>> + Send>>;

/// The calls of an acquire round still in flight when it was decided. Dropped, they
/// finish in the background; a failed attempt hands them to
/// [`Nodes::release_after`] instead, so that its cleanup reaches each node only after
/// that node's acquire.
pub(crate) struct Stragglers<R: Send + 'static> {
    /// Each with its node's index; every other node has answered, or its call was dropped.
    pub(crate) calls: Vec<(usize, Pending<R>)>,
}

impl<R: Send + 'static> Default for Stragglers<R> {
    fn default() -> Self {
        Stragglers { calls: Vec::new() }
    }
}

impl<R: Send + 'static> Stragglers<R> {
    /// Lets the calls finish in the background (a won round), in the locker's driver
    /// task; the receiver, if any call is left, sees its sender dropped once they all
    /// have.
    pub(crate) fn detach(mut self, nodes: &Nodes) -> Option<tokio::sync::watch::Receiver<()>> {
        if self.calls.is_empty() {
            return None;
        }
        let (done, settled) = tokio::sync::watch::channel(());
        let finish: Leftover = if self.calls.len() == 1 {
            let (_, call) = self.calls.pop()?;
            Box::pin(async move {
                let _ = call.await;
                drop(done);
            })
        } else {
            let calls: FuturesUnordered<_> = self.calls.drain(..).map(|(_, call)| call).collect();
            Box::pin(async move {
                calls.for_each(|_| async {}).await;
                drop(done);
            })
        };
        nodes.background.finish(finish);
        Some(settled)
    }
}

impl<R: Send + 'static> Drop for Stragglers<R> {
    fn drop(&mut self) {
        // Without a runtime (it is shutting down) the calls are dropped with it.
        if !self.calls.is_empty() && tokio::runtime::Handle::try_current().is_ok() {
            let calls: FuturesUnordered<_> = self.calls.drain(..).map(|(_, call)| call).collect();
            metrics::spawn(
                &tokio::runtime::Handle::current(),
                calls.for_each(|_| async {}),
            );
        }
    }
}
