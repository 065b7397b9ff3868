//! What [`Redlock::connect`](crate::Redlock::connect) checks of its servers' setup
//! (each node reports, this module decides; the list and why: the operations guide),
//! and the periodic re-check of a connected locker, shown in
//! [`NodeState::setup_warning`](crate::NodeState::setup_warning).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::join_all;

use crate::error::{ConfigError, NodeError};
use crate::lock::{LockOptions, Shared};
use crate::node::{Resource, ResourceKeys, ServerSetup};

/// The resource whose keys the nodes may probe: no lease takes it (resource names are
/// percent-encoded, so none contains a raw space).
const PROBE_RESOURCE: &str = "tower-redlock setup probe";

/// One node's findings: refusals (the locker cannot work, or must not) and warnings.
#[derive(Default)]
struct Findings {
    refusals: Vec<String>,
    warnings: Vec<String>,
}

impl Findings {
    fn warning(&self) -> Option<String> {
        let all: Vec<&str> = self
            .refusals
            .iter()
            .chain(&self.warnings)
            .map(String::as_str)
            .collect();
        (!all.is_empty()).then(|| all.join("; "))
    }
}

/// What `setups`, one node's servers, mean for a locker with `options`.
fn judge(options: &LockOptions, setups: &[ServerSetup]) -> Findings {
    let prefix = &options.key_prefix;
    let mut findings = Findings::default();
    for setup in setups {
        let server = &setup.server;
        if setup.is_replica() {
            findings.refusals.push(format!(
                "server {server} is a replica (role {}): every lock write would fail \
                 (read-only); list its master or primary instead (a Sentinel or Cluster \
                 URL finds the master itself)",
                setup.role.as_deref().unwrap_or_default()
            ));
        }
        if !setup.missing.is_empty() {
            findings.refusals.push(format!(
                "server {server} has no command {} (renamed or removed with \
                 rename-command): the locker sends them, itself or from its scripts; \
                 restore them under their own names",
                setup.missing.join(", ")
            ));
        }
        if !setup.refused.is_empty() {
            findings.refusals.push(format!(
                "the user on server {server} is refused {}: the locker runs its scripts \
                 (EVALSHA, EVAL when not loaded) on keys `{prefix}*`; grant them \
                 (ACL SETUSER <user> +evalsha +eval ~{prefix}* &{prefix}*)",
                setup.refused.join(", ")
            ));
        }
        if setup.evicts() {
            let policy = setup.maxmemory_policy.as_deref().unwrap_or_default();
            let risk = format!(
                "server {server} has maxmemory-policy {policy}: under memory pressure it \
                 evicts held lock keys and a second holder gets the lock; set \
                 `maxmemory-policy noeviction`"
            );
            if options.accept_evicting_nodes {
                findings.warnings.push(format!(
                    "{risk} (accepted with LockOptions::accept_evicting_nodes)"
                ));
            } else {
                findings.refusals.push(format!(
                    "{risk}, or accept the risk with LockOptions::accept_evicting_nodes(true)"
                ));
            }
        }
        if setup.channels_refused {
            findings.warnings.push(format!(
                "the user on server {server} may not publish on the wake-up channels \
                 `{prefix}*`: releases wake no waiter, who find the lock free by polling \
                 (LockOptions::retry_policy); grant `&{prefix}*` to wake them"
            ));
        }
    }
    findings
}

/// Every node's servers' setup, each asked within `timeout` (`None`: no answer).
async fn setups(shared: &Shared, timeout: Duration) -> Vec<Option<Vec<ServerSetup>>> {
    let probe = ResourceKeys::new(&shared.options.key_prefix, &Resource::new(PROBE_RESOURCE));
    join_all(shared.nodes.each().map(|node| {
        let call = node.server_setup(&probe);
        async move {
            let answer = tokio::time::timeout(timeout, call).await;
            let answer = answer.unwrap_or(Err(NodeError::Timeout(timeout)));
            answer
                .inspect_err(
                    |error| tracing::debug!(node = %node.name(), %error, "server setup unknown"),
                )
                .ok()
        }
    }))
    .await
}

/// Asks every node for its servers' setup (a node that does not answer is not checked),
/// records the findings in each node's health, and logs them.
async fn survey(shared: &Shared, timeout: Duration) -> Vec<Option<Findings>> {
    let answers = setups(shared, timeout).await;
    answers
        .into_iter()
        .zip(shared.nodes.health.iter())
        .map(|(setups, health)| {
            let findings = judge(&shared.options, &setups?);
            health.note_setup(findings.warning());
            Some(findings)
        })
        .collect()
}

/// The check of [`Redlock::connect`](crate::Redlock::connect): refuses the first node
/// with a refusal, naming it; warnings are logged (on every connect).
pub(crate) async fn check(shared: &Shared, timeout: Duration) -> Result<(), ConfigError> {
    let findings = survey(shared, timeout).await;
    for (index, findings) in findings.into_iter().enumerate() {
        let Some(findings) = findings else {
            continue;
        };
        if !findings.refusals.is_empty() {
            return Err(ConfigError::new(format!(
                "node {index} ({}): {}",
                shared.nodes.name(index),
                findings.refusals.join("; ")
            )));
        }
    }
    Ok(())
}

/// Warns (once per process) when outcome records live on servers that persist nothing:
/// called when a replaying layer is built; asks the nodes in the background.
pub(crate) fn warn_if_records_volatile(shared: &Arc<Shared>) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.load(Ordering::Relaxed) {
        return;
    }
    let shared = shared.clone();
    let timeout = shared.options.node_timeout.max(Duration::from_secs(2));
    crate::lock::metrics::spawn(&shared.runtime.clone(), async move {
        let volatile: Vec<String> = setups(&shared, timeout)
            .await
            .into_iter()
            .flatten()
            .flatten()
            .filter(|setup| setup.persists == Some(false))
            .map(|setup| setup.server)
            .collect();
        if !volatile.is_empty() && !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                servers = ?volatile,
                "idempotent replay keeps its records on servers that persist nothing (no AOF, \
                 no RDB snapshots): a restarted server comes back without them. A record \
                 survives restarts one server at a time while a server that has it answers a \
                 request for it in between (the request writes it back); otherwise the \
                 handler runs again. Turn on persistence (`appendonly yes`) to keep them"
            );
        }
    });
}

/// Checks the servers' setup again every `setup_check_interval`, for as long as the
/// locker lives.
pub(crate) fn spawn_periodic(shared: &Arc<Shared>, timeout: Duration) {
    let interval = shared.options.setup_check_interval;
    let weak: Weak<Shared> = Arc::downgrade(shared);
    crate::lock::metrics::spawn(&shared.runtime, async move {
        loop {
            tokio::time::sleep(interval).await;
            let Some(shared) = weak.upgrade() else {
                return;
            };
            survey(&shared, timeout).await;
        }
    });
}
