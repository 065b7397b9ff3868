//! What tests that call a node directly (its connection, its order of commands) need
//! from outside the crate: owner values, a resource's keys, and the calls' arguments.

use std::time::Duration;

use tower_redlock::node::{Acquire, Hold, Owner, ResourceKeys, Vote};
use tower_redlock::{LockMode, LockOptions, MemoryNode, Redlock};

/// One lease's owner value, to be taken on as many node indices as a test has callers
/// (`Owner::for_node`), as tests outside the crate can make them.
pub async fn owners() -> Owner {
    let locker = Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap();
    let lease = locker.try_acquire("owners").await.unwrap();
    lease.handle().owner_on(0)
}

/// The keys of the lock key `lock`, named as the crate names them.
pub fn keys(lock: String) -> ResourceKeys {
    ResourceKeys {
        fence: format!("{lock}:fence"),
        channel: format!("{lock}:released"),
        lock,
    }
}

/// An acquire of `keys` by `owner` in `mode`, with the settings these tests use: ttl
/// 10 s, fence counters for an hour, fencing on with floor 1, no waiter.
pub fn acquire<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Acquire<'a> {
    Acquire {
        keys,
        owner,
        mode,
        ttl: Duration::from_secs(10),
        fencing: true,
        fence_ttl: Duration::from_secs(3600),
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter: None,
    }
}

/// What `owner` holds of `keys` in `mode`, for extend and release.
pub fn hold<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Hold<'a> {
    Hold { keys, owner, mode }
}

/// Whether a vote granted every key.
pub fn granted(vote: &Vote) -> bool {
    matches!(vote, Vote::Granted { .. })
}
