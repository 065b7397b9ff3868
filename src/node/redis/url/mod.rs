//! One string per node: [`node_from_url`].

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "cluster")]
use redis::io::tcp::TcpSettings;
#[cfg(feature = "sentinel")]
use redis::sentinel::SentinelNodeConnectionInfo;
#[cfg(feature = "sentinel")]
use redis::{IntoConnectionInfo, TlsMode};

use crate::error::ConfigError;
use crate::node::percent::percent_decode;
#[cfg(feature = "cluster")]
use crate::node::redis::cluster::ClusterNode;
#[cfg(feature = "sentinel")]
use crate::node::redis::sentinel::SentinelNode;
use crate::node::redis::standalone::RedisNode;
use crate::node::Node;

/// Replica acknowledgement timeout when a URL sets `wait_replicas` without `wait_timeout_ms`.
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_millis(20);

/// A lock node from one URL. Each node casts one vote, whatever its kind.
///
/// | URL | node |
/// |---|---|
/// | `redis://[user:password@]host[:port][/db]` | a standalone server ([`RedisNode`]) |
/// | `rediss://[user:password@]host[:port][/db][#insecure]` | the same over TLS (feature `tls`) |
/// | `redis+cluster://[user:password@]host1:port1,host2:port2[/]` | a Redis Cluster, given by one or more seed nodes ([`ClusterNode`]) |
/// | `rediss+cluster://…` | the same over TLS |
/// | `redis+sentinel://[user:password@]host1:port1,host2:port2/master_name[/db]` | the master `master_name` of a Sentinel group, given by one or more sentinels ([`SentinelNode`]) |
/// | `rediss+sentinel://…` | the same over TLS, to the sentinels and to the master |
/// | `etcd://[user:password@]host1:port1,host2:port2[/prefix]` | an etcd cluster, given by one or more members, keys under `prefix/` (feature `etcd`, `EtcdNode`): must be the locker's only node |
/// | `postgres://[user:password@]host[:port]/database[?listen=…]` (or `postgresql://`) | a PostgreSQL database (feature `postgres`, `PostgresNode`) |
///
/// The port defaults to 6379 (26379 for sentinels) and the database to 0.
/// Credentials are percent-encoded (`%40` for `@`) and authenticate to the data nodes
/// (with Redis ACLs, `user:password`; with `requirepass`, `:password`). Sentinels
/// that require a password of their own get it from the `sentinel_username` and
/// `sentinel_password` query parameters.
///
/// TLS (`rediss…`, feature `tls`) verifies the server certificate against the webpki
/// (Mozilla) roots. For a private CA, build the node from a redis-rs client configured
/// with the certificates instead: [`RedisNode::from_client`] with
/// `redis::Client::build_with_tls`, or [`ClusterNode::with_config`] with
/// `ClusterClientBuilder::certs`. `#insecure` (no verification) needs redis-rs's
/// `tls-rustls-insecure` feature, which this crate does not enable; without it the
/// connection fails with an error saying so.
///
/// Query parameters read by this function (other parameters, such as `protocol`,
/// are passed on to redis-rs):
///
/// * `wait_replicas=N` and `wait_timeout_ms=T` (default 20 ms): count the node's vote
///   only once `N` replicas acknowledged each write, see
///   [`RedisNode::wait_for_replicas`]. The timeout must fit in the locker's
///   [`node_timeout`](crate::LockOptions::node_timeout) together with one round trip.
/// * `sentinel_username`, `sentinel_password` (sentinel URLs only).
/// * `tcp_nodelay=false` (standalone and cluster URLs; a Sentinel node always sets
///   `TCP_NODELAY`): let the kernel gather the commands of concurrent acquisitions
///   into fewer packets, at up to a round trip's wait each, see
///   [`RedisNode::tcp_nodelay`]. `true` is the default.
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
    if let Some(node) = other_kind(s) {
        return node;
    }
    let url = Url::parse(s)?;
    let wait = url.wait()?;
    let nodelay = url.nodelay()?;
    if nodelay.is_some()
        && !matches!(
            url.scheme,
            "redis" | "rediss" | "valkey" | "valkeys" | "redis+cluster" | "rediss+cluster"
        )
    {
        return Err(ConfigError::new(format!(
            "tcp_nodelay is read for redis://, rediss:// and redis+cluster:// nodes, not {}://",
            url.scheme
        )));
    }
    match url.scheme {
        "redis" | "rediss" | "valkey" | "valkeys" | "unix" | "redis+unix" => {
            let mut node = RedisNode::open(url.rebuild(&url.hosts.join(","), url.path))?;
            if let Some(nodelay) = nodelay {
                node = node.tcp_nodelay(nodelay)?;
            }
            if let Some((replicas, timeout)) = wait {
                node = node.wait_for_replicas(replicas, timeout);
            }
            Ok(Arc::new(node))
        }
        "redis+cluster" | "rediss+cluster" => cluster(&url, nodelay, wait),
        "redis+sentinel" | "rediss+sentinel" => sentinel(&url, wait),
        other => Err(ConfigError::new(format!(
            "unknown URL scheme `{other}`: expected redis://, rediss://, redis+cluster://, \
             rediss+cluster://, redis+sentinel://, rediss+sentinel://, etcd:// or postgres://"
        ))),
    }
}

/// A node of a kind whose URLs are not Redis's (etcd, PostgreSQL), or `None`.
fn other_kind(url: &str) -> Option<Result<Arc<dyn Node>, ConfigError>> {
    // The scheme names the feature too.
    let kind = match url.split_once("://")?.0 {
        "etcd" => "etcd",
        "postgres" | "postgresql" => "postgres",
        _ => return None,
    };
    let node: Result<Arc<dyn Node>, ConfigError> = match kind {
        #[cfg(feature = "etcd")]
        "etcd" => crate::node::etcd::EtcdNode::from_url(url).map(|n| Arc::new(n) as _),
        #[cfg(feature = "postgres")]
        "postgres" => crate::node::postgres::PostgresNode::from_url(url).map(|n| Arc::new(n) as _),
        _ => Err(ConfigError::new(format!(
            "{kind}:// URLs need the crate's `{kind}` feature"
        ))),
    };
    Some(node)
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

#[cfg(feature = "cluster")]
fn cluster(
    url: &Url<'_>,
    nodelay: Option<bool>,
    wait: Option<(usize, Duration)>,
) -> Result<Arc<dyn Node>, ConfigError> {
    let base = if url.scheme == "rediss+cluster" {
        "rediss"
    } else {
        "redis"
    };
    let seeds = url
        .hosts
        .iter()
        .map(|host| {
            Url {
                scheme: base,
                ..url.clone()
            }
            .rebuild(host, url.path)
        })
        .collect::<Vec<_>>();
    let mut node = match nodelay {
        None => ClusterNode::open(seeds)?,
        Some(nodelay) => ClusterNode::with_config(seeds, move |builder| {
            builder.tcp_settings(TcpSettings::default().set_nodelay(nodelay))
        })?,
    };
    if let Some((replicas, timeout)) = wait {
        node = node.wait_for_replicas(replicas, timeout);
    }
    Ok(Arc::new(node))
}

#[cfg(not(feature = "cluster"))]
fn cluster(
    url: &Url<'_>,
    _: Option<bool>,
    _: Option<(usize, Duration)>,
) -> Result<Arc<dyn Node>, ConfigError> {
    Err(needs_feature(url.scheme, "cluster"))
}

#[cfg(not(feature = "sentinel"))]
fn sentinel(url: &Url<'_>, _: Option<(usize, Duration)>) -> Result<Arc<dyn Node>, ConfigError> {
    Err(needs_feature(url.scheme, "sentinel"))
}

/// A scheme this build knows but left out.
#[cfg(not(all(feature = "cluster", feature = "sentinel")))]
fn needs_feature(scheme: &str, feature: &str) -> ConfigError {
    ConfigError::new(format!(
        "{scheme}:// URLs need tower-redlock's `{feature}` feature (on by default; \
         enable it in Cargo.toml)"
    ))
}

#[cfg(feature = "sentinel")]
fn sentinel(url: &Url<'_>, wait: Option<(usize, Duration)>) -> Result<Arc<dyn Node>, ConfigError> {
    let tls = url.scheme == "rediss+sentinel";
    let mut segments = url.path.trim_matches('/').split('/');
    let master = segments.next().unwrap_or_default();
    if master.is_empty() {
        return Err(ConfigError::new(
            "a sentinel URL needs the master's name: redis+sentinel://host:port/master_name[/db]",
        ));
    }
    let master = percent_decode(master)?;
    let db: i64 = match segments.next() {
        None | Some("") => 0,
        Some(db) => db.parse().map_err(|_| {
            ConfigError::new(format!("invalid database number `{db}` in sentinel URL"))
        })?,
    };
    if segments.next().is_some() {
        return Err(ConfigError::new(
            "a sentinel URL's path is /master_name[/db]",
        ));
    }
    let base = if tls { "rediss" } else { "redis" };
    let sentinel_user = url.param("sentinel_username")?;
    let sentinel_password = url.param("sentinel_password")?;
    let sentinels = url
        .hosts
        .iter()
        .map(|host| {
            let host = if has_port(host) {
                (*host).to_owned()
            } else {
                format!("{host}:26379")
            };
            let bare = Url {
                scheme: base,
                userinfo: None,
                query: Vec::new(),
                ..url.clone()
            };
            let info = bare
                .rebuild(&host, "")
                .into_connection_info()
                .map_err(|e| ConfigError::new(format!("bad sentinel address `{host}`: {e}")))?;
            let mut settings = info.redis_settings().clone();
            if let Some(user) = &sentinel_user {
                settings = settings.set_username(user);
            }
            if let Some(password) = &sentinel_password {
                settings = settings.set_password(password);
            }
            Ok(info.set_redis_settings(settings))
        })
        .collect::<Result<Vec<_>, ConfigError>>()?;
    // The master's credentials and protocol, parsed (and percent-decoded) by redis-rs.
    let master_info = Url {
        scheme: "redis",
        fragment: None,
        ..url.clone()
    }
    .rebuild("localhost", &format!("/{db}"))
    .into_connection_info()
    .map_err(|e| ConfigError::new(format!("bad sentinel URL: {e}")))?;
    let mut info = SentinelNodeConnectionInfo::default()
        .set_redis_connection_info(master_info.redis_settings().clone());
    if tls {
        info = info.set_tls_mode(if url.fragment == Some("insecure") {
            TlsMode::Insecure
        } else {
            TlsMode::Secure
        });
    }
    let mut node = SentinelNode::with_master_info(sentinels, &master, info)?;
    if let Some((replicas, timeout)) = wait {
        node = node.wait_for_replicas(replicas, timeout);
    }
    Ok(Arc::new(node))
}

#[cfg(feature = "sentinel")]
fn has_port(host: &str) -> bool {
    match host.rsplit_once(':') {
        // `[v6]` alone has colons only inside the brackets.
        Some((before, port)) => {
            !port.ends_with(']') && !before.is_empty() && port.parse::<u16>().is_ok()
        }
        None => false,
    }
}

/// A node URL split into its parts. Kept as slices of the input so that the parts
/// handed on to redis-rs stay exactly as written (percent-encoding included).
#[derive(Clone)]
struct Url<'a> {
    scheme: &'a str,
    userinfo: Option<&'a str>,
    hosts: Vec<&'a str>,
    path: &'a str,
    /// Query parameters not consumed here, as written.
    query: Vec<(&'a str, &'a str)>,
    fragment: Option<&'a str>,
}

/// The schemes [`node_from_url`] knows.
const SCHEMES: [&str; 10] = [
    "redis",
    "rediss",
    "valkey",
    "valkeys",
    "unix",
    "redis+unix",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
];

/// Parameters this crate reads; everything else goes on to redis-rs.
const OWN_PARAMS: [&str; 5] = [
    "tcp_nodelay",
    "wait_replicas",
    "wait_timeout_ms",
    "sentinel_username",
    "sentinel_password",
];

impl<'a> Url<'a> {
    fn parse(s: &'a str) -> Result<Self, ConfigError> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| ConfigError::new("a node URL starts with a scheme such as redis://"))?;
        // Schemes are case-insensitive (RFC 3986): `REDIS://` is `redis://`.
        let scheme = SCHEMES
            .iter()
            .find(|known| known.eq_ignore_ascii_case(scheme))
            .copied()
            .unwrap_or(scheme);
        let (rest, fragment) = match rest.split_once('#') {
            Some((rest, fragment)) => (rest, Some(fragment)),
            None => (rest, None),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, query),
            None => (rest, ""),
        };
        let unix = matches!(scheme, "unix" | "redis+unix");
        let (authority, path) = match rest.find('/') {
            Some(i) if !unix => rest.split_at(i),
            _ if unix => ("", rest),
            _ => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let hosts: Vec<&str> = if unix {
            Vec::new()
        } else {
            hosts.split(',').map(str::trim).collect()
        };
        if !unix && hosts.iter().any(|h| h.is_empty()) {
            return Err(ConfigError::new(format!(
                "a {scheme}:// URL needs host[:port] (several separated by commas for clusters and sentinels)"
            )));
        }
        if hosts.len() > 1 && matches!(scheme, "redis" | "rediss" | "valkey" | "valkeys") {
            return Err(ConfigError::new(format!(
                "a {scheme}:// URL names one server; use {scheme}+cluster:// or {scheme}+sentinel:// for several hosts"
            )));
        }
        let query = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| p.split_once('=').unwrap_or((p, "")))
            .collect();
        Ok(Url {
            scheme,
            userinfo,
            hosts,
            path,
            query,
            fragment,
        })
    }

    /// The value of one of this crate's own parameters, percent-decoded.
    fn param(&self, name: &str) -> Result<Option<String>, ConfigError> {
        self.query
            .iter()
            .rev()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| percent_decode(v))
            .transpose()
    }

    fn nodelay(&self) -> Result<Option<bool>, ConfigError> {
        match self.param("tcp_nodelay")?.as_deref() {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(other) => Err(ConfigError::new(format!(
                "tcp_nodelay must be true or false, got `{other}`"
            ))),
        }
    }

    fn wait(&self) -> Result<Option<(usize, Duration)>, ConfigError> {
        let Some(replicas) = self.param("wait_replicas")? else {
            return Ok(None);
        };
        let replicas: usize = replicas.parse().map_err(|_| {
            ConfigError::new(format!("wait_replicas must be a number, got `{replicas}`"))
        })?;
        let timeout = match self.param("wait_timeout_ms")? {
            None => DEFAULT_WAIT_TIMEOUT,
            Some(ms) => Duration::from_millis(ms.parse().map_err(|_| {
                ConfigError::new(format!("wait_timeout_ms must be a number, got `{ms}`"))
            })?),
        };
        Ok((replicas > 0).then_some((replicas, timeout)))
    }

    /// A URL for redis-rs: this one's scheme, credentials, remaining query and fragment,
    /// with `host` and `path`.
    fn rebuild(&self, host: &str, path: &str) -> String {
        let mut out = format!("{}://", self.scheme);
        if let Some(userinfo) = self.userinfo {
            out.push_str(userinfo);
            out.push('@');
        }
        out.push_str(host);
        out.push_str(path);
        let query: Vec<String> = self
            .query
            .iter()
            .filter(|(k, _)| !OWN_PARAMS.contains(k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if !query.is_empty() {
            out.push('?');
            out.push_str(&query.join("&"));
        }
        if let Some(fragment) = self.fragment {
            out.push('#');
            out.push_str(fragment);
        }
        out
    }
}

#[cfg(test)]
mod tests;
