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
#[cfg(any(feature = "cluster", feature = "sentinel"))]
mod seeds;
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
    let ms = d.as_millis();
    let ms = if !d.subsec_nanos().is_multiple_of(1_000_000) {
        ms + 1
    } else {
        ms
    };
    u64::try_from(ms).unwrap_or(u64::MAX)
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
