//! What tests that call a node directly (its connection, its order of commands) need
//! from outside the crate: owner values and a resource's keys.

use tower_redlock::node::{Owner, ResourceKeys};
use tower_redlock::{LockOptions, MemoryNode, Redlock};

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
