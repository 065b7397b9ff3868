//! [`ServerSetup`]: what a node's servers say about the settings a lock relies on, for
//! the checks of [`Redlock::connect`](crate::Redlock::connect) and its periodic
//! re-check (see [`Node::server_setup`](crate::node::Node::server_setup)).

/// What one server of a node reports about the settings a lock relies on. A node kind
/// fills in what it can tell; `None` and empty mean "not known", never "bad".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSetup {
    /// The server, for messages (an address, no credentials).
    pub server: String,
    /// Its replication role (Redis's `INFO replication` `role`: `master` or `slave`;
    /// PostgreSQL's `primary`, `standby` or `read-only`). A lock needs a server that
    /// accepts writes.
    pub role: Option<String>,
    /// Its eviction policy (Redis's `INFO memory` `maxmemory_policy`). Every policy but
    /// `noeviction` may delete a held lock key under memory pressure (lock keys all
    /// have a ttl, so the `volatile-*` policies evict them too), and a second holder
    /// then gets the lock.
    pub maxmemory_policy: Option<String>,
    /// What the connection's user is refused that the locker needs, each naming the
    /// permission (for example `+evalsha`, `~redlock:*`). A lock cannot work without
    /// them.
    pub refused: Vec<String>,
    /// Commands the locker needs that the server does not know (renamed or removed
    /// with Redis's `rename-command`), by name. A lock cannot work without them.
    pub missing: Vec<String>,
    /// The user may not publish on the crate's wake-up channels (Redis's `&` channel
    /// permissions): releases cannot wake waiters, who then find a freed lock by
    /// polling.
    pub channels_refused: bool,
    /// Whether the server keeps its keys across a restart (Redis: `INFO persistence`
    /// `aof_enabled`, or RDB snapshots in `CONFIG GET save`): `Some(false)` when it
    /// persists nothing and comes back empty. Idempotent replay's records are lost with
    /// it (see [`crate::record`]).
    pub persists: Option<bool>,
}

impl ServerSetup {
    /// A setup of `server` with nothing known yet.
    pub fn new(server: impl Into<String>) -> Self {
        ServerSetup {
            server: server.into(),
            ..ServerSetup::default()
        }
    }

    /// Whether `maxmemory_policy` is known to evict keys.
    pub fn evicts(&self) -> bool {
        self.maxmemory_policy
            .as_deref()
            .is_some_and(|policy| policy != "noeviction")
    }

    /// Whether `role` is known and does not accept writes (neither a master's nor a
    /// primary's).
    pub fn is_replica(&self) -> bool {
        self.role
            .as_deref()
            .is_some_and(|role| role != "master" && role != "primary")
    }
}

/// Reads `role`, `maxmemory_policy` and `aof_enabled` from the text of `INFO` (any
/// sections).
#[cfg(feature = "redis")]
pub(crate) fn parse_info(server: impl Into<String>, info: &str) -> ServerSetup {
    let mut setup = ServerSetup::new(server);
    for line in info.lines() {
        let Some((field, value)) = line.trim().split_once(':') else {
            continue;
        };
        match field {
            "role" => setup.role = Some(value.to_owned()),
            "maxmemory_policy" => setup.maxmemory_policy = Some(value.to_owned()),
            // Without AOF, whether RDB snapshots are taken is `CONFIG GET save`'s.
            "aof_enabled" if value == "1" => setup.persists = Some(true),
            _ => {}
        }
    }
    setup
}
