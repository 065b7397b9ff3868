//! Fencing tokens that increase strictly from one holder of a resource to the next,
//! across a quorum of independent nodes.
//!
//! A lock alone cannot protect a resource from a holder that was paused (GC, swap,
//! a stopped VM) past its lease: when it wakes up it still believes it holds the lock.
//! The storage it writes to must reject such a late write, and for that it needs a
//! number that only grows: the fencing token (Kleppmann, *How to do distributed
//! locking*). Pass [`FencingToken`] along with every write and let the storage accept a
//! write only when its token is greater than the last one it accepted.
//!
//! # How the token is made
//!
//! Each node keeps a counter per resource next to the lock key
//! (`{prefix}{<resource>}:fence`).
//!
//! 1. Every acquire attempt sends, in one round trip, `SET lock owner NX PX ttl`,
//!    `SET fence <seed> NX PX fence_ttl` and `INCR fence`. The seed is the acquiring
//!    client's clock in milliseconds × 2¹⁰, and only lands when the counter is missing
//!    (first use, expired, node restarted empty). `INCR` also runs when the lock is held
//!    by someone else: such increments are never handed out as tokens and only make
//!    later tokens larger.
//! 2. The token is the maximum of the counters returned by the acquiring majority.
//! 3. Write-back: the counter of every acquiring node that returned less is raised to
//!    the token (`raise_fence`), and the lease counts only if a majority holds the token
//!    within the validity. When all acquiring nodes returned the same value — the steady
//!    state once counters have converged — there is nothing to raise and acquisition
//!    stays one round trip.
//!
//! Plain commands rather than one script: a script call costs Redis several times a
//! `SET`, and on unique resources (idempotency keys) every acquisition meets a fresh
//! counter, so the seeding path is the hot path.
//!
//! # Why it works
//!
//! Let a lease with token `t` be granted with majority `M`. After the write-back, every
//! node of a majority `M' ⊆ M` has counter ≥ `t`. A later holder's majority `M''`
//! intersects `M'` in at least one node (two majorities of the same nodes always
//! intersect). On that node the later acquire increments a counter that is already
//! ≥ `t`, so it returns > `t`, and the later token, a maximum, is > `t`.
//!
//! A counter that disappears is re-created from a clock. Every counter value ever
//! handed out is at most `seeded_ms × 2¹⁰ + increments since then`, so a counter
//! re-created later at `now_ms × 2¹⁰` is larger as long as fewer than 1,024 increments
//! per millisecond were made on average on that resource (a single lock cannot come
//! near that: each acquisition is a network round trip and mutual exclusion) and the
//! clocks involved are not set back by more than the time between the two seedings.
//! Tokens stay below 2⁵³ until the year 2248, so they are exact in Lua's numbers and
//! in JavaScript/JSON consumers.
//!
//! # Assumptions and failure modes
//!
//! - **Redlock's own assumptions**: clocks on the nodes advance at about the same rate
//!   (bounded drift, covered by the drift allowance `ttl × drift_factor + 2 ms`), and a
//!   node does not lose keys while they should live. A node restarted *empty* (no
//!   persistence) before the ttl has passed can let a second holder in while the first
//!   still holds a valid lease: run nodes with `appendonly yes` and `appendfsync always`,
//!   or delay the restart by one ttl (Redlock's "delayed restart"). Fencing still orders
//!   the two holders if the restarted node re-creates its counter from the clock, so a
//!   storage that checks the token rejects the older holder.
//! - **Application clocks must not lag.** A re-created counter starts from the clock of
//!   the client that re-creates it. A client whose clock is behind the client that
//!   seeded the lost counter by more than the time since that seeding could restart
//!   below earlier tokens. Counters are lost only when a node restarts empty or when
//!   [`LockOptions::fence_ttl`](crate::LockOptions::fence_ttl) passes, so keep the
//!   application hosts' clocks in sync (NTP in slew mode) to well within a lock ttl.
//! - **The counter's own lifetime** ([`LockOptions::fence_ttl`](crate::LockOptions::fence_ttl),
//!   one hour from its creation by default) only bounds memory: when it expires the
//!   counter is re-created from the clock, which is still above every earlier token.
//! - **The storage must check the token.** A token the storage ignores protects nothing.

use std::fmt;

/// A number that increases strictly from one holder of a resource to the next.
///
/// Compare tokens of the same resource only. Display prints the decimal value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw value, for storages that read tokens back.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}

/// The least token a round started at `unix_ms` may hand out: the clock in ms × 2¹⁰.
pub(crate) fn floor(unix_ms: u64) -> u64 {
    unix_ms.saturating_mul(1024)
}

/// The wall clock in ms since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
