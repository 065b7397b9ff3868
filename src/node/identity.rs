//! One server, one vote: refusing a server listed twice, by canonical address when a
//! locker is built and by server identity at connect (see [`Node::server_ids`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::error::ConfigError;
use crate::node::Node;

/// Refuses two nodes with the same address.
pub(crate) fn check_addresses(nodes: &[Arc<dyn Node>]) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, node) in nodes.iter().enumerate() {
        let Some(address) = node.address() else {
            continue;
        };
        if let Some(&first) = seen.get(address) {
            return Err(ConfigError::new(format!(
                "nodes {first} ({}) and {index} ({}) are the same server ({address}): \
                 one server must cast one vote; list each server once",
                nodes[first].name(),
                node.name()
            )));
        }
        seen.insert(address, index);
    }
    Ok(())
}

/// Asks every node for its servers' identities (each within `timeout`; a node that
/// does not answer is not checked) and refuses two nodes that share a server.
pub(crate) async fn check_servers(
    nodes: &[Arc<dyn Node>],
    timeout: Duration,
) -> Result<(), ConfigError> {
    let answers = join_all(nodes.iter().map(|node| {
        let call = node.server_ids();
        async move {
            match tokio::time::timeout(timeout, call).await {
                Ok(Ok(ids)) => ids,
                Ok(Err(e)) => {
                    tracing::debug!(node = %node.name(), error = %e, "server identity unknown");
                    Vec::new()
                }
                Err(_) => {
                    tracing::debug!(node = %node.name(), ?timeout, "server identity unknown");
                    Vec::new()
                }
            }
        }
    }))
    .await;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, ids) in answers.iter().enumerate() {
        for id in ids {
            match seen.get(id.as_str()) {
                Some(&first) if first != index => {
                    let (a, b) = (nodes[first].name(), nodes[index].name());
                    tracing::warn!(first = %a, second = %b, run_id = %id, "one server listed as two nodes");
                    return Err(ConfigError::new(format!(
                        "nodes {first} ({a}) and {index} ({b}) reach the same server \
                         (run_id {id}): one server must cast one vote; list each server once"
                    )));
                }
                _ => {
                    seen.insert(id, index);
                }
            }
        }
    }
    Ok(())
}

/// The canonical form of one server address: host in lower case, port explicit.
#[cfg(feature = "redis")]
pub(crate) fn address(addr: &redis::ConnectionAddr) -> String {
    match addr {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => {
            format!("{}:{port}", host.to_ascii_lowercase())
        }
        other => other.to_string(),
    }
}

/// The canonical address of a node reached through several seeds (a cluster's nodes, a
/// sentinel group): the seeds' addresses sorted, without repeats, after `kind`.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(crate) fn seeds_address(kind: &str, seeds: &[redis::ConnectionInfo]) -> String {
    let mut hosts: Vec<String> = seeds.iter().map(|s| address(s.addr())).collect();
    hosts.sort();
    hosts.dedup();
    format!("{kind}://{}", hosts.join(","))
}

/// The `run_id` in the text of `INFO server`.
#[cfg(feature = "redis")]
pub(crate) fn parse_run_id(info: &str) -> Option<String> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix("run_id:"))
        .map(str::to_owned)
        .filter(|id| !id.is_empty())
}

/// Asks one server for its `run_id`.
#[cfg(feature = "redis")]
pub(crate) async fn run_id<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> Result<Vec<String>, crate::error::NodeError> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(crate::node::redis::call::node_error)?;
    Ok(parse_run_id(&info).into_iter().collect())
}
