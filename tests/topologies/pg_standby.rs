//! A PostgreSQL standby refused at connect, as a Redis replica is: a private primary
//! (`initdb`, `postgres` from PostgreSQL's newest versioned lib directory, or `$PG_BIN`)
//! and a standby made from it with `pg_basebackup -R`, both on free ports, run as
//! `postgres` when the tests run as root (PostgreSQL refuses root).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tower_redlock::{LockOptions, Redlock};

use super::postgres::{free_port, is_root};

/// Bound on a server starting; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_refused_at_connect() {
    let cluster = Cluster::start();
    let options = || LockOptions::default().node_timeout(Duration::from_secs(2));
    Redlock::connect([cluster.url(0)], options()).await.unwrap();
    let error = Redlock::connect([cluster.url(1)], options())
        .await
        .map(drop)
        .expect_err("a standby was accepted")
        .to_string();
    assert!(error.contains("(role standby)"), "{error}");
}

/// A primary (server 0) and its streaming standby (server 1), stopped and removed when
/// dropped.
struct Cluster {
    dir: PathBuf,
    servers: Vec<(PathBuf, u16, Child)>,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = std::env::temp_dir().join(format!(
            "tower-redlock-test-standby-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(&dir));
        }
        let mut cluster = Cluster {
            dir,
            servers: Vec::new(),
        };
        let primary = cluster.dir.join("primary");
        run(pg("initdb").arg("-D").arg(&primary).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]));
        cluster.serve(primary);
        let standby = cluster.dir.join("standby");
        let port = cluster.servers[0].1.to_string();
        run(pg("pg_basebackup")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-R",
                "-c",
                "fast",
            ])
            .arg("-D")
            .arg(&standby));
        cluster.serve(standby);
        cluster
    }

    /// Starts a server on `data` and waits until it accepts connections.
    fn serve(&mut self, data: PathBuf) {
        let port = free_port();
        let child = pg("postgres")
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(&self.dir)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn postgres");
        self.servers.push((data, port, child));
        let started = Instant::now();
        // A process of its own: its readiness is polled, as `pg_isready` is made for.
        while !pg("pg_isready")
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .unwrap()
            .success()
        {
            assert!(
                started.elapsed() < PROMPTLY,
                "postgres did not start on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self, server: usize) -> String {
        let port = self.servers[server].1;
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // `pg_ctl` stops the server itself, also when `runuser` stands between.
        for (data, _, child) in self.servers.iter_mut().rev() {
            let _ = pg("pg_ctl")
                .args(["stop", "-m", "immediate", "-D"])
                .arg(&*data)
                .stdout(Stdio::null())
                .status();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `program` from PostgreSQL's binaries, as `postgres` when root.
fn pg(program: &str) -> Command {
    let path = bin_dir().join(program);
    if !is_root() {
        return Command::new(path);
    }
    let mut command = Command::new("runuser");
    command.args(["-u", "postgres", "--"]).arg(path);
    command
}

fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return dir.into();
    }
    let versions =
        std::fs::read_dir("/usr/lib/postgresql").expect("/usr/lib/postgresql (or set PG_BIN)");
    let mut dirs: Vec<PathBuf> = versions
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .filter(|bin| Path::new(bin).join("postgres").exists())
        .collect();
    dirs.sort();
    dirs.pop()
        .expect("a PostgreSQL under /usr/lib/postgresql (or set PG_BIN)")
}

fn run(command: &mut Command) {
    let output = command.output().expect("spawn");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
