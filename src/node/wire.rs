//! The request and reply shapes the Redis operations (`node/redis/call/`) are built
//! from: the per-shape calls of the node API before [`Acquire`](super::Acquire) and
//! [`Hold`](super::Hold). `node/redis/node.rs` maps the node calls onto them; they go
//! once the operations take the new shapes.

#![allow(dead_code)]

use std::time::Duration;

use crate::node::{LockMode, Owner, ResourceKeys, Waiter};

/// The shared modes, as the operations name them.
pub(crate) type SharedMode = LockMode;

#[derive(Debug, Clone, Copy)]
pub(crate) struct AcquireRequest<'a> {
    pub(crate) keys: &'a ResourceKeys,
    pub(crate) owner: &'a Owner,
    pub(crate) ttl: Duration,
    pub(crate) fence_ttl: Duration,
    pub(crate) fencing: bool,
    pub(crate) fence_floor: u64,
    #[doc(hidden)]
    pub(crate) seed_only_when_missing: bool,
    pub(crate) waiter: Option<&'a Waiter>,
}

#[derive(Debug, Clone)]
pub(crate) struct ExtendEntry<'a> {
    pub(crate) keys: &'a ResourceKeys,
    pub(crate) owner: Owner,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireReply {
    Acquired { fence: u64 },
    Held { pttl: Option<Duration> },
    OtherMode { held: SharedMode },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct AcquireSetRequest<'a> {
    pub(crate) keys: &'a [ResourceKeys],
    pub(crate) owner: &'a Owner,
    pub(crate) ttl: Duration,
    pub(crate) fence_ttl: Duration,
    pub(crate) fencing: bool,
    pub(crate) fence_floor: u64,
    #[doc(hidden)]
    pub(crate) seed_only_when_missing: bool,
}

impl<'a> AcquireSetRequest<'a> {
    pub(crate) fn member(&self, keys: &'a ResourceKeys) -> AcquireRequest<'a> {
        AcquireRequest {
            keys,
            owner: self.owner,
            ttl: self.ttl,
            fence_ttl: self.fence_ttl,
            fencing: self.fencing,
            fence_floor: self.fence_floor,
            seed_only_when_missing: self.seed_only_when_missing,
            waiter: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AcquireSetReply {
    Acquired {
        fences: Vec<u64>,
    },
    Held {
        member: usize,
        pttl: Option<Duration>,
    },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedRequest<'a> {
    pub(crate) keys: &'a ResourceKeys,
    pub(crate) owner: &'a Owner,
    pub(crate) mode: SharedMode,
    pub(crate) ttl: Duration,
    pub(crate) fence_ttl: Duration,
    pub(crate) fencing: bool,
    pub(crate) fence_floor: u64,
}
