//! Shared and counted holders of a resource: readers beside writers, and at most `n`
//! permits at once. [`SharedModes`] is what a node kind implements for them; the
//! exclusive lease ([`Node::acquire`](crate::node::Node::acquire)) is the writer.
//!
//! The contract, writer preference and what a shared holder's token orders are
//! written on [`SharedModes`].

use std::num::NonZeroU32;
use std::time::Duration;

use crate::node::{AcquireReply, ExtendEntry, NodeError, NodeFuture, Owner, ResourceKeys};

/// How a lease shares its resource with others (the exclusive lease is
/// [`Node::acquire`](crate::node::Node::acquire)'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SharedMode {
    /// A reader: shares the resource with every other reader and permit holder, never
    /// with a writer.
    Shared,
    /// One of at most `n` permits: at most `n` live holders at once.
    Counted(NonZeroU32),
}

impl SharedMode {
    /// `n` permits; `None` for `n = 0`, which no holder could ever get.
    pub fn counted(n: u32) -> Option<Self> {
        NonZeroU32::new(n).map(SharedMode::Counted)
    }

    /// The most holders at once, `None` without a limit (a reader).
    pub fn limit(&self) -> Option<NonZeroU32> {
        match self {
            SharedMode::Shared => None,
            SharedMode::Counted(n) => Some(*n),
        }
    }
}

/// Arguments of [`SharedModes::acquire_shared`], as [`AcquireRequest`](crate::node::AcquireRequest)'s
/// for the exclusive lease.
#[derive(Debug, Clone, Copy)]
pub struct SharedRequest<'a> {
    /// The keys of the resource.
    pub keys: &'a ResourceKeys,
    /// The owner value of this acquisition (this node's, see [`Owner::for_node`]).
    pub owner: &'a Owner,
    /// Reader or permit.
    pub mode: SharedMode,
    /// The holder's time to live.
    pub ttl: Duration,
    /// The fence counter's time to live.
    pub fence_ttl: Duration,
    /// Step the fence counter; when `false` the grant answers `Acquired { fence: 0 }`.
    pub fencing: bool,
    /// The least fence value this grant may return (see
    /// [`AcquireRequest::fence_floor`](crate::node::AcquireRequest::fence_floor)).
    pub fence_floor: u64,
}

/// Shared and counted holders on one node: the capability a node kind offers through
/// [`Node::shared_modes`](crate::node::Node::shared_modes). A locker refuses, when it is
/// built for these modes, a node that answers `None` there.
///
/// # The contract, per resource and node
///
/// A resource's lock key holds **either** one exclusive owner (or a reservation for a
/// waiting writer, see [`Node::wait_queue`](crate::node::Node::wait_queue)) **or** a set
/// of shared holders, each with its own owner value and its own expiry. Every
/// operation below is atomic on the node:
///
/// - [`acquire_shared`](SharedModes::acquire_shared) is refused while an exclusive
///   owner or a reservation holds the key, while a waiting writer's *intent* is live
///   (see [Writer preference](#writer-preference)), and, in
///   [`SharedMode::Counted`] mode, while `n` live holders other than the caller hold
///   it. Expired holders are pruned first: a holder that died frees its place when
///   its ttl runs out. A grant adds (or, for a resend, refreshes) the caller's entry
///   with expiry `now + ttl` and steps the resource's fence counter by the exclusive
///   rule (`max(counter + 1, floor)`, [`fencing`](crate::fencing)). A refusal answers
///   [`AcquireReply::Held`] with how long the obstacle lasts at most: the writer's
///   ttl, the intent's, or the earliest permit's expiry.
/// - [`Node::acquire`](crate::node::Node::acquire) (the writer) is refused while any
///   shared holder is live, whatever its mode; the exclusive operations meeting shared
///   holders (`extend`, `release`, the set calls, the record calls) answer "not ours" or
///   "held", never an error.
/// - [`extend_shared`](SharedModes::extend_shared) moves the caller's expiry to
///   `now + ttl` if its entry is still live; it never re-creates a lost entry.
/// - [`release_shared`](SharedModes::release_shared) removes the caller's entry
///   (compare-by-owner) and wakes waiters: the last holder's release hands the
///   resource to the wait queue's next writer exactly as an exclusive release does
///   (reserved for it, woken alone), else wakes the resource's own channel
///   (`keys.channel`, the listeners marked by
///   [`listen_for_release`](crate::node::WaitQueue::listen_for_release)); a release that
///   leaves other holders wakes the channel's listeners too, for a waiting permit.
///   An empty `keys.channel` only removes the entry.
///
/// The live holders of a resource hold it in **one** mode: readers, or permits of one
/// `n`. [`acquire_shared`](SharedModes::acquire_shared) in another mode (another `n`,
/// a reader among permits, a permit among readers) answers
/// [`AcquireReply::OtherMode`] with theirs, room or not: a holder never holds the
/// resource beside more holders than its own `n` allows. The mode is decided in the
/// same atomic step as the admission, so the first holder after none sets it.
///
/// # Writer preference
///
/// A writer that **waits** ([`AcquireRequest::waiter`](crate::node::AcquireRequest::waiter))
/// and finds shared holders leaves an intent (on Redis the key `…:writer`) that lives
/// [`Waiter::queue_ttl`](crate::node::Waiter::queue_ttl) from its latest attempt, and
/// joins the wait queue as it does behind another writer. While the intent is live and
/// a writer is queued, new shared holders are refused; the holders already in finish,
/// and the last one's release hands the resource to the queued writer. Without it a
/// stream of overlapping readers keeps the key a set of holders forever, and the writer
/// is never served: a report regenerated by a `PUT` would stay stale behind steady
/// `GET`s. The price is that readers wait behind a writer that waits.
///
/// The intent needs nothing of the uncontended path: it is written only in the
/// contended branch of the waiting acquire, so a writer that finds the key free pays
/// what it paid before, and a reader checks it only when it acquires. It expires by
/// itself (a writer that died stops refreshing it within one queue ttl), and it counts
/// only while a writer is queued: the writer served, or gone from the queue, no longer
/// holds the readers back even before the intent's ttl ends. A writer that does not
/// wait ([`Redlock::try_acquire`](crate::Redlock::try_acquire)) claims no preference.
///
/// # What a shared holder's token orders
///
/// Every grant, shared or exclusive, steps the resource's **one** counter with the
/// exclusive rule, and the engine takes the same maximum over the acquiring majority
/// and writes it back. The argument of [`fencing`](crate::fencing) never looks at what
/// the earlier holder was, so it carries over as it is: *a holder granted after another
/// holder's lease ended (released or expired) gets a greater token*, whatever the modes
/// of the two. (Their majorities meet in a node whose counter, after the earlier
/// write-back, is at least the earlier token; the later step there answers more, or a
/// floor above it.) Exclusion then decides which pairs that orders:
///
/// - **A writer's token is above every token any earlier reader, permit holder or
///   writer held**, and below every token of a holder granted after it ended: a writer
///   overlaps nobody (it is refused while a shared holder is live, and shared holders
///   are refused while it holds), so every other holder ended before it began or began
///   after it ended.
/// - **Shared holders that overlap are not ordered**: their tokens may come in either
///   order and may even be equal (two readers' maxima over different majorities). A
///   reader's token tells a store "every writer with a greater token came after me";
///   a permit holder's says the same of writers, never of other permits. A store that
///   checks tokens must therefore accept equal and smaller tokens among concurrent
///   readers, and only refuse what a writer's greater token fenced out.
pub trait SharedModes: Send + Sync {
    /// Adds `request.owner` to the resource's shared holders (or refreshes it), unless a
    /// writer, a waiting writer's intent or the mode's limit stands in the way.
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply>;

    /// Moves the holder's expiry to `now + ttl` if it is still live; `false` when it is
    /// not (expired, released, never granted). Never re-creates it.
    fn extend_shared(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool>;

    /// [`extend_shared`](SharedModes::extend_shared) for many holders at once, each with
    /// its own owner and all with one `ttl`, answering per entry in the order given (as
    /// [`Node::extend_many`](crate::node::Node::extend_many) does for exclusive leases,
    /// which it leaves to this: a shared holder is not the lock key's value). The
    /// default makes the per-holder calls concurrently, which a Redis node's connection
    /// sends together.
    fn extend_shared_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let calls: Vec<_> = entries
            .iter()
            .map(|entry| self.extend_shared(entry.keys, &entry.owner, ttl))
            .collect();
        Box::pin(async move { Ok(futures_util::future::join_all(calls).await) })
    }

    /// Removes the holder (compare-by-owner) and wakes the waiters (see the module
    /// docs); `true` when it was a live holder.
    fn release_shared(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool>;
}
