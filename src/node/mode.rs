//! [`LockMode`]: how a lease shares its resource, and (on its docs) what a node owes
//! each mode.

#[cfg(doc)]
use crate::node::{Acquire, Node, Release, Vote, Waiter};

use std::num::NonZeroU32;

/// How a lease shares its resource with the other leases of the same resource.
///
/// | mode | holds the resource beside | for |
/// |---|---|---|
/// | [`Exclusive`](LockMode::Exclusive) (the default) | nobody | one execution at a time: a payment, an order, a webhook |
/// | [`Shared`](LockMode::Shared) | other shared holders, never an exclusive one | readers beside readers, never beside a writer: `GET` a report while no `PUT` regenerates it |
/// | [`Counted`](LockMode::Counted) | at most `n − 1` other counted holders | at most `n` at once: three exports per tenant, two calls to a rate-limited partner |
///
/// Shared holders are **writer-preferring**: once an exclusive acquisition waits
/// ([`Redlock::acquire_as`](crate::Redlock::acquire_as)) — from its second attempt, made
/// as soon as it is subscribed to the releases, a round trip after its first refusal —
/// new shared holders are refused until it is served or gives up, so a steady stream of
/// readers cannot starve a writer.
/// A writer's fencing token is above every token an earlier holder had, in any mode;
/// overlapping shared holders are not ordered (the argument is below).
///
/// The shared holders of a resource hold it in one mode: readers, or permits of one
/// `n`. A caller in another mode (another `n`, a reader among permits, a permit among
/// readers) is refused with [`LockError::ModeMismatch`](crate::LockError::ModeMismatch)
/// naming both, however much room is left, so no holder ever holds the resource beside
/// more holders than its own `n` allows. To change a limit in a rolling deploy, drain
/// the instances holding the old one ([`Redlock::drain`](crate::Redlock::drain)) before
/// the new one takes leases: while old holders live, the new `n` is refused (the layer
/// answers 503 `lock-unavailable`), and once they are gone the first new holder sets it.
///
/// # What a node owes each mode, per resource
///
/// A resource's lock key holds **either** one exclusive owner (or a reservation for a
/// waiting writer, see [`Capabilities::wait_queue`](crate::node::Capabilities::wait_queue)) **or** a set
/// of shared holders, each with its own owner value and its own expiry. Every
/// operation below is atomic on the node:
///
/// - A shared or counted [`Node::acquire`] is refused while an exclusive
///   owner or a reservation holds the key, while a waiting writer's *intent* is live
///   (see [Writer preference](#writer-preference)), and, in
///   [`LockMode::Counted`] mode, while `n` live holders other than the caller hold
///   it. Expired holders are pruned first: a holder that died frees its place when
///   its ttl runs out. A grant adds (or, for a resend, refreshes) the caller's entry
///   with expiry `now + ttl` and steps the resource's fence counter by the exclusive
///   rule (`max(counter + 1, floor)`, [`fencing`](crate::fencing)). A refusal answers
///   [`Vote::Held`] with how long the obstacle lasts at most: the writer's
///   ttl, the intent's, or the earliest permit's expiry.
/// - An exclusive [`Node::acquire`] (the writer) is refused while any
///   shared holder is live, whatever its mode; the exclusive operations meeting shared
///   holders (`extend`, `release`, a set's calls, the record calls) answer "not ours" or
///   "held", never an error.
/// - [`Node::extend`] of a shared hold moves the caller's expiry to
///   `now + ttl` if its entry is still live; it never re-creates a lost entry.
/// - [`Node::release`] of a shared hold removes the caller's entry
///   (compare-by-owner) and wakes waiters: the last holder's release hands the
///   resource to the wait queue's next writer exactly as an exclusive release does
///   (reserved for it, woken alone), else wakes the resource's own channel
///   (`keys.channel`, the listeners marked by
///   [`Node::listen_for_release`]); a release that
///   leaves other holders wakes the channel's listeners too, for a waiting permit.
///   [`Release::Quiet`] only removes the entry.
///
/// The live holders of a resource hold it in **one** mode: readers, or permits of one
/// `n`. A shared or counted [`Node::acquire`] in another mode (another `n`,
/// a reader among permits, a permit among readers) answers
/// [`Vote::OtherMode`] with theirs, room or not: a holder never holds the
/// resource beside more holders than its own `n` allows. The mode is decided in the
/// same atomic step as the admission, so the first holder after none sets it.
///
/// ## Writer preference
///
/// A writer that **waits** ([`Acquire::waiter`])
/// and finds shared holders leaves an intent (on Redis the key `…:writer`) that lives
/// [`Waiter::queue_ttl`] from its latest attempt, and
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
/// ## What a shared holder's token orders
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockMode {
    /// One holder at a time.
    #[default]
    Exclusive,
    /// Any number of shared holders at once, and no exclusive one beside them.
    Shared,
    /// At most `n` holders at once, each with a lease (a permit) of its own.
    Counted(NonZeroU32),
}

impl LockMode {
    /// [`Counted`](LockMode::Counted) with `n` permits; `None` for `n = 0`, which no
    /// holder could ever get.
    pub const fn counted(n: u32) -> Option<LockMode> {
        match NonZeroU32::new(n) {
            Some(n) => Some(LockMode::Counted(n)),
            None => None,
        }
    }

    /// Whether this is [`Exclusive`](LockMode::Exclusive).
    pub const fn is_exclusive(&self) -> bool {
        matches!(self, LockMode::Exclusive)
    }

    /// The most holders at once: `n` of a counted mode, `None` otherwise.
    pub(crate) fn limit(&self) -> Option<NonZeroU32> {
        match self {
            LockMode::Counted(n) => Some(*n),
            _ => None,
        }
    }
}
