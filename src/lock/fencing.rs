//! Fencing tokens that increase strictly from one holder of a resource to the next,
//! across a quorum of independent nodes.
//!
//! A lock alone cannot protect a resource from a holder that was paused (GC, swap,
//! a stopped VM) past its lease: when it wakes up it still believes it holds the lock.
//! The storage it writes to must reject such a late write, and for that it needs a
//! number that only grows: the fencing token (Kleppmann, *How to do distributed
//! locking*). Pass [`FencingToken`](crate::FencingToken) along with every write and let the storage accept a
//! write only when its token is greater than the last one it accepted.
//!
//! # How the token is made
//!
//! Each node keeps a counter per resource next to the lock key
//! (`{prefix}{<resource>}:fence`).
//!
//! 1. The locker reads the acquiring client's clock **once per round** and sends every
//!    node the same *floor*: `floor = clock_ms × 2¹⁰`.
//! 2. Every node runs `SET lock owner NX PX ttl` and the counter's step: the counter
//!    becomes `max(counter + 1, floor)` (just `floor` when missing), its ttl is
//!    refreshed to `fence_ttl`, and a node that set the key answers that value; one
//!    that finds the key held answers the holder's ttl. (On Redis a caller that does
//!    not wait pipelines the `SET` and the step, so a refused caller's step moves the
//!    counter too: only up, and by no more than a grant would, so the argument below
//!    holds as it is.)
//! 3. The token is the maximum of the values answered by the acquiring majority.
//! 4. Write-back: the counter of every acquiring node that answered less is raised to
//!    the token (`raise_fences`), and the lease counts only if a majority holds the token
//!    within the validity. When all acquiring nodes answered the same value there is
//!    nothing to raise and acquisition stays one round trip.
//!
//! A lease over a set of resources ([`Redlock::try_acquire_all`](crate::Redlock::try_acquire_all))
//! runs the same steps per member, inside one call per node; nothing in the argument
//! below depends on the other members, so it holds for each member.
//!
//! ## Whose clock, and why a floor
//!
//! A counter that is merely *missing* could be re-created from a clock, but a counter
//! can also come back *present but behind*: a node restarted from an RDB snapshot (Redis
//! takes them by default), an AOF `everysec` log that lost its last second, a restored
//! backup, a replica promoted before it received the latest writes. Trusting such a
//! counter hands out tokens that were already issued. The floor, hybrid-logical-clock
//! style, makes a counter that is behind be overtaken instead of trusted.
//!
//! The floor comes from the **acquiring client's clock**, not from each server's `TIME`:
//!
//! - one value for all nodes of a round keeps their counters converged: in the steady
//!   state (fewer than one acquisition per millisecond and resource, or counters already
//!   equal) every node answers the same token, so no write-back round trip is needed;
//!   floors from N server clocks would differ on every round and force one;
//! - it does not depend on the clock of the very node whose state is stale (a restored
//!   machine or a promoted replica is exactly the one whose clock is least trusted).
//!
//! # Why it works
//!
//! *Counters.* Let a lease with token `t` be granted with majority `M`. After the
//! write-back, every node of a majority `M' ⊆ M` has counter ≥ `t`. A later holder's
//! majority `M''` intersects `M'` in at least one node (two majorities of the same nodes
//! always intersect). If that node kept its counter, the later round there answers
//! ≥ counter + 1 > `t`, and the later token, a maximum, is > `t`.
//!
//! *Floor.* If that node lost its counter or came back with an older one, the later
//! round there still answers ≥ its floor. Counters only move by `+1` per attempt (a
//! grant, or a refused caller's pipelined step) or by a jump to a floor, so with fewer
//! than 2¹⁰ = 1,024 attempts per millisecond on a resource every token issued up to clock millisecond `m` is below
//! `(m + 1) × 2¹⁰`, the floor of every round whose clock reads later than `m`. So the
//! later token is > `t` as long as the later round's clock reads past the millisecond in
//! which `t` was issued.
//!
//! Tokens stay below 2⁵³ until the year 2248, so they are exact in Lua's numbers and in
//! JavaScript/JSON consumers. The scripts compare numbers below 2⁵³ only; they increment
//! with `INCR` and store the floor as the decimal string they were sent, so Lua never
//! formats a large number.
//!
//! # Assumptions and failure modes
//!
//! - **Application clocks within ε of each other.** The floor of a round is only as good
//!   as the clock that computed it. With the application hosts' clocks within ε of each
//!   other (NTP in slew mode: a few ms), the argument above holds for every token issued
//!   more than ε (+ 1 ms) before the round.
//! - **A token lost by a stale node was issued more than ε before that node answers
//!   again.** A restart, a restore and a Sentinel failover (`down-after-milliseconds`)
//!   take seconds, far more than ε; a node that could lose a write and answer again
//!   within ε would break the argument. The same holds for rounds in flight: a round
//!   reads its floor once, and a call re-sent after a reconnect carries it, so a node
//!   that lost writes must not answer again within one node timeout of losing them
//!   (else a round whose floor was read just before the loss may be answered with a
//!   token the lost tail held; seen in the fault suite with an instant restart).
//! - **Fewer than 1,024 attempts per millisecond per resource and node**, on average
//!   since the counter last jumped to a floor. A single lock cannot come near that: each
//!   grant is a network round trip under mutual exclusion, and refused attempts are
//!   bounded by the server (a Redis server serves a few hundred thousand commands a
//!   second in all, three per attempt; 1,024 per millisecond would be a million). Above
//!   it the counters run ahead of the clock; that is safe, but a counter lost then may
//!   restart below them.
//! - **A clock stepped back** by δ lowers its floors by δ × 2¹⁰. Counters that were kept
//!   still give `counter + 1`, larger than every earlier token: only a round in which a
//!   stale node is the sole intersection with an earlier majority, and whose tokens were
//!   issued within δ + ε, can repeat a token. A clock stepped far *forward* is harmless to
//!   the order but raises every later token (toward 2⁵³ if set centuries ahead).
//! - **Redlock's own assumptions** still govern *exclusion* (one valid lease at a time):
//!   clocks on the nodes advance at about the same rate (bounded drift, covered by the
//!   drift allowance `ttl × drift_factor + 2 ms`), and a node does not lose a lock key
//!   while it should live. The table below says which persistence modes keep that.
//! - **The counter's own lifetime** ([`LockOptions::fence_ttl`](crate::LockOptions::fence_ttl),
//!   one hour from the last acquisition by default) only bounds memory: when it expires
//!   the counter is re-created at the floor, still above every earlier token.
//! - **The storage must check the token.** A token the storage ignores protects nothing
//!   (see [Where the token is checked](#where-the-token-is-checked)).
//!
//! # What each persistence mode guarantees
//!
//! *Exclusion* (at most one valid lease per resource at a time) depends on the nodes'
//! persistence; *fencing* (every token larger than every earlier one) holds under every
//! mode, which is the point of the token: when two holders overlap, the storage accepts
//! the newer one's writes and rejects the older one's. The table, mode by mode, with and
//! without `wait_replicas`, is in the [safety guide](crate::guide::safety).
//!
//! An etcd node (feature `etcd`, `EtcdNode`) needs none of this: its token is the lock
//! key's create revision, a cluster-wide counter kept by consensus that never comes back
//! behind, so it ignores the floor and the write-back never runs (it is a locker's only
//! node).
//!
//! # Where the token is checked
//!
//! Tokens protect nothing until the store refuses a smaller one: the lock cannot stop a
//! holder that does not know it lost it. [`fence`](crate::fence) is that check for
//! PostgreSQL and Redis, with examples; a paused holder, end to end:
//!
//! 1. A acquires `invoice:7` with token 1000, reads, and pauses (GC, swap, a stopped
//!    VM) for longer than its ttl. Its lease expires; it does not know.
//! 2. B acquires `invoice:7`: its token is larger than 1000 (the argument above, even
//!    if nodes came back from stale snapshots), say 1500. B's transaction advances the
//!    fence to 1500, writes, commits.
//! 3. A wakes up and writes under 1000. Its transaction's fence statement finds 1500:
//!    `Stale { current: 1500 }`. A rolls back; nothing of its transaction lands, B's
//!    write stays. A's correct reaction is to give up this attempt: acquire again, read
//!    the current state, decide again.
//!
//! Without step 3's check, A's late write would silently overwrite B's: the lock alone
//! gives exclusion only while every holder stays within its lease.

/// The floor one acquisition round sends every node (for one resource or a set): read
/// once per round, as equal floors keep the nodes' counters equal; 0 without fencing,
/// when no node reads it and the wall clock is not read for it.
pub(crate) fn round_floor(fencing: bool) -> u64 {
    if fencing {
        floor(unix_ms())
    } else {
        0
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
