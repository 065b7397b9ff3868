//! A lock store for tests (feature `test-util`): drive your handlers into every path —
//! lock held, store down, lease lost, slow nodes — deterministically, in process,
//! without Redis and without sleeps.
//!
//! [`TestStore`] is a set of [`MemoryNode`]s and the [`Redlock`] over them. Give
//! [`TestStore::locker`] to your [`LockLayer`](crate::http::LockLayer) or extractor state,
//! then steer the store from the test: [`hold`](TestStore::hold) a resource as another
//! owner, take nodes down ([`set_available`](TestStore::set_available), one node:
//! [`node(i)`](TestStore::node)), slow them ([`set_delay`](TestStore::set_delay)) or
//! [`lose`](TestStore::lose) a lease mid-handler; the testing guide says what the client
//! hears in each case.
//!
//! With `#[tokio::test(start_paused = true)]` delays and ttls run on Tokio's paused
//! clock, which jumps ahead whenever every task waits: a test with a 30 s ttl or a
//! 100 ms delay finishes at once and always the same way.
//!
//! Resources are named as the layer names them: under the default
//! [`Scope::Route`](crate::http::Scope::Route), `Resource::new("POST").join("/orders/{id}")
//! .join("42")` for `POST /orders/42` on the route `/orders/{id}`; under
//! `Scope::shared("order")`, `Resource::new("order").join("42")`.
//! [`held`](TestStore::held) lists what is held, and the kit's errors say what is.
//!
//! ```
//! use axum::{body::Body, routing::post, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redlock::http::{key::path_param, LockLayer};
//! use tower_redlock::test_util::TestStore;
//! use tower_redlock::Resource;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = TestStore::new();
//! let app = Router::new()
//!     .route("/orders/{id}/pay", post(|| async { "paid" }))
//!     .route_layer(LockLayer::new(store.locker(), path_param("id")));
//! let pay = || Request::post("/orders/42/pay").body(Body::empty()).unwrap();
//!
//! // Another instance is paying order 42 right now.
//! let order = Resource::new("POST").join("/orders/{id}/pay").join("42");
//! store.hold(order.clone(), std::time::Duration::from_secs(5)).await?;
//! let response = app.clone().oneshot(pay()).await?;
//! assert_eq!(response.status(), StatusCode::CONFLICT);
//! assert_eq!(response.headers()["retry-after"], "5");
//!
//! // The lock store goes down: fail closed.
//! store.release(order).await?;
//! store.set_available(false);
//! let response = app.clone().oneshot(pay()).await?;
//! assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
//!
//! store.set_available(true);
//! assert_eq!(app.oneshot(pay()).await?.status(), StatusCode::OK);
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{ConfigError, NodeFailure};
use crate::node::{Acquire, Hold, LockMode, Node, Owner, Release, Vote};
use crate::{node::ResourceKeys, Resource};
use crate::{LockOptions, LostCause, MemoryNode, Redlock};

/// In-process lock nodes and the [`Redlock`] over them, with controls to drive the
/// code under test into every path; see the [module docs](self).
///
/// Cheap to clone: clones share the nodes, the locker and the holds.
#[derive(Clone)]
pub struct TestStore {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<MemoryNode>,
    locker: Redlock,
    /// The owner values of the holds made by [`TestStore::hold`].
    holds: Mutex<HashMap<Resource, Owner>>,
}

/// Why a [`TestStore`] control could not do what was asked.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TestStoreError {
    /// There is no node with this index.
    #[error("no node {index}: this test store has {nodes} node(s), indexes 0 to {}", nodes.saturating_sub(1))]
    UnknownNode {
        /// The index asked for.
        index: usize,
        /// Number of nodes of the store.
        nodes: usize,
    },
    /// No lease of the store's locker holds the resource.
    #[error(
        "no lease of this store's locker holds `{resource}`; held now: {}",
        List(held)
    )]
    NotHeld {
        /// The resource asked for.
        resource: Resource,
        /// The resources that leases of the locker hold now.
        held: Vec<Resource>,
    },
    /// The resource is already held (by a lease, or by an earlier [`TestStore::hold`]).
    #[error("`{resource}` is already held on some node; release it first")]
    AlreadyHeld {
        /// The resource asked for.
        resource: Resource,
    },
    /// [`TestStore::release`] of a resource that [`TestStore::hold`] does not hold.
    #[error(
        "`{resource}` has no hold of this store to release (holds: {})",
        List(holds)
    )]
    NoHold {
        /// The resource asked for.
        resource: Resource,
        /// The resources held by [`TestStore::hold`] now.
        holds: Vec<Resource>,
    },
    /// A hold needs a ttl of at least one millisecond.
    #[error("a hold needs a ttl of at least 1 ms, got {ttl:?}")]
    InvalidTtl {
        /// The ttl asked for.
        ttl: Duration,
    },
    /// No node accepted the hold (every one is unavailable or failed).
    #[error("no node took the hold on `{resource}` ({} failed)", failures.len())]
    Unavailable {
        /// The resource asked for.
        resource: Resource,
        /// Why each node failed.
        failures: Vec<NodeFailure>,
    },
}

struct List<'a>(&'a [Resource]);

impl fmt::Display for List<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, resource) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "`{resource}`")?;
        }
        Ok(())
    }
}

impl TestStore {
    /// One node, default [`LockOptions`].
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime (as [`Redlock::in_memory`]).
    pub fn new() -> Self {
        match Self::with_nodes(1, LockOptions::default()) {
            Ok(store) => store,
            Err(e) => panic!("{e}"),
        }
    }

    /// `count` nodes (a lease needs `count/2 + 1`) and a locker with `options`. Fails
    /// as [`Redlock::new`] does: no node, options that cannot work, no runtime.
    pub fn with_nodes(count: usize, options: LockOptions) -> Result<Self, ConfigError> {
        let nodes: Vec<MemoryNode> = (0..count).map(|_| MemoryNode::new()).collect();
        let locker = Redlock::new(nodes.iter().cloned(), options)?;
        Ok(TestStore {
            inner: Arc::new(Inner {
                nodes,
                locker,
                holds: Mutex::default(),
            }),
        })
    }

    /// The locker over the store's nodes, for the layer or the extractor's state.
    /// Every clone shares the store: [`lose`](TestStore::lose) finds their leases.
    pub fn locker(&self) -> Redlock {
        self.inner.locker.clone()
    }

    /// The nodes, in the order the locker uses them.
    pub fn nodes(&self) -> &[MemoryNode] {
        &self.inner.nodes
    }

    /// Node `index`, to steer one node alone ([`MemoryNode::set_available`],
    /// [`MemoryNode::set_delay`]), e.g. to show a quorum surviving one node down and
    /// losing with two.
    pub fn node(&self, index: usize) -> Result<&MemoryNode, TestStoreError> {
        self.inner
            .nodes
            .get(index)
            .ok_or(TestStoreError::UnknownNode {
                index,
                nodes: self.inner.nodes.len(),
            })
    }

    /// Takes every node down (`false`) or brings every node back (`true`): calls fail
    /// at once with a connection error, as with Redis unreachable. Keys survive.
    pub fn set_available(&self, available: bool) {
        for node in &self.inner.nodes {
            node.set_available(available);
        }
    }

    /// Delays every node's answers by `delay` (zero: none), as a slow network.
    pub fn set_delay(&self, delay: Duration) {
        for node in &self.inner.nodes {
            node.set_delay(delay);
        }
    }

    /// Holds `resource` as another owner (another instance of the service) on every
    /// node that answers, for `ttl`: requests for it get 409 `lock-held` with
    /// `Retry-After` of `ttl` rounded up, or wait. The hold takes a fencing token, as a
    /// real holder would, so the next lease's token is larger.
    ///
    /// It ends when `ttl` runs out or at [`release`](TestStore::release), which wakes
    /// the waiters as a real release does.
    pub async fn hold(
        &self,
        resource: impl Into<Resource>,
        ttl: Duration,
    ) -> Result<(), TestStoreError> {
        let resource = resource.into();
        if ttl < Duration::from_millis(1) {
            return Err(TestStoreError::InvalidTtl { ttl });
        }
        let options = self.inner.locker.options();
        let keys = ResourceKeys::new(&options.key_prefix, &resource);
        let owner = Owner::random();
        let keys = std::slice::from_ref(&keys);
        let request = Acquire {
            keys,
            owner: &owner,
            mode: LockMode::Exclusive,
            ttl,
            fence_ttl: options.fence_ttl,
            fencing: options.fencing,
            fence_floor: crate::fencing::floor(crate::fencing::unix_ms()),
            seed_only_when_missing: options.seed_only_when_missing,
            waiter: None,
        };
        let mut taken = Vec::new();
        let mut held = false;
        let mut failures = Vec::new();
        for node in &self.inner.nodes {
            match node.acquire(&request).await {
                Ok(Vote::Granted { .. }) => taken.push(node),
                Ok(Vote::Held { .. } | Vote::OtherMode { .. }) => held = true,
                Err(error) => failures.push(NodeFailure {
                    node: node.name().into(),
                    error,
                }),
            }
        }
        if held || taken.is_empty() {
            // All or nothing: undo what this call took.
            let hold = Hold {
                keys,
                owner: &owner,
                mode: LockMode::Exclusive,
            };
            for node in taken {
                let _ = node.release(&hold, Release::Quiet).await;
            }
            return Err(if held {
                TestStoreError::AlreadyHeld { resource }
            } else {
                TestStoreError::Unavailable { resource, failures }
            });
        }
        self.holds().insert(resource, owner);
        Ok(())
    }

    /// Ends a hold made by [`hold`](TestStore::hold) on every node that answers, and
    /// wakes the waiters of the resource. A node that is down keeps the hold until
    /// its ttl runs out, as a real one would.
    pub async fn release(&self, resource: impl Into<Resource>) -> Result<(), TestStoreError> {
        let resource = resource.into();
        let owner = self.holds().remove(&resource);
        let Some(owner) = owner else {
            let holds = self.holds().keys().cloned().collect();
            return Err(TestStoreError::NoHold { resource, holds });
        };
        let keys = ResourceKeys::new(&self.inner.locker.options().key_prefix, &resource);
        let hold = Hold {
            keys: std::slice::from_ref(&keys),
            owner: &owner,
            mode: LockMode::Exclusive,
        };
        for node in &self.inner.nodes {
            let _ = node.release(&hold, Release::Wake).await;
        }
        Ok(())
    }

    /// Makes the lease that holds `resource` lost now, as when its key expired or was
    /// taken over on the nodes: the key is deleted on every node, and the lease is
    /// marked lost ([`LostCause::KeyLost`]) before this returns, so
    /// [`lost`](crate::LeaseHandle::lost) resolves and the layer reacts ([`OnLost`])
    /// without waiting for the watchdog's next renewal.
    ///
    /// [`OnLost`]: crate::http::OnLost
    pub fn lose(&self, resource: impl Into<Resource>) -> Result<(), TestStoreError> {
        let resource = resource.into();
        let holders = self.inner.locker.held_leases();
        let Some(lease) = holders
            .iter()
            .find(|lease| lease.resources().contains(&resource))
        else {
            let held = holders
                .iter()
                .flat_map(|lease| lease.resources().iter().cloned())
                .collect();
            return Err(TestStoreError::NotHeld { resource, held });
        };
        // A lease over a set is lost as a whole: every member's key goes.
        for keys in lease.lock_keys() {
            for node in &self.inner.nodes {
                // Only our key: the lease may already have been taken over on a node.
                if node.get(&keys.lock).as_deref() == Some(lease.owner.as_str()) {
                    node.delete(&keys.lock);
                }
            }
        }
        lease.mark_lost(LostCause::KeyLost);
        Ok(())
    }

    /// The resources held now, sorted: those of the leases of the store's locker, and
    /// those of [`hold`](TestStore::hold)s whose key a majority of the nodes still has
    /// (a hold ends with [`release`](TestStore::release) or its ttl).
    pub fn held(&self) -> Vec<Resource> {
        let mut held: Vec<Resource> = self
            .inner
            .locker
            .held_leases()
            .iter()
            .flat_map(|lease| lease.resources().iter().cloned())
            .collect();
        let prefix = &self.inner.locker.options().key_prefix;
        let quorum = self.inner.nodes.len() / 2 + 1;
        held.extend(
            self.holds()
                .iter()
                .filter(|(resource, owner)| {
                    let keys = ResourceKeys::new(prefix, resource);
                    let holding = self
                        .inner
                        .nodes
                        .iter()
                        .filter(|node| node.get(&keys.lock).as_deref() == Some(owner.as_str()));
                    holding.count() >= quorum
                })
                .map(|(resource, _)| resource.clone()),
        );
        held.sort();
        held.dedup();
        held
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, HashMap<Resource, Owner>> {
        crate::lock_unpoisoned(&self.inner.holds)
    }
}

impl Default for TestStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TestStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestStore")
            .field("nodes", &self.inner.nodes.len())
            .field("held", &self.held())
            .field("holds", &self.holds().keys().collect::<Vec<_>>())
            .finish()
    }
}
