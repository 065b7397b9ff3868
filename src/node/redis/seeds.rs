//! The seed addresses of a node reached through several servers (a Redis Cluster's
//! seeds, a Sentinel group), and the node's name made from them. Kept apart from `url`,
//! which builds the nodes, so the nodes do not import the module that builds them.

use redis::IntoConnectionInfo;

use crate::error::ConfigError;

/// Parses the seed addresses of a multi-address node (a cluster's seeds, a sentinel
/// group) and names the node after them, `{scheme}://host1:port1,host2:port2` with
/// `rediss+…` when the first seed uses TLS. Never includes credentials.
pub(crate) fn seeds<T: IntoConnectionInfo>(
    seeds: impl IntoIterator<Item = T>,
    scheme: &str,
    what: &str,
) -> Result<(Vec<redis::ConnectionInfo>, String), ConfigError> {
    let seeds = seeds
        .into_iter()
        .map(IntoConnectionInfo::into_connection_info)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::new(format!("bad {what} URL: {e}")))?;
    let Some(first) = seeds.first() else {
        return Err(ConfigError::new(format!(
            "at least one {what} address is needed"
        )));
    };
    let tls = matches!(first.addr(), redis::ConnectionAddr::TcpTls { .. });
    let hosts: Vec<String> = seeds.iter().map(|s| s.addr().to_string()).collect();
    let name = format!(
        "{}{scheme}://{}",
        if tls { "rediss+" } else { "redis+" },
        hosts.join(",")
    );
    Ok((seeds, name))
}
