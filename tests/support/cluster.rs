//! Redis Cluster and Sentinel set-ups on loopback, built from [`RedisServer`]s.
//!
//! ```ignore
//! let cluster = support::cluster::RedisCluster::start(3, 0); // 3 masters, no replicas
//! let url = cluster.url();   // redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/
//! let group = support::cluster::SentinelGroup::start();
//! let url = group.url();     // redis+sentinel://127.0.0.1:PS/m
//! group.failover();          // SENTINEL FAILOVER, returns once the sentinel names the new master
//! ```
//!
//! Cluster nodes run with `--cluster-enabled yes`, their cluster bus on a port picked
//! free (`--cluster-port`), and are joined with `redis-cli --cluster create` (so
//! `redis-cli` must be on `PATH` next to `redis-server`, or `$REDIS_CLI` set). The
//! sentinel is `redis-server sentinel.conf --sentinel`, killed on drop like the servers.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::resp::Connection;
use super::{
    eventually_blocking, free_port, read_from, redis_server_binary, RedisServer,
    RedisServerBuilder, RespValue, COUNTER, READY_TIMEOUT,
};

/// How long a cluster may take to agree on its topology or a failover to complete.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// A Redis Cluster of `masters × (1 + replicas)` servers on loopback.
pub struct RedisCluster {
    /// Every node, in start order (roles change with failovers: ask [`RedisCluster::role`]).
    pub nodes: Vec<RedisServer>,
    password: Option<String>,
}

/// Options of a [`RedisCluster`].
#[derive(Debug, Clone, Default)]
pub struct RedisClusterBuilder {
    masters: usize,
    replicas: usize,
    password: Option<String>,
    node_timeout_ms: Option<u64>,
}

impl RedisClusterBuilder {
    /// `--requirepass` (and `--masterauth`) on every node.
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// `--cluster-node-timeout` (default 2000 ms).
    pub fn node_timeout_ms(mut self, ms: u64) -> Self {
        self.node_timeout_ms = Some(ms);
        self
    }

    /// Starts the servers, creates the cluster and waits until every node reports
    /// `cluster_state:ok`, knows every other node, and every replica is in sync.
    pub fn start(self) -> RedisCluster {
        assert!(
            self.masters >= 3,
            "redis-cli --cluster create needs 3 masters"
        );
        let total = self.masters * (1 + self.replicas);
        let nodes: Vec<RedisServer> = (0..total)
            .map(|_| {
                let mut builder: RedisServerBuilder = RedisServer::builder()
                    .arg("--cluster-enabled", "yes")
                    .arg("--cluster-config-file", "nodes.conf")
                    .arg(
                        "--cluster-node-timeout",
                        self.node_timeout_ms.unwrap_or(2000).to_string(),
                    )
                    // The bus port defaults to port + 10000, which may not exist.
                    .arg("--cluster-port", free_port().to_string())
                    .arg("--cluster-require-full-coverage", "yes")
                    // Replicas sync at once instead of after the default 5 s.
                    .arg("--repl-diskless-sync-delay", "0");
                if let Some(password) = &self.password {
                    builder = builder
                        .password(password.clone())
                        .arg("--masterauth", password.clone());
                }
                builder.start()
            })
            .collect();
        let mut create = Command::new(redis_cli_binary());
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(node.addr().to_string());
        }
        create
            .args([
                "--cluster-replicas",
                &self.replicas.to_string(),
                "--cluster-yes",
            ])
            .stdin(Stdio::null());
        if let Some(password) = &self.password {
            create.env("REDISCLI_AUTH", password);
        }
        let output = create.output().expect("running redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster {
            nodes,
            password: self.password,
        };
        cluster.wait_settled();
        cluster
    }
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// For a replica, the id of its master.
    pub master_id: Option<String>,
    pub failed: bool,
}

impl RedisCluster {
    /// A cluster of `masters` masters with `replicas` replicas each.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        Self::builder(masters, replicas).start()
    }

    pub fn builder(masters: usize, replicas: usize) -> RedisClusterBuilder {
        RedisClusterBuilder {
            masters,
            replicas,
            ..RedisClusterBuilder::default()
        }
    }

    /// `redis+cluster://[:password@]127.0.0.1:P1,…/` with every node as a seed.
    pub fn url(&self) -> String {
        self.url_with_credentials(self.password.as_deref().map(|p| format!(":{p}")).as_deref())
    }

    /// The cluster URL with `userinfo` (`user:password`, or `:password`) instead.
    pub fn url_with_credentials(&self, userinfo: Option<&str>) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| n.addr().to_string()).collect();
        match userinfo {
            Some(userinfo) => format!("redis+cluster://{userinfo}@{}/", hosts.join(",")),
            None => format!("redis+cluster://{}/", hosts.join(",")),
        }
    }

    /// Runs `args` on every node (e.g. `ACL SETUSER`, not propagated by the cluster).
    pub fn on_every_node(&self, args: &[&str]) {
        for node in &self.nodes {
            let reply = node.cmd(args);
            assert!(
                !matches!(reply, RespValue::Error(_)),
                "{args:?} on {}: {reply:?}",
                node.port()
            );
        }
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// The node on `port`, to pause, resume or kill it.
    pub fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// `CLUSTER KEYSLOT key`.
    pub fn slot(&self, key: &str) -> u16 {
        match self.nodes[0].cmd(&["CLUSTER", "KEYSLOT", key]) {
            RespValue::Integer(slot) => u16::try_from(slot).expect("slot"),
            other => panic!("CLUSTER KEYSLOT {key}: {other:?}"),
        }
    }

    /// `CLUSTER NODES` as seen by the node on `port`.
    pub fn topology_seen_by(&self, port: u16) -> (Vec<ClusterNodeInfo>, Vec<(u16, u16, u16)>) {
        let text = self
            .node(port)
            .cmd(&["CLUSTER", "NODES"])
            .to_string_lossy()
            .expect("CLUSTER NODES");
        let mut nodes = Vec::new();
        let mut slots = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port: u16 = fields[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("CLUSTER NODES line: {line}"));
            let flags = fields[2];
            let master = flags.split(',').any(|f| f == "master");
            nodes.push(ClusterNodeInfo {
                id: fields[0].to_owned(),
                port,
                master,
                master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
                failed: flags.split(',').any(|f| f == "fail" || f == "fail?"),
            });
            if master {
                for range in &fields[8..] {
                    if range.starts_with('[') {
                        continue; // a slot being migrated
                    }
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    slots.push((from.parse().unwrap(), to.parse().unwrap(), port));
                }
            }
        }
        (nodes, slots)
    }

    /// The port of the master serving `slot`, according to the node on `seen_by`.
    pub fn master_of_slot(&self, slot: u16, seen_by: u16) -> u16 {
        let (_, slots) = self.topology_seen_by(seen_by);
        slots
            .iter()
            .find(|(from, to, _)| (*from..=*to).contains(&slot))
            .map(|(_, _, port)| *port)
            .unwrap_or_else(|| panic!("slot {slot} not served"))
    }

    /// The ports of the replicas of the master on `master_port`.
    pub fn replicas_of(&self, master_port: u16) -> Vec<u16> {
        let (nodes, _) = self.topology_seen_by(master_port);
        let id = nodes
            .iter()
            .find(|n| n.port == master_port)
            .map(|n| n.id.clone())
            .expect("master in its own CLUSTER NODES");
        nodes
            .iter()
            .filter(|n| n.master_id.as_deref() == Some(&id))
            .map(|n| n.port)
            .collect()
    }

    /// `ROLE` of the node on `port`: `"master"` or `"slave"`.
    pub fn role(&self, port: u16) -> String {
        match self.node(port).cmd(&["ROLE"]) {
            RespValue::Array(items) => items[0].to_string_lossy().expect("ROLE"),
            other => panic!("ROLE: {other:?}"),
        }
    }

    /// `CLUSTER FAILOVER` on the replica on `replica_port` (a coordinated failover: the
    /// replica first catches up with its master), then waits until every node agrees
    /// that it serves its master's slots.
    pub fn failover(&self, replica_port: u16) {
        let reply = self.node(replica_port).cmd(&["CLUSTER", "FAILOVER"]);
        assert!(reply.is_ok(), "CLUSTER FAILOVER: {reply:?}");
        eventually_blocking("the replica to become master", SETTLE_TIMEOUT, || {
            self.role(replica_port) == "master"
        });
        self.wait_settled();
    }

    /// Waits until every node says `cluster_state:ok`, knows every node, sees the same
    /// masters, and every replica's link is up.
    pub fn wait_settled(&self) {
        let total = self.nodes.len().to_string();
        eventually_blocking("the cluster to settle", SETTLE_TIMEOUT, || {
            let mut masters_seen = None;
            for node in &self.nodes {
                let info = node
                    .cmd(&["CLUSTER", "INFO"])
                    .to_string_lossy()
                    .unwrap_or_default();
                let field = |name: &str| {
                    info.lines()
                        .find_map(|l| {
                            l.trim()
                                .strip_prefix(name)?
                                .strip_prefix(':')
                                .map(str::to_owned)
                        })
                        .unwrap_or_default()
                };
                if field("cluster_state") != "ok" || field("cluster_known_nodes") != total {
                    return false;
                }
                let (nodes, _) = self.topology_seen_by(node.port());
                let mut masters: Vec<u16> = nodes
                    .iter()
                    .filter(|n| n.master && !n.failed)
                    .map(|n| n.port)
                    .collect();
                masters.sort_unstable();
                if masters_seen.get_or_insert_with(|| masters.clone()) != &masters {
                    return false;
                }
                let replication = node
                    .cmd(&["INFO", "replication"])
                    .to_string_lossy()
                    .unwrap_or_default();
                if replication.contains("role:slave")
                    && !replication.contains("master_link_status:up")
                {
                    return false;
                }
                let known_replicas = nodes
                    .iter()
                    .filter(|n| {
                        !n.failed
                            && n.master_id.is_some()
                            && nodes.iter().any(|m| {
                                m.port == node.port() && Some(&m.id) == n.master_id.as_ref()
                            })
                    })
                    .count();
                if replication.contains("role:master") && online_replicas(node) < known_replicas {
                    return false;
                }
            }
            true
        });
    }
}

/// Waits until `replicas` replicas acknowledge a write on `master` (`WAIT` after a
/// write, on one connection). A replica reports its link up as soon as it loaded the
/// master's data, but after a full sync the master streams writes to it only once it
/// acknowledged, up to a second later.
pub fn wait_replicas_online(master: &RedisServer, replicas: usize) {
    let wanted = i64::try_from(replicas).unwrap();
    eventually_blocking("the replicas to acknowledge writes", SETTLE_TIMEOUT, || {
        let Ok(mut conn) = master.connect(Duration::from_secs(2)) else {
            return false;
        };
        let written = conn.call_str(&["INCR", "support:replication-probe"]);
        let acked = conn.call_str(&["WAIT", &replicas.to_string(), "100"]);
        matches!(written, Ok(RespValue::Integer(_)))
            && matches!(acked, Ok(RespValue::Integer(n)) if n >= wanted)
    });
}

/// The replicas `master` counts as online (`INFO replication`).
pub fn online_replicas(master: &RedisServer) -> usize {
    master
        .cmd(&["INFO", "replication"])
        .to_string_lossy()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
        .count()
}

/// A port that was free on 127.0.0.1 a moment ago (for a second listener such as
/// `--tls-port`).
pub fn spare_port() -> u16 {
    free_port()
}

/// `$REDIS_CLI`, else `redis-cli` next to the `redis-server` in use, else on `PATH`.
fn redis_cli_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_CLI").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let server = redis_server_binary();
    let sibling = server.with_file_name("redis-cli");
    if sibling.is_file() {
        return sibling;
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("redis-cli"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("redis-cli not found on PATH (needed to create a cluster)"))
}

/// One master, one replica (`--replicaof`) and one sentinel monitoring them as `m`
/// (`down-after-milliseconds 1000`, `failover-timeout 3000`).
pub struct SentinelGroup {
    /// The servers, in start order (the first starts as the master).
    pub servers: Vec<RedisServer>,
    pub sentinel: SentinelServer,
    pub name: String,
    password: Option<String>,
}

impl SentinelGroup {
    pub fn start() -> SentinelGroup {
        Self::start_with(None)
    }

    /// With `--requirepass password` (and `--masterauth`) on the servers; the sentinel
    /// itself has no password (`sentinel auth-pass` lets it reach the servers).
    pub fn start_with(password: Option<&str>) -> SentinelGroup {
        let server = |extra: &[String]| {
            let mut builder = RedisServer::builder()
                // Replicas sync at once instead of after the default 5 s.
                .arg("--repl-diskless-sync-delay", "0")
                .raw_args(extra.iter().cloned());
            if let Some(password) = password {
                builder = builder.password(password).arg("--masterauth", password);
            }
            builder.start()
        };
        let master = server(&[]);
        let replica = server(&[
            "--replicaof".into(),
            "127.0.0.1".into(),
            master.port().to_string(),
        ]);
        wait_replicas_online(&master, 1);
        let name = "m".to_owned();
        let mut conf = format!(
            "sentinel monitor {name} 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds {name} 1000\n\
             sentinel failover-timeout {name} 3000\n\
             sentinel parallel-syncs {name} 1\n",
            master.port()
        );
        if let Some(password) = password {
            conf.push_str(&format!("sentinel auth-pass {name} {password}\n"));
        }
        let sentinel = SentinelServer::start(&conf);
        let group = SentinelGroup {
            servers: vec![master, replica],
            sentinel,
            name,
            password: password.map(str::to_owned),
        };
        group.wait_replicas_known();
        group
    }

    /// `redis+sentinel://[:password@]127.0.0.1:PS/m`.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!(
                "redis+sentinel://:{p}@{}/{}",
                self.sentinel.addr(),
                self.name
            ),
            None => format!("redis+sentinel://{}/{}", self.sentinel.addr(), self.name),
        }
    }

    /// The port of the master according to the sentinel.
    pub fn master_port(&self) -> u16 {
        match self
            .sentinel
            .cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name])
        {
            RespValue::Array(items) => items[1]
                .to_string_lossy()
                .and_then(|p| p.parse().ok())
                .expect("port"),
            other => panic!("SENTINEL GET-MASTER-ADDR-BY-NAME: {other:?}"),
        }
    }

    /// The server on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .unwrap_or_else(|| panic!("no server on port {port}"))
    }

    /// `ROLE` of the server on `port` (`"?"` when the connection was closed: the
    /// sentinel kills the clients of the servers it reconfigures).
    pub fn role(&self, port: u16) -> String {
        match self.server(port).try_cmd(&["ROLE"], Duration::from_secs(5)) {
            Ok(RespValue::Array(items)) => items[0].to_string_lossy().expect("ROLE"),
            Ok(other) => panic!("ROLE: {other:?}"),
            Err(_) => "?".to_owned(),
        }
    }

    /// `SENTINEL FAILOVER`; returns the new master's port once the sentinel names it and
    /// it answers `ROLE` as master. The old master may still think it is a master for
    /// a few seconds (until the sentinel reconfigures it).
    pub fn failover(&self) -> u16 {
        let old = self.master_port();
        self.wait_replicas_known();
        eventually_blocking("SENTINEL FAILOVER to be accepted", SETTLE_TIMEOUT, || {
            match self.sentinel.cmd(&["SENTINEL", "FAILOVER", &self.name]) {
                RespValue::Simple(s) if s == "OK" => true,
                // NOGOODSLAVE while the sentinel has not seen the replica healthy yet,
                // INPROG while an earlier failover is still finishing.
                RespValue::Error(_) => false,
                other => panic!("SENTINEL FAILOVER: {other:?}"),
            }
        });
        eventually_blocking("the sentinel to switch masters", SETTLE_TIMEOUT, || {
            self.master_port() != old
        });
        let new = self.master_port();
        eventually_blocking("the new master to be a master", SETTLE_TIMEOUT, || {
            self.role(new) == "master"
        });
        new
    }

    /// Waits until the old master has been turned into a replica of the new one.
    pub fn wait_demoted(&self, port: u16) {
        eventually_blocking("the old master to be demoted", SETTLE_TIMEOUT, || {
            self.role(port) == "slave"
        });
    }

    /// Waits until the sentinel sees a healthy replica of the current master.
    fn wait_replicas_known(&self) {
        eventually_blocking(
            "the sentinel to know a healthy replica",
            SETTLE_TIMEOUT,
            || match self.sentinel.cmd(&["SENTINEL", "REPLICAS", &self.name]) {
                RespValue::Array(replicas) => replicas.iter().any(|r| {
                    let Some(fields) = r.as_array() else {
                        return false;
                    };
                    let field = |name: &str| {
                        fields
                            .chunks(2)
                            .find(|kv| kv[0].as_str() == Some(name))
                            .and_then(|kv| kv[1].to_string_lossy())
                    };
                    field("flags").is_some_and(|f| f == "slave")
                        && field("master-link-status").as_deref() == Some("ok")
                }),
                _ => false,
            },
        );
    }
}

/// A `redis-server --sentinel` process with its own config file and directory.
pub struct SentinelServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl SentinelServer {
    /// Starts a sentinel with `conf` (the `sentinel …` lines) on a free port.
    pub fn start(conf: &str) -> SentinelServer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "tower-redlock-test-{}-{}-sentinel-{port}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("sentinel dir");
        let conf_path = dir.join("sentinel.conf");
        std::fs::write(
            &conf_path,
            format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {}\nlogfile {}\n{conf}",
                dir.display(),
                dir.join("sentinel.log").display()
            ),
        )
        .expect("writing sentinel.conf");
        let child = Command::new(redis_server_binary())
            .arg(&conf_path)
            .arg("--sentinel")
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting redis-server --sentinel");
        let mut sentinel = SentinelServer {
            port,
            dir,
            child: Some(child),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = sentinel
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                sentinel.child = None;
                panic!(
                    "sentinel on port {port} exited during start-up ({status}):\n{}",
                    sentinel.log()
                );
            }
            let up = Connection::open(sentinel.addr(), Duration::from_millis(500))
                .and_then(|mut c| c.call_str(&["PING"]))
                .is_ok_and(|r| r == RespValue::Simple("PONG".into()));
            if up {
                return sentinel;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel on port {port} not ready:\n{}",
                sentinel.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// SIGSTOP: the sentinel accepts connections but answers nothing. Returns once
    /// the process is stopped.
    pub fn pause(&self) {
        self.signal("STOP", |s| s == Some('T'));
    }

    /// SIGCONT after [`SentinelServer::pause`].
    pub fn resume(&self) {
        self.signal("CONT", |s| s != Some('T'));
    }

    fn signal(&self, signal: &str, done: impl Fn(Option<char>) -> bool) {
        let pid = self.child.as_ref().expect("sentinel running").id();
        super::send_signal(pid, signal).expect("signalling the sentinel");
        let deadline = Instant::now() + READY_TIMEOUT;
        while !done(super::proc_state(pid)) {
            assert!(
                Instant::now() < deadline,
                "sentinel pid {pid}: SIG{signal} not seen"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log(&self) -> String {
        read_from(&self.dir.join("sentinel.log"), 0)
    }

    /// One command on a fresh connection.
    pub fn cmd(&self, args: &[&str]) -> RespValue {
        Connection::open(self.addr(), Duration::from_secs(5))
            .and_then(|mut c| c.call_str(args))
            .unwrap_or_else(|e| panic!("sentinel on port {}: {args:?}: {e}", self.port))
    }
}

impl Drop for SentinelServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
