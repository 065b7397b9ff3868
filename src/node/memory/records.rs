//! The [`MemoryNode`]'s outcome records (idempotent replay), stored as text in an
//! ordinary entry of the record key, so expiry, `clear`, `delete` and the fault
//! injection apply to them as to the lock keys.

use crate::error::NodeError;
use crate::node::{
    ClaimReply, ClaimRequest, FencingToken, NodeFuture, Record, RecordStore, ResourceKeys,
    StoreReply, StoreRequest,
};

use tokio::time::Instant;

use super::{lock, Entry, MemoryNode};

impl RecordStore for MemoryNode {
    fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>> {
        let key = keys.record();
        self.run(move |shared| {
            let mut store = lock(&shared.store);
            match store.live(&key, Instant::now()) {
                Some(entry) => match MemRecord::parse(&entry.value)? {
                    MemRecord::Done(record) => Ok(Some(record)),
                    MemRecord::Pending { .. } => Ok(None),
                },
                None => Ok(None),
            }
        })
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let lock_key = request.keys.lock.clone();
        let key = request.keys.record();
        let owner = request.owner.as_str().to_owned();
        let token = request.token;
        let fingerprint = request.fingerprint.to_vec();
        let (pending_ttl, orphan_ttl) = (request.pending_ttl, request.orphan_ttl);
        let remember = request.remember_interrupted;
        let interrupted_key = request.keys.interrupted();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            // Ours: with the interrupted attempt's token, when one is remembered.
            let claimed = |store: &mut super::Store| match store
                .live(&interrupted_key, now)
                .map(|e| e.value.parse())
            {
                Some(Ok(interrupted)) => ClaimReply::ClaimedAfter { interrupted },
                _ => ClaimReply::Claimed,
            };
            let current = match store.live(&key, now) {
                Some(entry) => Some(MemRecord::parse(&entry.value)?),
                None => None,
            };
            if let Some(MemRecord::Done(record)) = current {
                return Ok(ClaimReply::Completed(record));
            }
            if store.live(&lock_key, now).is_none_or(|e| e.value != owner) {
                return Ok(ClaimReply::NotOwner);
            }
            match current {
                Some(MemRecord::Pending {
                    token: other,
                    fingerprint,
                    orphan,
                }) => {
                    if other == token {
                        return Ok(claimed(&mut store));
                    }
                    let Some(entry) = store.live(&key, now) else {
                        return Ok(ClaimReply::Orphaned { pttl: None });
                    };
                    if !orphan {
                        entry.value = MemRecord::Pending {
                            token: other,
                            fingerprint,
                            orphan: true,
                        }
                        .encode();
                        if let Some(ttl) = orphan_ttl {
                            entry.expires = Some(now + ttl);
                        }
                    }
                    let pttl = entry.expires.map(|at| at.saturating_duration_since(now));
                    if let (false, Some(ttl)) = (orphan, remember) {
                        store.entries.insert(
                            interrupted_key,
                            Entry {
                                value: other.to_string(),
                                expires: now.checked_add(ttl),
                            },
                        );
                    }
                    Ok(ClaimReply::Orphaned { pttl })
                }
                Some(MemRecord::Done(_)) | None => {
                    let value = MemRecord::Pending {
                        token,
                        fingerprint,
                        orphan: false,
                    }
                    .encode();
                    store.entries.insert(
                        key,
                        Entry {
                            value,
                            expires: Some(now + pending_ttl),
                        },
                    );
                    store.wrote(now);
                    Ok(claimed(&mut store))
                }
            }
        })
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let lock_key = request.keys.lock.clone();
        let key = request.keys.record();
        let owner = request.owner.as_str().to_owned();
        let record = request.record.clone();
        let retention = request.retention;
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            if store.live(&lock_key, now).is_none_or(|e| e.value != owner) {
                return Ok(StoreReply::NotOwner);
            }
            if let Some(entry) = store.live(&key, now)
                && let Ok(MemRecord::Done(existing)) = MemRecord::parse(&entry.value)
            {
                // The same record again is a re-sent store (as over Redis).
                if existing == record {
                    return Ok(StoreReply::Stored);
                }
                if existing.token() >= record.token() {
                    return Ok(StoreReply::Superseded);
                }
            }
            store.entries.insert(
                key,
                Entry {
                    value: MemRecord::Done(record).encode(),
                    expires: Some(now + retention),
                },
            );
            store.wrote(now);
            Ok(StoreReply::Stored)
        })
    }

    fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool> {
        let key = keys.record();
        self.run(move |shared| {
            let mut store = lock(&shared.store);
            let ours = store.live(&key, Instant::now()).is_some_and(|e| {
                matches!(MemRecord::parse(&e.value), Ok(MemRecord::Pending { token: t, .. }) if t == token)
            });
            if ours {
                store.entries.remove(&key);
            }
            Ok(ours)
        })
    }
}

/// An outcome record as the text of a [`MemoryNode`] entry:
/// `P <token> <fingerprint hex> <orphan 0|1>` or `D <token> <fingerprint hex> <data hex>`.
enum MemRecord {
    Pending {
        token: u64,
        fingerprint: Vec<u8>,
        orphan: bool,
    },
    Done(Record),
}

impl MemRecord {
    fn encode(&self) -> String {
        match self {
            MemRecord::Pending {
                token,
                fingerprint,
                orphan,
            } => format!("P {token} {} {}", hex(fingerprint), u8::from(*orphan)),
            MemRecord::Done(record) => format!(
                "D {} {} {}",
                record.token(),
                hex(record.fingerprint()),
                hex(record.data())
            ),
        }
    }

    fn parse(text: &str) -> Result<Self, NodeError> {
        let malformed = || NodeError::Server("WRONGTYPE the key does not hold a record".into());
        let mut fields = text.split(' ');
        let (Some(kind), Some(token), Some(fingerprint), Some(last), None) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(malformed());
        };
        let token: u64 = token.parse().map_err(|_| malformed())?;
        let fingerprint = unhex(fingerprint).ok_or_else(malformed)?;
        match kind {
            "P" => Ok(MemRecord::Pending {
                token,
                fingerprint,
                orphan: last == "1",
            }),
            "D" => Ok(MemRecord::Done(Record::new(
                FencingToken::new(token),
                fingerprint.into(),
                unhex(last).ok_or_else(malformed)?.into(),
            ))),
            _ => Err(malformed()),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::new();
    crate::push_hex(&mut out, bytes);
    out
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}
