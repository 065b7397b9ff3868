//! One string per node: [`node_from_url`], whatever the node's kind, and
//! [`split_node_urls`] for a list of them in one variable.

use std::sync::Arc;

use crate::error::ConfigError;
use crate::node::Node;

/// A lock node from one URL. Each node casts one vote, whatever its kind.
///
/// | URL | node |
/// |---|---|
/// | `redis://[user:password@]host[:port][/db]` | a standalone server ([`RedisNode`](crate::RedisNode)) |
/// | `rediss://[user:password@]host[:port][/db][#insecure]` | the same over TLS (feature `tls`) |
/// | `redis+cluster://[user:password@]host1:port1,host2:port2[/]` | a Redis Cluster, given by one or more seed nodes (`ClusterNode`) |
/// | `rediss+cluster://…` | the same over TLS |
/// | `redis+sentinel://[user:password@]host1:port1,host2:port2/master_name[/db]` | the master `master_name` of a Sentinel group, given by one or more sentinels (`SentinelNode`) |
/// | `rediss+sentinel://…` | the same over TLS, to the sentinels and to the master |
/// | `etcd://[user:password@]host1:port1,host2:port2[/prefix]` | an etcd cluster, given by one or more members, keys under `prefix/` (feature `etcd`, `EtcdNode`): must be the locker's only node |
/// | `postgres://[user:password@]host[:port]/database[?listen=…]` (or `postgresql://`) | a PostgreSQL database (feature `postgres`, `PostgresNode`) |
///
/// Each kind needs its feature: the Redis kinds `redis` (a default), `cluster` and
/// `sentinel` (defaults too), `etcd://` the feature `etcd`, `postgres://` the feature
/// `postgres`; a URL whose feature is off is refused, naming it.
///
/// The port defaults to 6379 (26379 for sentinels) and the database to 0.
/// Credentials are percent-encoded (`%40` for `@`) and authenticate to the data nodes
/// (with Redis ACLs, `user:password`; with `requirepass`, `:password`). Sentinels
/// that require a password of their own get it from the `sentinel_username` and
/// `sentinel_password` query parameters.
///
/// TLS (`rediss…`, feature `tls`) verifies the server certificate against the webpki
/// (Mozilla) roots. For a private CA, build the node from a redis-rs client configured
/// with the certificates instead: `RedisNode::from_client` with
/// `redis::Client::build_with_tls`, or `ClusterNode::with_config` with
/// `ClusterClientBuilder::certs`. `#insecure` (no verification) needs redis-rs's
/// `tls-rustls-insecure` feature, which this crate does not enable; without it the
/// connection fails with an error saying so.
///
/// Query parameters read by this function (other parameters, such as `protocol`,
/// are passed on to redis-rs):
///
/// * `wait_replicas=N` and `wait_timeout_ms=T` (default 20 ms): count the node's vote
///   only once `N` replicas acknowledged each write, see
///   `RedisNode::wait_for_replicas`. The timeout must fit in the locker's
///   [`node_timeout`](crate::LockOptions::node_timeout) together with one round trip.
/// * `sentinel_username`, `sentinel_password` (sentinel URLs only).
/// * `tcp_nodelay=false` (standalone and cluster URLs; a Sentinel node always sets
///   `TCP_NODELAY`): let the kernel gather the commands of concurrent acquisitions
///   into fewer packets, at up to a round trip's wait each, see
///   `RedisNode::tcp_nodelay`. `true` is the default.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::node_from_url;
///
/// let standalone = node_from_url("redis://:secret@127.0.0.1:7001/0")?;
/// let cluster = node_from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000/")?;
/// let sentinel = node_from_url("redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/locks/2?wait_replicas=1")?;
/// assert_eq!(cluster.name(), "redis+cluster://10.0.0.1:7000,10.0.0.2:7000");
/// assert_eq!(sentinel.name(), "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/locks");
/// assert!(!standalone.name().contains("secret"));
/// # Ok(())
/// # }
/// ```
///
/// Fails on a malformed URL, an unknown scheme, or outside a Tokio runtime. Never
/// connects: nodes connect on first use.
pub fn node_from_url(s: &str) -> Result<Arc<dyn Node>, ConfigError> {
    let scheme = s.split_once("://").map_or("", |(scheme, _)| scheme);
    match scheme {
        #[cfg(feature = "etcd")]
        "etcd" => crate::node::etcd::EtcdNode::from_url(s).map(|n| Arc::new(n) as _),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            crate::node::postgres::PostgresNode::from_url(s).map(|n| Arc::new(n) as _)
        }
        #[cfg(not(feature = "etcd"))]
        "etcd" => feature_off(scheme, "etcd"),
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => feature_off(scheme, "postgres"),
        #[cfg(feature = "redis")]
        _ => crate::node::redis::redis_node(s),
        #[cfg(not(feature = "redis"))]
        _ if scheme.contains("redis") || scheme.starts_with("valkey") || scheme == "unix" => {
            feature_off(scheme, "redis")
        }
        #[cfg(not(feature = "redis"))]
        _ => Err(ConfigError::new(format!(
            "unknown node URL {s:?}: expected redis://, etcd:// or postgres://"
        ))),
    }
}

#[cfg(not(all(feature = "redis", feature = "etcd", feature = "postgres")))]
fn feature_off(scheme: &str, feature: &str) -> Result<Arc<dyn Node>, ConfigError> {
    Err(ConfigError::new(format!(
        "{scheme}:// URLs need the crate's `{feature}` feature"
    )))
}

/// Splits a list of node URLs, as one environment variable holds them, into one string
/// per node for [`node_from_url`].
///
/// URLs are separated by whitespace or commas, but a comma separates two URLs only when
/// the text after it starts a new URL (a scheme followed by `://`): the seeds of a
/// `redis+cluster://` or `redis+sentinel://` URL, which are comma-separated, stay in
/// their URL. Text before the first URL is kept as an entry of its own, so that
/// [`node_from_url`] rejects it with a clear error.
///
/// ```
/// use tower_redlock::split_node_urls;
///
/// assert_eq!(
///     split_node_urls("redis://a:1/0,redis+cluster://b:1,b:2/ redis+sentinel://c:1, c:2/m"),
///     [
///         "redis://a:1/0",
///         "redis+cluster://b:1,b:2/",
///         "redis+sentinel://c:1,c:2/m",
///     ],
/// );
/// ```
pub fn split_node_urls(list: &str) -> Vec<String> {
    let mut urls: Vec<String> = Vec::new();
    for token in list
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
    {
        match urls.last_mut() {
            Some(url) if !starts_with_scheme(token) => {
                url.push(',');
                url.push_str(token);
            }
            _ => urls.push(token.to_owned()),
        }
    }
    urls
}

/// `scheme://…`, with a scheme as RFC 3986 spells it (`redis+cluster` included).
fn starts_with_scheme(token: &str) -> bool {
    token.split_once("://").is_some_and(|(scheme, _)| {
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}
