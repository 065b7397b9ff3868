//! Guarded writes: the storage itself refuses a write made under a stale
//! [`FencingToken`].
//!
//! A token protects nothing until the storage checks it (see [`fencing`](crate::fencing)
//! for why tokens grow and [the walk-through there](crate::fencing#where-the-token-is-checked)
//! for a paused holder end to end). This module is that check for the stores
//! applications write to:
//!
//! - [`postgres`] (feature `postgres`, through sqlx): one statement in the application's
//!   own transaction advances the resource's *fence* (a row in a fence table) to the
//!   lease's token, or fails with [`FenceError::Stale`]; the transaction that fails it
//!   commits nothing;
//! - [`redis`](mod@crate::fence::redis) (feature `redis`, any redis-rs connection): one
//!   script sets a value (a string, or hash fields) only if the token is not below the
//!   one stored for it.
//!
//! PostgreSQL's fences are the resources': [`postgres::advance`] takes whatever holds
//! the tokens ([`Fenced`]), one fence per member of a set. A Redis value has a fence of
//! its own, beside its key.
//!
//! # The rule
//!
//! A fence stores the largest token that wrote through it. A write under token `t` is
//! accepted when `t ≥` the stored token (the fence moves to `t`; a second write under
//! the same lease finds its own token there and is accepted too), and refused with
//! [`FenceError::Stale`] carrying the stored token when that token is larger: a later
//! holder has written, so this holder's lease ran out while it was paused.
//!
//! # Writers only
//!
//! A fence orders writers, and only an exclusive lease is one. What a token orders
//! depends on the mode it was granted in (see [`LockMode`]):
//!
//! | mode | its token is ordered against | at a write fence |
//! |---|---|---|
//! | [`LockMode::Exclusive`] | every holder before and after it, in any mode: none overlaps it | passes (or [`FenceError::Stale`]) |
//! | [`LockMode::Shared`] | writers only: readers that overlap may hold equal tokens, in either order | refused, [`FenceError::NotExclusive`] |
//! | [`LockMode::Counted`] | writers only: up to `n` holders at once, tokens unordered among them | refused, [`FenceError::NotExclusive`] |
//!
//! Two overlapping shared holders would both pass a fence (their tokens may be equal)
//! and both write, or the later-granted one would be told `Stale` while it is valid: a
//! fence cannot tell one from the other. So [`postgres::advance`]
//! and [`redis`](mod@crate::fence::redis)'s writes refuse a holder whose
//! [`Fenced::mode`] is not exclusive, before anything is sent. Take the lock
//! exclusively to write.

use crate::{FencingToken, Lease, LeaseHandle, LockMode, Resource};

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;

/// Why a guarded write was refused.
///
/// `E` is the store's own error ([`sqlx::Error`], [`redis::RedisError`](::redis::RedisError)).
#[derive(Debug, thiserror::Error)]
pub enum FenceError<E> {
    /// The fence holds a larger token than this write's: a later holder of the lock has
    /// written, so this holder's lease is over (it was paused, or its lease was lost).
    /// Do not retry with the same token: acquire the lock again, read the current state
    /// and decide again.
    #[error(
        "stale fencing token {token} for {fence}: the fence is at {current}, a later holder \
         of the lock has written; nothing of this write was applied"
    )]
    Stale {
        /// The fence that refused: the resource's encoded name (PostgreSQL), or the key
        /// written (Redis).
        fence: String,
        /// The token this write carried.
        token: FencingToken,
        /// The token the fence holds, larger than `token`.
        current: FencingToken,
    },
    /// The token does not fit the store's number type (PostgreSQL's `bigint`: tokens
    /// reach 2⁶³ in the year ~287,000 with a correct clock; a clock set that far ahead
    /// yields them). Refused before anything is sent: a token is never wrapped.
    #[error("fencing token {token} does not fit a signed 64-bit integer (bigint); refused, never wrapped")]
    OutOfRange {
        /// The token refused.
        token: FencingToken,
    },
    /// The holder is not exclusive ([`LockMode::Shared`], [`LockMode::Counted`]): others
    /// may hold the resource beside it, so its token does not order its writes (see
    /// [Writers only](self#writers-only)). Nothing was sent. Take the lock exclusively
    /// to write.
    #[error(
        "a {mode:?} lease cannot pass a write fence: holders beside it may hold the same \
         or a larger token; take the lock exclusively to write; nothing was sent"
    )]
    NotExclusive {
        /// The mode the holder holds the resource in.
        mode: LockMode,
    },
    /// The store failed (connection, permissions, a serialization failure…). Whatever
    /// the transaction did is for the application to roll back or retry.
    #[error("the store failed: {0}")]
    Store(#[source] E),
}

impl<E> FenceError<E> {
    /// `true` for [`FenceError::Stale`].
    pub fn is_stale(&self) -> bool {
        matches!(self, FenceError::Stale { .. })
    }

    /// The token stored in the fence when the write was refused as stale.
    pub fn current(&self) -> Option<FencingToken> {
        match self {
            FenceError::Stale { current, .. } => Some(*current),
            _ => None,
        }
    }
}

/// Something that holds fencing tokens: one per resource it holds.
///
/// Implemented for the crate's leases ([`Lease`], [`LeaseHandle`]), the request's leases
/// ([`RequestLeases`](crate::http::RequestLeases)), the axum extractors (`LayerLease`,
/// `Locked<K>`) and a `(Resource, FencingToken)` pair (a token read back, say from
/// [`InterruptedAttempt`](crate::http::InterruptedAttempt)).
///
/// ```
/// use tower_redlock::fence::Fenced;
/// use tower_redlock::{FencingToken, Resource};
///
/// let pair = (Resource::from("order:42"), FencingToken::new(7));
/// assert_eq!(pair.tokens(), vec![(Resource::from("order:42"), FencingToken::new(7))]);
/// ```
pub trait Fenced {
    /// Each resource held with its token; empty when nothing is held.
    fn tokens(&self) -> Vec<(Resource, FencingToken)>;

    /// How the resources are held: a write fence takes only
    /// [`LockMode::Exclusive`] (see [Writers only](self#writers-only)). A holder of
    /// several leases answers the first of them that is not exclusive.
    fn mode(&self) -> LockMode;
}

impl Fenced for LeaseHandle {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        self.fencing_tokens()
            .map(|(resource, token)| (resource.clone(), token))
            .collect()
    }

    fn mode(&self) -> LockMode {
        LeaseHandle::mode(self)
    }
}

impl Fenced for Lease {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        (**self).tokens()
    }

    fn mode(&self) -> LockMode {
        LeaseHandle::mode(self)
    }
}

/// A token carried apart from its lease: the pair says it is an exclusive holder's
/// (take it from one).
impl Fenced for (Resource, FencingToken) {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        vec![self.clone()]
    }

    fn mode(&self) -> LockMode {
        LockMode::Exclusive
    }
}

impl<T: Fenced + ?Sized> Fenced for &T {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        (**self).tokens()
    }

    fn mode(&self) -> LockMode {
        (**self).mode()
    }
}

/// The tokens of `held` for a write fence: refused unless it holds exclusively.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn writer_tokens<E>(
    held: &(impl Fenced + ?Sized),
) -> Result<Vec<(Resource, FencingToken)>, FenceError<E>> {
    match held.mode() {
        LockMode::Exclusive => Ok(held.tokens()),
        mode => Err(FenceError::NotExclusive { mode }),
    }
}

/// The token as PostgreSQL's `bigint` (or any signed 64-bit column), refused rather
/// than wrapped above `i64::MAX`: for a row that carries its own fence column (see
/// "A row's own fence column" in `fence::postgres`, feature `postgres`). `?` turns the
/// refusal into [`FenceError::OutOfRange`] for any store error.
///
/// ```
/// use tower_redlock::fence::{self, OutOfRange};
/// use tower_redlock::FencingToken;
///
/// assert_eq!(fence::to_i64(FencingToken::new(42)).unwrap(), 42);
/// let huge = FencingToken::new(u64::MAX);
/// assert_eq!(fence::to_i64(huge), Err(OutOfRange(huge)));
/// ```
pub fn to_i64(token: FencingToken) -> Result<i64, OutOfRange> {
    i64::try_from(token.get()).map_err(|_| OutOfRange(token))
}

/// A token that does not fit a signed 64-bit integer ([`to_i64`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("fencing token {0} does not fit a signed 64-bit integer (bigint); refused, never wrapped")]
pub struct OutOfRange(pub FencingToken);

impl<E> From<OutOfRange> for FenceError<E> {
    fn from(OutOfRange(token): OutOfRange) -> Self {
        FenceError::OutOfRange { token }
    }
}
