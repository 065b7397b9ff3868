//! The release script's calls: a lease's release, a waiter leaving the wait queue, and
//! the cleanup of a waiter's failed attempt (see [`Node::wait_queue`](crate::node::Node::wait_queue)).

use crate::node::redis::conn::SendOne;

use std::time::Duration;

use super::{int, parse_flag, Call, CallError, Op, ReplicaWait, Suffixed, LISTEN, RELEASE};
use crate::error::NodeError;
use crate::node::redis::millis_ceil;
use crate::node::{Owner, ResourceKeys, Waiter, CHANNEL_SUFFIX, HANDOFF_TTL, QUEUE_SUFFIX};

/// The owned arguments of one release call: compare-and-delete, then the hand-off to
/// the wait queue's next waiter, woken by `PUBLISH` on its own channel, or `SPUBLISH`
/// when `sharded` (Redis Cluster).
pub(crate) struct ReleaseCall(pub(super) Call);

impl ReleaseCall {
    pub(crate) fn new(keys: &ResourceKeys, owner: &Owner, sharded: bool) -> Self {
        let call = Call::new(&RELEASE, 2)
            .arg(&keys.lock)
            .arg(Suffixed(&keys.lock, QUEUE_SUFFIX))
            .arg(owner.as_str());
        // Redis charges every argument: a lease's own release on a standalone server
        // leaves out those whose default the script knows (the script's fast path).
        let usual_channel = keys.channel.len() == keys.lock.len() + CHANNEL_SUFFIX.len()
            && keys.channel.starts_with(&keys.lock)
            && keys.channel.ends_with(CHANNEL_SUFFIX);
        ReleaseCall(if sharded || !usual_channel {
            Self::with_defaults(call.arg(&keys.channel), sharded)
        } else {
            call
        })
    }

    /// A waiter leaving the queue: it is taken off, and a lock reserved for it is
    /// handed to the next waiter (the release of its reservation).
    pub(crate) fn leave(keys: &ResourceKeys, waiter: &Waiter, sharded: bool) -> Self {
        Self::of(keys, "", sharded, &waiter.id, "")
    }

    /// The release of a lease won by `waiter`'s attempt (see
    /// [`Node::release_as_waiter`](crate::node::Node::release_as_waiter)).
    pub(crate) fn as_waiter(
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
        sharded: bool,
    ) -> Self {
        Self::of(keys, owner.as_str(), sharded, &waiter.id, "")
    }

    /// The cleanup of a waiter's failed attempt: the key goes back to the waiter.
    pub(crate) fn hand_back(
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
        sharded: bool,
    ) -> Self {
        let back_to = format!("{}:{}", waiter.id, waiter.ticket);
        Self::of(keys, owner.as_str(), sharded, "", &back_to)
    }

    fn of(keys: &ResourceKeys, owner: &str, sharded: bool, leaving: &str, back_to: &str) -> Self {
        let call = Self::with_defaults(Self::common(keys, owner), sharded);
        ReleaseCall(call.arg(leaving).arg(back_to))
    }

    fn common(keys: &ResourceKeys, owner: &str) -> Call {
        Call::new(&RELEASE, 2)
            .arg(&keys.lock)
            .arg(Suffixed(&keys.lock, QUEUE_SUFFIX))
            .arg(owner)
            .arg(&keys.channel)
    }

    fn with_defaults(call: Call, sharded: bool) -> Call {
        call.arg(if sharded { "1" } else { "0" })
            .arg(millis_ceil(HANDOFF_TTL))
    }
}

/// Never waits for replicas: a release lost in a failover only delays the next holder
/// until the key expires.
impl Op for ReleaseCall {
    type Output = bool;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        _: Option<ReplicaWait>,
    ) -> Result<bool, CallError> {
        let value = self.0.run(conn, None, |_| false).await?;
        parse_flag(value).map_err(CallError::Reply)
    }
}

/// The listeners' mark on a resource's wait queue (`listen.lua`, see
/// [`Node::listen_for_release`](crate::node::Node::listen_for_release)).
pub(crate) struct ListenCall(pub(super) Call);

impl ListenCall {
    pub(crate) fn new(keys: &ResourceKeys, ttl: Duration) -> Self {
        ListenCall(
            Call::new(&LISTEN, 1)
                .arg(Suffixed(&keys.lock, QUEUE_SUFFIX))
                .arg(millis_ceil(ttl)),
        )
    }
}

/// Never waits for replicas: a mark lost in a failover only leaves the listeners to
/// their retry timer.
impl Op for ListenCall {
    type Output = ();

    async fn run<C: SendOne>(&self, conn: &mut C, _: Option<ReplicaWait>) -> Result<(), CallError> {
        let value = self.0.run(conn, None, |_| false).await?;
        int(&value).map(|_| ()).ok_or_else(|| {
            CallError::Reply(NodeError::Protocol(
                format!("listen script returned {value:?}").into(),
            ))
        })
    }
}
