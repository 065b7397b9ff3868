//! Outcome records: an opaque result stored next to a resource's lock, written only by
//! the current holder, for idempotent replay.
//!
//! The engine stores bytes; what they mean (an HTTP response, a job result) is the
//! caller's business. The HTTP layer's [`Replay`](crate::http::replay::Replay) is built on it.
//!
//! # The record key and its two states
//!
//! Each resource has one record key per node, `{prefix}{<resource>}:record`, in the
//! same Redis Cluster slot as the lock key. It holds either
//!
//! - a **pending marker** (`token`, `fingerprint`): a holder claimed the resource and its
//!   work is under way, or was interrupted; or
//! - a **completed record** (`token`, `fingerprint`, `data`): the outcome of the work.
//!
//! # Protocol
//!
//! 1. [`Redlock::read_record`] — no lock needed: a completed record is immutable for its
//!    retention, so a caller that finds one can use it without locking (the fast path).
//! 2. After acquiring the lock, [`Lease::claim_record`] runs on every node, atomically:
//!    a completed record is returned; a pending marker of an *earlier* holder means that
//!    holder lost its lease (or was dropped) before it wrote an outcome, so the outcome
//!    is **unknown** — the marker is stamped as orphaned and, unless asked to keep it
//!    for its whole retention, expires after the configured time, after which the work
//!    may run again; otherwise the node stores this lease's pending marker.
//! 3. When the work is done, [`Lease::store_record`] writes the completed record, or
//!    [`Lease::discard_record`] removes this lease's marker (an outcome not worth
//!    keeping, such as a server error a retry may fix).
//!
//! # Why a lost holder cannot overwrite a newer outcome
//!
//! Every claim and store runs as one script on the node, and writes only if the lock
//! key still holds **this lease's owner value** (`GET lock == owner`). That is the
//! precise check: on that node, at that moment, nobody else holds the resource. The
//! fence counter cannot serve here: it is incremented by every acquire *attempt*,
//! including failed ones by contenders, so it may exceed the holder's token while the
//! holder is still perfectly valid. A store counts only when a majority of nodes
//! accepted it before the lease's validity ran out; by Redlock's own assumption no
//! other lease can exist during that validity, so no two holders can both store.
//!
//! # Pending markers count at a majority; a completed record anywhere
//!
//! A store and a claim's pending markers count at a majority, as a lock does. A
//! completed record is written only after the work ran and never changed after, so any
//! copy of it, on any node, is the outcome of an execution that happened: a read and a
//! claim take the newest record **any** node holds, waiting for every node's answer
//! (within the node timeout), and a claim writes it back (as a store, for its
//! `pending_ttl`) to the nodes that lack it. Records are as durable as the nodes'
//! persistence otherwise (see [replay's guide](crate::guide::replay)).

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::error::{ConfigError, NodeError};
use crate::lock::lease::{Lease, LeaseHandle, LeaseInner, LostCause};
use crate::lock::{metrics, quorum, LockError, Redlock};
use crate::node::{unsupported, ClaimReply, ClaimRequest, Node, NodeFuture, Record, RecordStore};
use crate::node::{FencingToken, Resource, ResourceKeys, StoreReply, StoreRequest};

mod nodes;

pub(crate) use nodes::discard_owned;
use nodes::{bounded_by_validity, discard_in_background, records_of, store_on_nodes, write_back};

/// What [`Lease::claim_record`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// No outcome and no interrupted attempt: the work is this lease's to do. A pending
    /// marker now says so; end it with [`Lease::store_record`] or
    /// [`Lease::discard_record`].
    Claimed,
    /// The work was done already: here is its outcome.
    Completed(Record),
    /// As [`Claimed`](Claim::Claimed), after an earlier attempt at the work was
    /// interrupted (its lease lost, its process gone) and its outcome left unknown: the
    /// work is this lease's to do, and it should first find out, in its own store,
    /// whether the attempt with the token `interrupted` took effect (a charge made, a
    /// row written), rather than repeat it. Reported while the interruption is
    /// remembered (the claim's `remember_interrupted`, 24 hours for
    /// [`Lease::claim_record`]); nodes that cannot remember it (etcd) answer
    /// `Claimed`.
    Reclaimed {
        /// The fencing token of the interrupted attempt.
        interrupted: FencingToken,
    },
    /// An earlier holder started the work and never recorded an outcome (its lease was
    /// lost, or it was dropped mid-way): whether its effects happened is unknown.
    Unknown {
        /// How long this answer stands (the orphaned marker's remaining time to live);
        /// after that, a claim succeeds again.
        retry_after: Option<Duration>,
    },
}
/// How long [`Lease::claim_record`] has the nodes remember an interrupted attempt's
/// token for the claim that runs the work again ([`Claim::Reclaimed`]): 24 hours.
pub(crate) const DEFAULT_REMEMBER_INTERRUPTED: Duration = Duration::from_secs(24 * 3600);

impl Redlock {
    /// Refuses a locker with a node that stores no outcome records (see
    /// [`Node::records`]): idempotent replay checks it when its layer is built, and
    /// warns (once per process) when the nodes' servers persist nothing.
    pub(crate) fn check_records(&self) -> Result<(), ConfigError> {
        self.shared.nodes.require(
            |node| node.records().is_some(),
            "idempotent replay stores outcome records on the lock nodes, and these nodes \
             store none (Node::records is None)",
        )?;
        // Only servers report their persistence (`MemoryNode` persists nothing by design).
        crate::lock::setup::warn_if_records_volatile(&self.shared);
        Ok(())
    }

    /// The completed outcome stored under `resource`, if any. Takes no lock: a completed
    /// record is immutable until its retention ends.
    ///
    /// Asks every node and waits for each answer (within the node timeout); the newest
    /// record any node holds is the outcome (see the [module documentation](crate::record)).
    /// `Ok(None)` when a majority answered and none holds one; [`LockError::Unavailable`]
    /// when too few nodes answer to tell.
    pub async fn read_record(
        &self,
        resource: impl Into<Resource>,
    ) -> Result<Option<Record>, LockError> {
        Ok(self
            .find_record(resource.into())
            .await?
            .map(|found| found.record))
    }

    /// [`read_record`](Self::read_record), telling whether every node that answered
    /// holds the record.
    pub(crate) async fn find_record(&self, resource: Resource) -> Result<Option<Found>, LockError> {
        let nodes = &self.shared.nodes;
        let keys = ResourceKeys::new(&self.shared.options.key_prefix, &resource);
        let mut seen = Seen::default();
        let mut answered = 0;
        let mut failures = Vec::new();
        nodes
            .fan_out(
                0..nodes.len(),
                nodes.timeout(),
                |_, node| records_of(node).read_record(&keys),
                |index, answer, pending| {
                    match answer {
                        Ok(found) => {
                            answered += 1;
                            found.into_iter().for_each(|found| seen.add(found));
                        }
                        Err(error) => failures.push(nodes.failure(index, error)),
                    }
                    pending == 0
                },
            )
            .await;
        if let Some((record, count)) = seen.0 {
            let everywhere = count == answered;
            Ok(Some(Found { record, everywhere }))
        } else if answered >= nodes.quorum() {
            Ok(None)
        } else {
            Err(nodes.unavailable(&resource, answered, nodes.quorum(), failures))
        }
    }
}

impl Lease {
    /// Claims the resource's work for this lease, or finds its outcome (see the
    /// [module documentation](crate::record)).
    ///
    /// `fingerprint` describes the request the work answers; it is stored with the
    /// marker and with the record. The pending marker lives `pending_ttl`. When an
    /// earlier holder's marker is found, its time to live is cut to `unknown_for`
    /// (`None`: it keeps its own, typically the whole retention), and the answer is
    /// [`Claim::Unknown`] until it expires.
    ///
    /// Fails with [`LockError::Lost`] when a majority says the lock key is no longer
    /// ours, and with [`LockError::Unavailable`] when too few nodes answer.
    pub async fn claim_record(
        &self,
        fingerprint: &[u8],
        pending_ttl: Duration,
        unknown_for: Option<Duration>,
    ) -> Result<Claim, LockError> {
        let fingerprint = Bytes::copy_from_slice(fingerprint);
        let remember = Some(DEFAULT_REMEMBER_INTERRUPTED);
        claim_owned(
            self.handle(),
            fingerprint,
            pending_ttl,
            unknown_for,
            remember,
        )
        .await
    }

    /// Stores the outcome of this lease's work, for `retention` (from 1 ms to ten
    /// years: shorter or longer is taken as the nearest bound).
    ///
    /// Written on every node where the lock key still holds this lease's owner value;
    /// succeeds once a majority accepted it within the lease's validity. Fails with
    /// [`LockError::Lost`] when the lease is no longer held (nothing can be written then:
    /// a newer holder's outcome is never overwritten), and with
    /// [`LockError::Unavailable`] when too few nodes confirmed in time. After a failure
    /// the record may exist on a minority of nodes.
    pub async fn store_record(
        &self,
        fingerprint: &[u8],
        data: Bytes,
        retention: Duration,
    ) -> Result<(), LockError> {
        let fingerprint = Bytes::copy_from_slice(fingerprint);
        store_owned(self.handle(), fingerprint, data, retention).await
    }

    /// Removes this lease's pending marker: the work ended without an outcome worth
    /// keeping, and the next claim may do it again. Leaves other holders' markers and
    /// every completed record alone. Succeeds once a majority answered.
    pub async fn discard_record(&self) -> Result<(), LockError> {
        discard_owned(self.handle()).await
    }
}

/// The longest a record or a pending marker is kept: longer times (up to
/// `Duration::MAX`) are taken as this one, which every node can express (Redis's
/// millisecond expiry, the monotonic clock) and which outlives any retry.
pub(crate) const MAX_RECORD_TTL: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

/// A record's time to live as the nodes can keep it: from 1 ms (Redis refuses an
/// expiry of 0) to [`MAX_RECORD_TTL`].
fn record_ttl(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_millis(1), MAX_RECORD_TTL)
}

fn lost(inner: &LeaseInner) -> LockError {
    let cause = inner.status().lost.unwrap_or(LostCause::KeyLost);
    LockError::Lost {
        resource: inner.resource().clone(),
        cause,
    }
}

/// Completed records seen in one round: the newest, and how many nodes hold it.
#[derive(Default)]
struct Seen(Option<(Record, usize)>);

impl Seen {
    fn add(&mut self, found: Record) {
        match &mut self.0 {
            Some((newest, count)) if newest.token() == found.token() => *count += 1,
            Some((newest, _)) if newest.token() > found.token() => {}
            _ => self.0 = Some((found, 1)),
        }
    }
}

/// A completed record a round found.
pub(crate) struct Found {
    pub(crate) record: Record,
    /// Every node that answered holds it: nothing to write back.
    pub(crate) everywhere: bool,
}

/// [`Lease::claim_record`], for a future that owns what it needs (the HTTP layer's).
pub(crate) async fn claim_owned(
    handle: LeaseHandle,
    fingerprint: Bytes,
    pending_ttl: Duration,
    unknown_for: Option<Duration>,
    remember_interrupted: Option<Duration>,
) -> Result<Claim, LockError> {
    let inner = handle.lease_inner();
    let nodes = &inner.locker.nodes;
    if !inner.is_held() {
        return Err(lost(inner));
    }
    let quorum = nodes.quorum();
    let request = ClaimRequest {
        keys: &inner.lock_keys()[0],
        owner: &inner.owner,
        token: inner.token().get(),
        fingerprint: &fingerprint,
        pending_ttl: record_ttl(pending_ttl),
        orphan_ttl: unknown_for.map(record_ttl),
        remember_interrupted: remember_interrupted.map(record_ttl),
    };
    let mut claimed = 0;
    // The latest interrupted attempt any claiming node remembers.
    let mut interrupted: Option<u64> = None;
    let mut not_owner = 0;
    let mut completed = Seen::default();
    let mut orphaned: Option<Option<Duration>> = None;
    let mut answered = 0;
    let mut failures = Vec::new();
    let timeout = bounded_by_validity(inner);
    nodes
        .fan_out(
            0..nodes.len(),
            timeout,
            |index, node| {
                let owner = inner.owner.for_node(index);
                records_of(node).claim_record(&ClaimRequest {
                    owner: &owner,
                    ..request
                })
            },
            |index, answer, pending| {
                match answer {
                    Ok(reply) => {
                        answered += 1;
                        match reply {
                            ClaimReply::Claimed => claimed += 1,
                            ClaimReply::ClaimedAfter { interrupted: token } => {
                                claimed += 1;
                                interrupted = interrupted.max(Some(token));
                            }
                            ClaimReply::Completed(record) => completed.add(record),
                            ClaimReply::Orphaned { pttl } => {
                                orphaned = Some(orphaned.flatten().max(pttl));
                            }
                            ClaimReply::NotOwner => not_owner += 1,
                        }
                    }
                    Err(error) => failures.push(nodes.failure(index, error)),
                }
                // A record may be on the one node that answers last: a claim is
                // decided by every answer (or the timeout), unless a majority says the
                // lock is not ours.
                pending == 0 || not_owner >= quorum
            },
        )
        .await;
    let outcome = if let Some((record, count)) = completed.0 {
        if count < nodes.len() {
            write_back(inner, &record, pending_ttl).await;
        }
        Ok(Claim::Completed(record))
    } else if let Some(retry_after) = orphaned {
        Ok(Claim::Unknown { retry_after })
    } else if claimed >= quorum && inner.is_held() {
        return Ok(match interrupted {
            Some(token) => Claim::Reclaimed {
                interrupted: FencingToken::new(token),
            },
            None => Claim::Claimed,
        });
    } else if not_owner >= quorum || !inner.is_held() {
        Err(lost(inner))
    } else {
        // Too few answers: undecided.
        Err(nodes.unavailable(inner.resource(), answered, quorum, failures))
    };
    // Our marker may have landed on some nodes (also on those that answered after the
    // decision): it must not outlive this answer, or it would read as an attempt of
    // ours that was interrupted.
    discard_in_background(inner);
    outcome
}

/// [`Lease::store_record`], for a future that owns what it needs.
pub(crate) async fn store_owned(
    handle: LeaseHandle,
    fingerprint: Bytes,
    data: Bytes,
    retention: Duration,
) -> Result<(), LockError> {
    let inner = handle.lease_inner();
    let nodes = &inner.locker.nodes;
    if !inner.is_held() {
        return Err(lost(inner));
    }
    let quorum = nodes.quorum();
    let record = Record::new(inner.token(), fingerprint, data);
    let deadline = inner.status().valid_until;
    let mut stored = 0;
    let mut refused = 0;
    let mut failures = Vec::new();
    store_on_nodes(inner, &record, retention, |index, answer, pending| {
        match answer {
            // Only what a node accepted while the lease was valid counts.
            Ok(StoreReply::Stored) if Instant::now() < deadline => stored += 1,
            Ok(StoreReply::Stored) => refused += 1,
            Ok(StoreReply::Superseded | StoreReply::NotOwner) => refused += 1,
            Err(error) => failures.push(nodes.failure(index, error)),
        }
        quorum::count_decided(quorum, stored, pending)
    })
    .await;
    if stored >= quorum {
        tracing::debug!(resource = %inner.resource(), token = %inner.token(), votes = stored, "outcome recorded");
        return Ok(());
    }
    tracing::warn!(resource = %inner.resource(), token = %inner.token(), stored, refused, failures = failures.len(), "outcome not recorded on a majority");
    if refused >= quorum || !inner.is_held() {
        return Err(lost(inner));
    }
    Err(nodes.unavailable(inner.resource(), stored + refused, quorum, failures))
}
