//! A Redis node from its URL (see [`node_from_url`](crate::node_from_url)).

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

/// A Redis node (standalone, cluster or Sentinel) from its URL, for
/// [`node_from_url`](crate::node_from_url), whose documentation says the forms.
pub(crate) fn redis_node(s: &str) -> Result<Arc<dyn Node>, ConfigError> {
    let url = Url::parse(s)?;
    let (replicas, timeout) = url.wait()?;
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
            Ok(Arc::new(node.wait_for_replicas(replicas, timeout)))
        }
        #[cfg(feature = "cluster")]
        "redis+cluster" | "rediss+cluster" => cluster(&url, nodelay, (replicas, timeout)),
        #[cfg(feature = "sentinel")]
        "redis+sentinel" | "rediss+sentinel" => sentinel(&url, (replicas, timeout)),
        #[cfg(not(feature = "cluster"))]
        "redis+cluster" | "rediss+cluster" => Err(needs_feature(url.scheme, "cluster")),
        #[cfg(not(feature = "sentinel"))]
        "redis+sentinel" | "rediss+sentinel" => Err(needs_feature(url.scheme, "sentinel")),
        other => Err(ConfigError::new(format!(
            "unknown URL scheme `{other}`: expected redis://, rediss://, redis+cluster://, \
             rediss+cluster://, redis+sentinel://, rediss+sentinel://, etcd:// or postgres://"
        ))),
    }
}

#[cfg(feature = "cluster")]
fn cluster(
    url: &Url<'_>,
    nodelay: Option<bool>,
    (replicas, timeout): (usize, Duration),
) -> Result<Arc<dyn Node>, ConfigError> {
    let base = url.base();
    let seeds: Vec<_> = url
        .hosts
        .iter()
        .map(|h| base.rebuild(h, url.path))
        .collect();
    let node = match nodelay {
        None => ClusterNode::open(seeds)?,
        Some(nodelay) => ClusterNode::with_config(seeds, move |builder| {
            builder.tcp_settings(TcpSettings::default().set_nodelay(nodelay))
        })?,
    };
    Ok(Arc::new(node.wait_for_replicas(replicas, timeout)))
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
fn sentinel(
    url: &Url<'_>,
    (replicas, timeout): (usize, Duration),
) -> Result<Arc<dyn Node>, ConfigError> {
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
    let bare = Url {
        userinfo: None,
        query: Vec::new(),
        ..url.base()
    };
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
    let node = SentinelNode::with_master_info(sentinels, &master, info)?;
    Ok(Arc::new(node.wait_for_replicas(replicas, timeout)))
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

/// The Redis schemes [`node_from_url`](crate::node_from_url) knows.
const SCHEMES: &str = "redis rediss valkey valkeys unix redis+unix redis+cluster rediss+cluster \
                       redis+sentinel rediss+sentinel";

/// Parameters this crate reads; everything else goes on to redis-rs.
const OWN_PARAMS: &str =
    "tcp_nodelay wait_replicas wait_timeout_ms sentinel_username sentinel_password";

impl<'a> Url<'a> {
    fn parse(s: &'a str) -> Result<Self, ConfigError> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| ConfigError::new("a node URL starts with a scheme such as redis://"))?;
        // Schemes are case-insensitive (RFC 3986): `REDIS://` is `redis://`.
        let scheme = SCHEMES
            .split_whitespace()
            .find(|known| known.eq_ignore_ascii_case(scheme))
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

    /// This URL with the scheme of the servers it names (`rediss+cluster`: `rediss`).
    #[cfg(any(feature = "cluster", feature = "sentinel"))]
    fn base(&self) -> Url<'a> {
        let scheme = self.scheme.split('+').next().unwrap_or(self.scheme);
        Url {
            scheme,
            ..self.clone()
        }
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

    /// The replicas to wait for (0: none) and the timeout.
    fn wait(&self) -> Result<(usize, Duration), ConfigError> {
        let Some(replicas) = self.param("wait_replicas")? else {
            return Ok((0, DEFAULT_WAIT_TIMEOUT));
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
        Ok((replicas, timeout))
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
            .filter(|(k, _)| !OWN_PARAMS.split(' ').any(|own| own == *k))
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
