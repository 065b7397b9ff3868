//! [`LockMode`]: how a lease shares its resource.

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
/// overlapping shared holders are not ordered (the argument is on `node::SharedModes`).
///
/// The shared holders of a resource hold it in one mode: readers, or permits of one
/// `n`. A caller in another mode (another `n`, a reader among permits, a permit among
/// readers) is refused with [`LockError::ModeMismatch`](crate::LockError::ModeMismatch)
/// naming both, however much room is left, so no holder ever holds the resource beside
/// more holders than its own `n` allows. To change a limit in a rolling deploy, drain
/// the instances holding the old one ([`Redlock::drain`](crate::Redlock::drain)) before
/// the new one takes leases: while old holders live, the new `n` is refused (the layer
/// answers 503 `lock-unavailable`), and once they are gone the first new holder sets it.
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
}

impl From<crate::node::SharedMode> for LockMode {
    fn from(mode: crate::node::SharedMode) -> Self {
        match mode {
            crate::node::SharedMode::Shared => LockMode::Shared,
            crate::node::SharedMode::Counted(n) => LockMode::Counted(n),
        }
    }
}
