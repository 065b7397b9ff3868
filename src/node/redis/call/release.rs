//! The release call: one hold of one resource or of a set (exclusive or shared alike),
//! with what it does for a waiter (see [`Node::wait_queue`](crate::node::Node::wait_queue)),
//! and the listeners' mark on a wait queue.

use crate::node::redis::conn::SendOne;

use std::time::Duration;

use super::{int, parse_flag, Call, CallError, Op, ReplicaWait, Suffixed, LISTEN, RELEASE};
use crate::error::NodeError;
use crate::node::redis::millis_ceil;
use crate::node::{ResourceKeys, Waiter, CHANNEL_SUFFIX, HANDOFF_TTL, QUEUE_SUFFIX};

/// What a release does for a waiter besides compare-and-delete.
#[derive(Clone, Copy)]
pub(crate) enum Hand<'a> {
    /// Nothing: a lease's own release (the key goes to the queue's next waiter).
    Next,
    /// The release of a lease won by `waiter`'s attempt, or, with no owner, the waiter
    /// leaving the queue: it is taken off, and a key reserved for it counts as its key.
    Leaving(&'a Waiter),
    /// The cleanup of a waiter's failed attempt: the key goes back to the waiter.
    Back(&'a Waiter),
}

/// The owned arguments of one release call (`release.lua`): compare-and-delete of each
/// key, then the hand-off to its wait queue's next waiter, woken by `PUBLISH` on its
/// own channel, or `SPUBLISH` when `sharded` (Redis Cluster).
pub(crate) struct ReleaseCall(pub(super) Call);

impl ReleaseCall {
    /// `shared`: the hold is a shared holder's (an exclusive release never touches
    /// those, nor a shared one a lock key's string).
    pub(crate) fn new(
        keys: &[ResourceKeys],
        owner: &str,
        hand: Hand<'_>,
        shared: bool,
        sharded: bool,
    ) -> Self {
        let mut call = Call::new(&RELEASE, 2 * keys.len());
        for member in keys {
            call = call
                .arg(&member.lock)
                .arg(Suffixed(&member.lock, QUEUE_SUFFIX));
        }
        call = call.arg(owner);
        // Redis charges every argument: a lease's own release of one resource on a
        // standalone server leaves out those whose default the script knows (the
        // script's fast path).
        let usual_channel = |keys: &ResourceKeys| {
            keys.channel.len() == keys.lock.len() + CHANNEL_SUFFIX.len()
                && keys.channel.starts_with(&keys.lock)
                && keys.channel.ends_with(CHANNEL_SUFFIX)
        };
        if let ([member], Hand::Next, false, false) = (keys, hand, shared, sharded)
            && usual_channel(member)
        {
            return ReleaseCall(call);
        }
        let (leaving, back_to) = match hand {
            Hand::Next => (None, None),
            Hand::Leaving(waiter) => (Some(waiter.id.as_str()), None),
            Hand::Back(waiter) => (None, Some(format!("{}:{}", waiter.id, waiter.ticket))),
        };
        call = call
            .arg(if sharded { "1" } else { "0" })
            .arg(millis_ceil(HANDOFF_TTL))
            .arg(leaving.unwrap_or(""))
            .arg(back_to.as_deref().unwrap_or(""))
            .arg(if shared { "1" } else { "0" });
        for member in keys {
            call = call.arg(&member.channel);
        }
        ReleaseCall(call)
    }

    /// A waiter leaving the queue: it is taken off, and a lock reserved for it is
    /// handed to the next waiter (the release of its reservation).
    pub(crate) fn leave(keys: &ResourceKeys, waiter: &Waiter, sharded: bool) -> Self {
        Self::new(
            std::slice::from_ref(keys),
            "",
            Hand::Leaving(waiter),
            false,
            sharded,
        )
    }
}

/// Answers whether every key was ours. Never waits for replicas: a release lost in a
/// failover only delays the next holder until the key expires.
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
