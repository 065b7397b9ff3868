//! Test support: real `redis-server` processes on free loopback ports.
//!
//! Include from an integration test with `mod support;`, then e.g.
//!
//! ```ignore
//! let redis = support::RedisServer::start();
//! let url = redis.url(); // redis://127.0.0.1:PORT/0
//! redis.pause(); /* ... */ redis.resume();
//! redis.kill(); redis.restart();
//! assert_eq!(redis.get("key"), None);
//! ```
//!
//! Persistence, when asked for (the default is none: `--save '' --appendonly no`):
//!
//! ```ignore
//! let mut redis = support::RedisServer::builder().aof(support::AppendFsync::EverySec).start();
//! let backup = redis.snapshot();   // the persisted files as they are now, copied aside
//! /* ... more writes ... */
//! redis.restart_from(&backup);     // SIGKILL, put the old files back, start: stale state
//! redis.restart();                 // SIGKILL and start on the files as they are
//! ```
//!
//! The binary is `$REDIS_SERVER` if set, else `redis-server` from `PATH`.
//! Every server binds 127.0.0.1 only, on a port picked free at start (never the
//! system Redis on 6379), with its own temporary directory. Dropping a
//! [`RedisServer`] kills the process, waits for it and removes the directory,
//! also when the test panicked.
//!
//! Limitation: if the test process itself is killed hard (SIGKILL, abort), its
//! `Drop`s do not run and the `redis-server` children are left running; they
//! hold only a loopback port and a temp dir named `tower-redlock-test-*`.
//! (Killing them with the parent would need `prctl(PR_SET_PDEATHSIG)`, i.e. a
//! `libc` dev-dependency, and that signal follows the spawning *thread*, which
//! ends with each test.)
#![allow(dead_code)]

pub mod cluster;
pub mod etcd;
mod eventually;
pub mod history;
pub mod node_calls;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod proxy;
pub mod resp;
pub mod sockets;

#[allow(unused_imports)] // not every test file uses every helper
pub use eventually::{eventually, eventually_async, eventually_blocking, POLL_INTERVAL};
#[allow(unused_imports)]
pub use resp::RespValue;

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use resp::Connection;

/// Per-node timeout for tests that do not test timeouts: the 200 ms default is sized for
/// production, and on a machine busy with other builds a healthy local server can answer
/// later than that, turning the test's request into a 503. An upper bound only, reached
/// when something is wrong.
pub const PATIENT_NODE_TIMEOUT: Duration = Duration::from_secs(2);

/// `LockOptions::default()` with [`PATIENT_NODE_TIMEOUT`].
pub fn patient() -> tower_redlock::LockOptions {
    tower_redlock::LockOptions::default().node_timeout(PATIENT_NODE_TIMEOUT)
}

/// How long a start or restart may take before the test fails.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Connect/read/write timeout of [`RedisServer::cmd`] and friends.
const CMD_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeouts of one readiness probe.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Fresh ports tried by [`RedisServer::start`] when the chosen one was taken.
const START_ATTEMPTS: usize = 5;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// What the helper last did to the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerState {
    Running,
    /// Stopped with SIGSTOP: the port accepts connections but nothing answers.
    Paused,
    /// Killed (or never came up); [`RedisServer::restart`] brings it back.
    Killed,
}

/// When an AOF server fsyncs its log (`--appendfsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendFsync {
    /// Before every write is acknowledged: a crash loses nothing acknowledged.
    Always,
    /// Once a second: a machine crash may lose the last second. A SIGKILL of the
    /// process alone loses nothing (the data is in the kernel already); model the lost
    /// tail with [`RedisServer::snapshot`] and [`RedisServer::restart_from`].
    EverySec,
}

impl AppendFsync {
    fn as_arg(self) -> &'static str {
        match self {
            AppendFsync::Always => "always",
            AppendFsync::EverySec => "everysec",
        }
    }
}

/// RDB file name unless [`RedisServerBuilder::dbfilename`] says otherwise.
const DEFAULT_DBFILENAME: &str = "dump.rdb";
/// Directory of Redis 7's multi-part AOF (`--appenddirname`, its default).
const AOF_DIRNAME: &str = "appendonlydir";

/// Configuration for a [`RedisServer`]; from [`RedisServer::builder`].
#[derive(Debug, Clone, Default)]
pub struct RedisServerBuilder {
    aof: Option<AppendFsync>,
    save_schedule: Option<String>,
    dbfilename: Option<String>,
    password: Option<String>,
    extra_args: Vec<String>,
}

impl RedisServerBuilder {
    /// AOF persistence with `appendfsync always` (`true`), or none (`false`): a
    /// [`RedisServer::restart`] then reloads the data from the same directory.
    pub fn appendonly(mut self, on: bool) -> Self {
        self.aof = on.then_some(AppendFsync::Always);
        self
    }

    /// AOF persistence (`--appendonly yes --appendfsync <fsync>`).
    pub fn aof(mut self, fsync: AppendFsync) -> Self {
        self.aof = Some(fsync);
        self
    }

    /// Automatic RDB snapshots: `--save <schedule>`, e.g. `"3600 1 300 100 60 10000"`
    /// (Redis's default). Without it the server never saves on its own; an explicit
    /// [`RedisServer::save`] or [`RedisServer::bgsave`] writes the RDB file anyway, and
    /// a (re)start loads that file when AOF is off.
    pub fn save_schedule(mut self, schedule: impl Into<String>) -> Self {
        self.save_schedule = Some(schedule.into());
        self
    }

    /// `--dbfilename` (default `dump.rdb`), inside the server's own directory.
    pub fn dbfilename(mut self, name: impl Into<String>) -> Self {
        self.dbfilename = Some(name.into());
        self
    }

    /// `--requirepass`: [`RedisServer::url`] and the helpers' own connections
    /// then authenticate. Keep it URL-safe (no `@`, `:`, `/`, `%`).
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// One extra config option, e.g. `.arg("--maxmemory", "1mb")`.
    pub fn arg(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_args.push(name.into());
        self.extra_args.push(value.into());
        self
    }

    /// Extra raw command-line arguments, appended as they are.
    pub fn raw_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Starts the server and waits until it answers PING.
    pub fn start(self) -> RedisServer {
        RedisServer::start_with(self)
    }
}

/// The persisted files of a [`RedisServer`] at one moment, copied aside by
/// [`RedisServer::snapshot`]; [`RedisServer::restart_from`] brings them back. Lives in
/// the server's directory, so it goes when the server is dropped.
#[derive(Debug, Clone)]
pub struct Snapshot {
    dir: PathBuf,
}

impl Snapshot {
    /// Where the copied files are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A `redis-server` child process owned by a test.
pub struct RedisServer {
    config: RedisServerBuilder,
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    pid: u32,
    state: ServerState,
}

/// Why one attempt to bring the process up failed.
enum StartError {
    /// The port was taken by someone else: try again (another port on start).
    PortTaken(String),
    Fatal(String),
}

impl RedisServer {
    /// Starts a plain server (no persistence) on a free loopback port.
    pub fn start() -> RedisServer {
        Self::builder().start()
    }

    /// Starts `n` independent plain servers.
    pub fn start_many(n: usize) -> Vec<RedisServer> {
        (0..n).map(|_| Self::start()).collect()
    }

    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    fn start_with(config: RedisServerBuilder) -> RedisServer {
        let binary = redis_server_binary();
        let mut last_error = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!(
                "tower-redlock-test-{}-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed),
                port
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
            // From here on, Drop cleans up (process and directory) even on panic.
            let mut server = RedisServer {
                config: config.clone(),
                binary: binary.clone(),
                port,
                dir,
                child: None,
                pid: 0,
                state: ServerState::Killed,
            };
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(StartError::PortTaken(msg)) => last_error = msg,
                Err(StartError::Fatal(msg)) => panic!("{msg}"),
            }
        }
        panic!("redis-server did not start after {START_ATTEMPTS} attempts: {last_error}");
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// `redis://127.0.0.1:PORT/0` (`redis://:PASSWORD@...` with a password).
    pub fn url(&self) -> String {
        match &self.config.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    /// Pid of the current (or, once killed, the last) process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The server's working directory (AOF, `redis.log`, `stderr.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn state(&self) -> ServerState {
        self.state
    }

    /// `true` while the process is alive and not paused.
    pub fn is_running(&self) -> bool {
        self.state == ServerState::Running && process_alive(self.pid)
    }

    /// `redis.log` and anything the process wrote to stderr.
    pub fn log(&self) -> String {
        let mut out = String::new();
        for name in ["redis.log", "stderr.log"] {
            if let Ok(text) = std::fs::read_to_string(self.dir.join(name))
                && !text.trim().is_empty()
            {
                out.push_str(&format!("--- {name} ---\n{text}"));
            }
        }
        out
    }

    /// SIGKILL, then wait for the process. No-op if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.state == ServerState::Paused {
                let _ = send_signal(self.pid, "CONT");
            }
            if let Err(e) = child.kill() {
                // Only fails if it already exited; reap it below anyway.
                eprintln!("redis-server pid {}: kill: {e}", self.pid);
            }
            if let Err(e) = child.wait() {
                panic!("waiting for redis-server pid {}: {e}", self.pid);
            }
        }
        self.state = ServerState::Killed;
    }

    /// SIGSTOP: the process stays alive, connections are accepted by the
    /// kernel but no command is answered. Returns once the process is stopped.
    pub fn pause(&mut self) {
        assert_eq!(
            self.state,
            ServerState::Running,
            "pause(): server not running"
        );
        send_signal(self.pid, "STOP").expect("sending SIGSTOP");
        self.state = ServerState::Paused;
        self.wait_for_proc_state("stopped", |s| s == Some('T'));
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&mut self) {
        assert_eq!(
            self.state,
            ServerState::Paused,
            "resume(): server not paused"
        );
        send_signal(self.pid, "CONT").expect("sending SIGCONT");
        self.state = ServerState::Running;
        self.wait_for_proc_state("resumed", |s| s != Some('T'));
    }

    /// Kills the process if it runs (SIGKILL: nothing is saved on the way out), then
    /// starts it again on the same port, with the same arguments and directory, and
    /// waits until it is ready. The directory is kept, so the server loads what it had
    /// persisted: its AOF, or else its RDB file if one was saved; without either it
    /// comes back empty.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(StartError::PortTaken(_)) if Instant::now() < deadline => {
                    // Someone grabbed our port meanwhile; it may let go.
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(StartError::PortTaken(msg)) | Err(StartError::Fatal(msg)) => {
                    panic!("restart on port {}: {msg}", self.port)
                }
            }
        }
    }

    /// `SAVE`: writes the RDB file now (blocking the server until it is on disk).
    pub fn save(&self) {
        let reply = self.cmd(&["SAVE"]);
        assert!(reply.is_ok(), "SAVE: {reply:?}");
    }

    /// `BGSAVE`, then waits until the forked child has written the RDB file and
    /// checks that it succeeded.
    pub fn bgsave(&self) {
        let reply = self.cmd(&["BGSAVE"]);
        assert!(
            !reply.is_error(),
            "BGSAVE: {reply:?} (is a save already running?)"
        );
        // BGSAVE forks before it answers: the save is in progress from here on.
        eventually_blocking("BGSAVE to finish", READY_TIMEOUT, || {
            self.info_field("persistence", "rdb_bgsave_in_progress")
                .as_deref()
                == Some("0")
        });
        let status = self.info_field("persistence", "rdb_last_bgsave_status");
        assert_eq!(
            status.as_deref(),
            Some("ok"),
            "BGSAVE failed\n{}",
            self.log()
        );
    }

    /// Waits until the AOF buffer is written to the file (`aof_buffer_length:0`), so a
    /// SIGKILL from here on loses nothing acknowledged. Redis normally writes the log
    /// before it answers; with `everysec` it may postpone that write for up to 2 s
    /// while a background fsync runs.
    pub fn wait_aof_written(&self) {
        eventually_blocking("the AOF buffer to reach the file", READY_TIMEOUT, || {
            self.info_field("persistence", "aof_buffer_length")
                .as_deref()
                == Some("0")
        });
    }

    /// One `field:value` line of `INFO section`, if present.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let reply = self.cmd(&["INFO", section]);
        let text = reply.to_string_lossy()?;
        text.lines()
            .filter_map(|line| line.trim().split_once(':'))
            .find(|(name, _)| *name == field)
            .map(|(_, value)| value.to_owned())
    }

    /// The RDB file (`--dir` + `--dbfilename`); it exists once saved.
    pub fn rdb_path(&self) -> PathBuf {
        self.dir.join(self.dbfilename())
    }

    /// The AOF directory (Redis 7's manifest plus base and incremental files).
    pub fn aof_dir(&self) -> PathBuf {
        self.dir.join(AOF_DIRNAME)
    }

    /// Copies the server's persisted state aside, as a backup or a stale restore
    /// would find it later. Without AOF it runs `SAVE` first and copies the RDB file;
    /// with AOF it waits until every acknowledged write is in the AOF
    /// ([`RedisServer::wait_aof_written`]) and copies the AOF directory.
    pub fn snapshot(&self) -> Snapshot {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = self.dir.join(format!("snapshot-{n}"));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        if self.config.aof.is_some() {
            self.wait_aof_written();
            copy_dir(&self.aof_dir(), &dir.join(AOF_DIRNAME));
        } else {
            self.save();
            copy_file(&self.rdb_path(), &dir.join(self.dbfilename()));
        }
        Snapshot { dir }
    }

    /// Kills the process (SIGKILL), replaces its persisted files with those of
    /// `snapshot` and starts it again on the same port, so that it loads them: the
    /// server comes back with the state it had when the snapshot was taken (a restored
    /// backup, an RDB restart that lost the writes since the last save, an AOF that
    /// lost its unsynced tail).
    pub fn restart_from(&mut self, snapshot: &Snapshot) {
        self.kill();
        remove_path(&self.rdb_path());
        remove_path(&self.aof_dir());
        let rdb = snapshot.dir.join(self.dbfilename());
        if rdb.exists() {
            copy_file(&rdb, &self.rdb_path());
        }
        let aof = snapshot.dir.join(AOF_DIRNAME);
        if aof.exists() {
            copy_dir(&aof, &self.aof_dir());
        }
        self.restart();
    }

    fn dbfilename(&self) -> &str {
        self.config
            .dbfilename
            .as_deref()
            .unwrap_or(DEFAULT_DBFILENAME)
    }

    /// Sends one command on a fresh connection and returns the reply
    /// (a Redis error is `RespValue::Error`). Panics on I/O errors.
    pub fn cmd(&self, args: &[&str]) -> RespValue {
        self.try_cmd(args, CMD_TIMEOUT).unwrap_or_else(|e| {
            panic!(
                "redis-server on port {} ({:?}): {args:?}: {e}",
                self.port, self.state
            )
        })
    }

    /// Like [`RedisServer::cmd`] with binary arguments.
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> RespValue {
        self.connect(CMD_TIMEOUT)
            .and_then(|mut c| c.call(args))
            .unwrap_or_else(|e| panic!("redis-server on port {}: {e}", self.port))
    }

    /// Like [`RedisServer::cmd`], but returns I/O errors (refused, timed out)
    /// and uses `timeout` for connect, write and read.
    pub fn try_cmd(&self, args: &[&str], timeout: Duration) -> io::Result<RespValue> {
        self.connect(timeout)?.call_str(args)
    }

    /// `true` if PING gets PONG within `timeout`.
    pub fn ping(&self, timeout: Duration) -> bool {
        matches!(self.try_cmd(&["PING"], timeout), Ok(RespValue::Simple(s)) if s == "PONG")
    }

    /// A fresh connection (authenticated if a password is set).
    pub fn connect(&self, timeout: Duration) -> io::Result<Connection> {
        let mut conn = Connection::open(self.addr(), timeout)?;
        if let Some(password) = &self.config.password {
            match conn.call_str(&["AUTH", password])? {
                RespValue::Simple(_) => {}
                other => return Err(io::Error::other(format!("AUTH failed: {other:?}"))),
            }
        }
        Ok(conn)
    }

    pub fn set(&self, key: &str, value: &str) {
        let reply = self.cmd(&["SET", key, value]);
        assert!(reply.is_ok(), "SET {key}: {reply:?}");
    }

    /// GET; `None` if the key does not exist.
    pub fn get(&self, key: &str) -> Option<String> {
        match self.cmd(&["GET", key]) {
            RespValue::Nil => None,
            v @ RespValue::Bulk(_) => v.to_string_lossy(),
            other => panic!("GET {key}: {other:?}"),
        }
    }

    pub fn exists(&self, key: &str) -> bool {
        self.int_cmd(&["EXISTS", key]) > 0
    }

    /// PTTL in ms: -2 if the key does not exist, -1 if it has no expiry.
    pub fn pttl(&self, key: &str) -> i64 {
        self.int_cmd(&["PTTL", key])
    }

    /// KEYS `pattern`, sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        match self.cmd(&["KEYS", pattern]) {
            RespValue::Array(items) => {
                let mut keys: Vec<String> = items
                    .iter()
                    .map(|v| v.to_string_lossy().expect("KEYS item"))
                    .collect();
                keys.sort();
                keys
            }
            other => panic!("KEYS {pattern}: {other:?}"),
        }
    }

    pub fn dbsize(&self) -> i64 {
        self.int_cmd(&["DBSIZE"])
    }

    pub fn flushall(&self) {
        let reply = self.cmd(&["FLUSHALL"]);
        assert!(reply.is_ok(), "FLUSHALL: {reply:?}");
    }

    /// `INFO commandstats` as (command name, calls), e.g. `("evalsha", 3)`.
    /// Subcommands look like `client|setname`. Names are lower case.
    pub fn info_commandstats(&self) -> Vec<(String, u64)> {
        let reply = self.cmd(&["INFO", "commandstats"]);
        let text = reply
            .to_string_lossy()
            .unwrap_or_else(|| panic!("INFO commandstats: {reply:?}"));
        text.lines()
            .filter_map(|line| {
                let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))?
                    .parse()
                    .ok()?;
                Some((name.to_owned(), calls))
            })
            .collect()
    }

    /// Calls of one command (lower case, e.g. `"set"`) since start or
    /// [`RedisServer::reset_stats`]; 0 if never called.
    pub fn command_calls(&self, name: &str) -> u64 {
        self.info_commandstats()
            .into_iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map_or(0, |(_, calls)| calls)
    }

    /// `CONFIG RESETSTAT`: zero the command statistics.
    pub fn reset_stats(&self) {
        let reply = self.cmd(&["CONFIG", "RESETSTAT"]);
        assert!(reply.is_ok(), "CONFIG RESETSTAT: {reply:?}");
    }

    fn int_cmd(&self, args: &[&str]) -> i64 {
        match self.cmd(args) {
            RespValue::Integer(i) => i,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--port".into(),
            self.port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            self.config.save_schedule.clone().unwrap_or_default(),
            "--dbfilename".into(),
            self.dbfilename().to_owned(),
            "--appendonly".into(),
            if self.config.aof.is_some() {
                "yes"
            } else {
                "no"
            }
            .into(),
            "--daemonize".into(),
            "no".into(),
            "--dir".into(),
            self.dir.display().to_string(),
            "--logfile".into(),
            self.dir.join("redis.log").display().to_string(),
        ];
        if let Some(fsync) = self.config.aof {
            args.extend(["--appendfsync".into(), fsync.as_arg().into()]);
        }
        if let Some(password) = &self.config.password {
            args.extend(["--requirepass".into(), password.clone()]);
        }
        args.extend(self.config.extra_args.iter().cloned());
        args
    }

    /// Spawns the process and waits until it is our process that answers PING.
    fn spawn_and_wait(&mut self) -> Result<(), StartError> {
        // redis.log is appended to across restarts: only judge this run's part.
        let log_start = std::fs::metadata(self.dir.join("redis.log")).map_or(0, |m| m.len());
        let stderr = std::fs::File::create(self.dir.join("stderr.log"))
            .map_err(|e| StartError::Fatal(format!("creating stderr.log: {e}")))?;
        let child = Command::new(&self.binary)
            .args(self.args())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| {
                StartError::Fatal(format!(
                    "cannot run {}: {e}. {}",
                    self.binary.display(),
                    INSTALL_HINT
                ))
            })?;
        self.pid = child.id();
        self.child = Some(child);
        self.state = ServerState::Running;

        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let exited = self
                .child
                .as_mut()
                .expect("child present")
                .try_wait()
                .map_err(|e| StartError::Fatal(format!("try_wait: {e}")))?;
            if let Some(status) = exited {
                self.child = None;
                self.state = ServerState::Killed;
                let log = self.log();
                let msg = format!(
                    "redis-server on port {} exited during start-up ({status})\n{log}",
                    self.port
                );
                let port_taken = [("redis.log", log_start), ("stderr.log", 0)]
                    .into_iter()
                    .any(|(name, from)| {
                        read_from(&self.dir.join(name), from).contains("Address already in use")
                    });
                return Err(if port_taken {
                    StartError::PortTaken(msg)
                } else {
                    StartError::Fatal(msg)
                });
            }
            if self.probe() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(StartError::Fatal(format!(
                    "redis-server on port {} not ready after {READY_TIMEOUT:?}\n{}",
                    self.port,
                    self.log()
                )));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// PING answered with PONG (data loaded), by the process we spawned (not
    /// some other server that happens to hold the port).
    fn probe(&self) -> bool {
        let Ok(mut conn) = self.connect(PROBE_TIMEOUT) else {
            return false;
        };
        match conn.call_str(&["PING"]) {
            Ok(RespValue::Simple(s)) if s == "PONG" => {}
            _ => return false,
        }
        let Ok(info) = conn.call_str(&["INFO", "server"]) else {
            return false;
        };
        let wanted = format!("process_id:{}", self.pid);
        info.to_string_lossy()
            .is_some_and(|text| text.lines().any(|l| l.trim() == wanted))
    }

    fn wait_for_proc_state(&self, what: &str, ok: impl Fn(Option<char>) -> bool) {
        if !Path::new("/proc/self/stat").exists() {
            return; // not Linux: nothing to observe
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        while !ok(proc_state(self.pid)) {
            assert!(
                Instant::now() < deadline,
                "redis-server pid {} not {what} after {READY_TIMEOUT:?}",
                self.pid
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Must not panic: this also runs while a failed test unwinds.
        if let Some(mut child) = self.child.take() {
            if self.state == ServerState::Paused {
                let _ = send_signal(self.pid, "CONT");
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.state = ServerState::Killed;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const INSTALL_HINT: &str = "redis-server is needed by the integration tests: install it \
     (Debian/Ubuntu: `apt-get install redis-server`) or set REDIS_SERVER=/path/to/redis-server";

/// `$REDIS_SERVER`, else `redis-server` on `PATH`; panics with how to install it.
fn redis_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_SERVER").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "REDIS_SERVER={} is not a file. {INSTALL_HINT}",
            path.display()
        );
        return path;
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("redis-server not found on PATH. {INSTALL_HINT}"))
}

/// The text of `path` from byte `offset` on ("" if unreadable).
fn read_from(path: &Path, offset: u64) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

fn copy_file(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", from.display(), to.display()));
}

/// Copies the files of `from` (one level: the AOF directory has no subdirectories).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("creating {}: {e}", to.display()));
    let entries =
        std::fs::read_dir(from).unwrap_or_else(|e| panic!("reading {}: {e}", from.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("reading {}: {e}", from.display()));
        copy_file(&entry.path(), &to.join(entry.file_name()));
    }
}

/// Removes a file or a directory; nothing to do if it is not there.
fn remove_path(path: &Path) {
    let result = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => panic!("removing {}: {e}", path.display()),
    }
}

/// A port that was free on 127.0.0.1 a moment ago (bind :0, read, drop).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

/// `kill -s SIG PID` through the shell builtin (no libc, no procps needed).
pub(crate) fn send_signal(pid: u32, signal: &str) -> io::Result<()> {
    let status = Command::new("sh")
        .args([
            "-c",
            "kill -s \"$1\" \"$2\"",
            "sh",
            signal,
            &pid.to_string(),
        ])
        .stdin(Stdio::null())
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "kill -s {signal} {pid} failed: {status}"
        )))
    }
}

/// The state letter in `/proc/PID/stat` (`R`, `S`, `T`, `Z`, ...), if readable.
pub(crate) fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may contain spaces or parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Alive and not a zombie (falls back to `true` where /proc is missing).
fn process_alive(pid: u32) -> bool {
    if !Path::new("/proc/self/stat").exists() {
        return true;
    }
    !matches!(proc_state(pid), None | Some('Z') | Some('X'))
}
