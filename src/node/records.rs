//! Outcome records on one node: the wire types of idempotent replay.
//!
//! The protocol over a quorum of nodes (majorities, orphaned markers, why a lost
//! holder cannot overwrite a newer outcome) lives in [`lock::record`](crate::record);
//! this file holds only what one node receives and answers.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::error::NodeError;
use crate::node::{FencingToken, NodeFuture, Owner, ResourceKeys};

impl ResourceKeys {
    /// The key of the resource's outcome record: `{prefix}{<resource>}:record`, in the
    /// same hash slot as the lock key.
    pub fn record(&self) -> String {
        format!("{}:record", self.lock)
    }

    /// The key that remembers an interrupted attempt's token:
    /// `{prefix}{<resource>}:interrupted`, in the lock key's slot.
    pub fn interrupted(&self) -> String {
        format!("{}:interrupted", self.lock)
    }
}

/// A completed outcome stored under a resource: the fencing token of the lease that
/// produced it, the fingerprint of the request it answers, and opaque data.
#[derive(Clone, PartialEq, Eq)]
pub struct Record {
    token: FencingToken,
    fingerprint: Bytes,
    data: Bytes,
}

impl Record {
    /// A record, for [`Node`](crate::node::Node) implementations that read one back.
    pub fn new(token: FencingToken, fingerprint: Bytes, data: Bytes) -> Self {
        Record {
            token,
            fingerprint,
            data,
        }
    }

    /// The fencing token of the lease that stored it.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The fingerprint given when it was stored.
    pub fn fingerprint(&self) -> &Bytes {
        &self.fingerprint
    }

    /// The stored bytes.
    pub fn data(&self) -> &Bytes {
        &self.data
    }
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("token", &self.token)
            .field("fingerprint_len", &self.fingerprint.len())
            .field("data_len", &self.data.len())
            .finish()
    }
}

/// Arguments of [`RecordStore::claim_record`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The keys of the resource.
    pub keys: &'a ResourceKeys,
    /// The owner value the lock key must hold.
    pub owner: &'a Owner,
    /// The claiming lease's fencing token.
    pub token: u64,
    /// The fingerprint stored with the pending marker.
    pub fingerprint: &'a [u8],
    /// Time to live of the pending marker.
    pub pending_ttl: Duration,
    /// When an earlier holder's marker is found: shorten its time to live to this, once
    /// (`None`: leave it as it is).
    pub orphan_ttl: Option<Duration>,
    /// When an earlier holder's marker is found: remember its token this long, and
    /// report it to the claim that runs the work again
    /// ([`ClaimReply::ClaimedAfter`]); `None`: remember nothing.
    pub remember_interrupted: Option<Duration>,
}

/// One node's answer to [`RecordStore::claim_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimReply {
    /// The pending marker of this lease is stored (or already was).
    Claimed,
    /// As `Claimed`, and an earlier attempt with the token `interrupted` was found
    /// interrupted (its marker orphaned) within the time it is remembered.
    ClaimedAfter {
        /// The interrupted attempt's fencing token.
        interrupted: u64,
    },
    /// A completed record exists (whoever holds the lock).
    Completed(Record),
    /// An earlier holder's pending marker exists; it lives `pttl` more.
    Orphaned {
        /// The marker's remaining time to live.
        pttl: Option<Duration>,
    },
    /// The lock key does not hold the owner value: nothing was written.
    NotOwner,
}

/// Arguments of [`RecordStore::store_record`].
#[derive(Debug, Clone, Copy)]
pub struct StoreRequest<'a> {
    /// The keys of the resource.
    pub keys: &'a ResourceKeys,
    /// The owner value the lock key must hold.
    pub owner: &'a Owner,
    /// The record to store; its token orders it against an existing record.
    pub record: &'a Record,
    /// The record's time to live.
    pub retention: Duration,
}

/// One node's answer to [`RecordStore::store_record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreReply {
    /// The record replaced whatever the key held.
    Stored,
    /// A completed record with an equal or larger token exists; nothing was written.
    Superseded,
    /// The lock key does not hold the owner value: nothing was written.
    NotOwner,
}

/// A node's outcome records: what idempotent replay needs from a node besides the
/// lock. A [`Node`](crate::node::Node) that stores them hands this out from
/// [`Node::records`](crate::node::Node::records); each operation is atomic on the node.
pub trait RecordStore: Send + Sync {
    /// The completed record under the resource's record key, if any (a pending marker
    /// reads as none). Reads only; needs no lock.
    fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>>;

    /// Atomically: returns the completed record if one exists; else, unless the lock key
    /// holds `request.owner`, writes nothing ([`ClaimReply::NotOwner`]); else, when
    /// another token's pending marker exists, marks it orphaned (once: its ttl is cut to
    /// `orphan_ttl` if given) and returns its remaining ttl; else stores this token's
    /// pending marker with `pending_ttl`.
    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply>;

    /// Atomically: unless the lock key holds `request.owner`, writes nothing; when the
    /// very same record exists (a re-sent store), answers [`StoreReply::Stored`]; when
    /// another completed record with an equal or larger token exists, writes nothing;
    /// else replaces the record key with the completed record, ttl `retention`.
    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply>;

    /// Deletes the record key if it holds the pending marker of `token`. Returns whether
    /// it did.
    fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool>;
}

/// What the engine counts for a node without records (see [`Node::records`](crate::node::Node::records)).
pub(crate) fn unsupported() -> NodeError {
    NodeError::Unsupported("outcome records (idempotent replay)".into())
}
