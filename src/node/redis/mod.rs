//! The Redis node kinds: one standalone server ([`RedisNode`]), a Redis Cluster
//! ([`ClusterNode`]) and a Sentinel-managed group ([`SentinelNode`]), each casting one
//! vote, and [`node_from_url`](crate::node_from_url) to build one from a URL.

mod attempt;
mod batching;
pub(crate) mod call;
#[cfg(feature = "cluster")]
mod cluster;
pub(crate) mod conn;
mod node;
pub(crate) mod pubsub;
pub(crate) mod records;
#[cfg(feature = "sentinel")]
mod sentinel;
mod setup;
mod standalone;
pub(crate) mod url;

use std::time::Duration;

#[cfg(feature = "cluster")]
pub use cluster::ClusterNode;
#[cfg(feature = "sentinel")]
pub use sentinel::SentinelNode;
pub use standalone::RedisNode;
pub(crate) use url::redis_node;

/// Whole milliseconds, rounded up, as Redis takes them.
pub(crate) fn millis_ceil(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// Parses the seed addresses of a multi-address node (a cluster's seeds, a sentinel
/// group) and names the node after them, `{scheme}://host1:port1,host2:port2` with
/// `rediss+…` when the first seed uses TLS. Never includes credentials.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(crate) fn seeds<T: redis::IntoConnectionInfo>(
    seeds: impl IntoIterator<Item = T>,
    scheme: &str,
    what: &str,
) -> Result<(Vec<redis::ConnectionInfo>, String), crate::ConfigError> {
    let seeds = seeds
        .into_iter()
        .map(redis::IntoConnectionInfo::into_connection_info)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| crate::ConfigError::new(format!("bad {what} URL: {e}")))?;
    let Some(first) = seeds.first() else {
        return Err(crate::ConfigError::new(format!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_round_up() {
        assert_eq!(millis_ceil(Duration::from_micros(1500)), 2);
        assert_eq!(millis_ceil(Duration::from_millis(7)), 7);
    }
}
