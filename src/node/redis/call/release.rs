//! The release call: one hold of one resource or of a set (exclusive or shared alike),
//! with what it does for a waiter, and the listeners' mark on a wait queue.

use std::time::Duration;

use super::{int, parse_flag, returned, Call, ScriptOp, Suffixed, LISTEN, RELEASE};
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

/// One release call (`release.lua`): compare-and-delete of each key, then the hand-off
/// to its wait queue's next waiter, woken by `PUBLISH` on its own channel, or `SPUBLISH`
/// when `sharded` (Redis Cluster). `shared`: the hold is a shared holder's (an exclusive
/// release never touches those, nor a shared one a lock key's string). Answers whether
/// every key was ours.
pub(crate) fn release(
    keys: &[ResourceKeys],
    owner: &str,
    hand: Hand<'_>,
    shared: bool,
    sharded: bool,
) -> ScriptOp<bool> {
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
        return ScriptOp::new(call, None, parse_flag);
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
    ScriptOp::new(call, None, parse_flag)
}

/// The listeners' mark on a resource's wait queue (`listen.lua`, see
/// [`Node::listen_for_release`](crate::node::Node::listen_for_release)).
pub(crate) fn listen(keys: &ResourceKeys, ttl: Duration) -> ScriptOp<()> {
    let call = Call::new(&LISTEN, 1)
        .arg(Suffixed(&keys.lock, QUEUE_SUFFIX))
        .arg(millis_ceil(ttl));
    ScriptOp::new(call, None, |value| {
        int(&value)
            .map(|_| ())
            .ok_or_else(|| returned("listen script", &value))
    })
}
