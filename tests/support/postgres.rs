//! A database of its own on the PostgreSQL server at `$TOWER_REDLOCK_PG` (default
//! `postgres://postgres@127.0.0.1:5432`, trust auth, as `.ci/run` sets up): created
//! per test, dropped (`WITH (FORCE)`) when the [`TestDatabase`] is dropped, also after
//! a panic. Never touches another database.

use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The server, without a database.
pub fn server_url() -> String {
    std::env::var("TOWER_REDLOCK_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A fresh database, dropped with this value.
pub struct TestDatabase {
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates `tower_redlock_test_<pid>_<n>_<random>`.
    pub async fn create() -> TestDatabase {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "tower_redlock_test_{}_{}_{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let mut admin = admin().await;
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut admin)
            .await
            .expect("CREATE DATABASE");
        let _ = admin.close().await;
        let url = format!("{}/{name}", server_url());
        TestDatabase { name, url }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A pool of `size` connections to it.
    pub async fn pool(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// One connection to it.
    pub async fn connect(&self) -> PgConnection {
        self.url
            .parse::<PgConnectOptions>()
            .expect("test database URL")
            .connect()
            .await
            .expect("connect to the test database")
    }
}

async fn admin() -> PgConnection {
    let url = format!("{}/postgres", server_url());
    PgConnection::connect(&url).await.unwrap_or_else(|e| {
        panic!("PostgreSQL at {url} (set TOWER_REDLOCK_PG, or run .ci/run to set it up): {e}")
    })
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop may run inside a runtime: a thread of its own with its own runtime.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let mut admin = admin().await;
                sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&mut admin)
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(_))) {
            eprintln!("could not drop test database {}: {dropped:?}", self.name);
        }
    }
}

/// A PostgreSQL cluster of the test's own (`initdb` into a temporary directory, a free
/// loopback port, trust auth), for the scenarios that stop, crash and restart the server:
/// the machine's server on 5432 is shared by other tests and is never restarted.
/// Stopped (immediately) and removed when dropped.
pub struct PrivateCluster {
    bin: std::path::PathBuf,
    dir: std::path::PathBuf,
    port: u16,
}

/// How [`PrivateCluster::stop`] shuts the server down (`pg_ctl stop -m`).
#[derive(Clone, Copy, Debug)]
pub enum Shutdown {
    /// Sessions are cut, a checkpoint is written: a clean stop.
    Fast,
    /// Every process killed at once: a crash, recovered from the WAL on the next start.
    Immediate,
}

impl PrivateCluster {
    /// `initdb` and start, on the newest server installed under /usr/lib/postgresql.
    pub fn start() -> PrivateCluster {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries under /usr/lib/postgresql")
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .max()
            .map(|version| format!("/usr/lib/postgresql/{version}/bin").into())
            .expect("a PostgreSQL version under /usr/lib/postgresql");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir =
            std::env::temp_dir().join(format!("tower-redlock-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cluster directory");
        let cluster = PrivateCluster { bin, dir, port };
        // postgres refuses to run as root: the cluster then belongs to `postgres`.
        if as_root() {
            cluster.run(
                "chown",
                &["postgres:postgres", &cluster.dir.to_string_lossy()],
            );
        }
        let data = cluster.data();
        cluster.pg(
            "initdb",
            &["-D", &data, "-U", "postgres", "--auth=trust", "--no-sync"],
        );
        cluster.up();
        cluster
    }

    fn data(&self) -> String {
        self.dir.join("data").to_string_lossy().into_owned()
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server on the same data directory and port, and waits until it accepts
    /// connections (`pg_ctl -w`).
    pub fn up(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("log").to_string_lossy().into_owned();
        self.pg(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server (`pg_ctl stop -m fast|immediate`) and waits until it is gone.
    pub fn stop(&self, how: Shutdown) {
        let mode = match how {
            Shutdown::Fast => "fast",
            Shutdown::Immediate => "immediate",
        };
        self.pg("pg_ctl", &["-D", &self.data(), "-m", mode, "-w", "stop"]);
    }

    /// [`stop`](Self::stop), then [`up`](Self::up) on the same data directory and port.
    pub fn restart(&self, how: Shutdown) {
        self.stop(how);
        self.up();
    }

    /// Terminates every other session of the cluster (`pg_terminate_backend`); returns
    /// how many.
    pub async fn terminate_sessions(&self) -> i64 {
        let mut admin = PgConnection::connect(&self.url()).await.expect("admin");
        let cut: i64 = sqlx::query_scalar(
            // In FILTER, not WHERE: evaluated only on the rows WHERE kept (never itself).
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        .fetch_one(&mut admin)
        .await
        .expect("pg_terminate_backend");
        let _ = admin.close().await;
        cut
    }

    /// Runs a server binary as the cluster's owner; panics with its output on failure.
    fn pg(&self, tool: &str, args: &[&str]) {
        self.try_pg(tool, args).unwrap_or_else(|e| panic!("{e}"));
    }

    fn try_pg(&self, tool: &str, args: &[&str]) -> Result<(), String> {
        let tool = self.bin.join(tool).to_string_lossy().into_owned();
        if as_root() {
            let mut all = vec!["-u", "postgres", "--", tool.as_str()];
            all.extend_from_slice(args);
            self.try_run("runuser", &all)
        } else {
            self.try_run(&tool, args)
        }
    }

    fn run(&self, program: &str, args: &[&str]) {
        self.try_run(program, args)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    fn try_run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let out = std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("{program}: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{program} {args:?}: {}\n{}\n{}\nlog: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        ))
    }
}

fn as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        // Never panics here (it may run while a failed test unwinds).
        let _ = self.try_pg(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
