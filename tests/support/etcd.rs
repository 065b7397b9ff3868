//! Real etcd clusters for the tests: `etcd` processes (Debian's `etcd-server`, or
//! `$ETCD` if set) on free loopback ports, each member with its own data directory.
//!
//! ```ignore
//! let cluster = support::etcd::EtcdCluster::start(3);
//! let url = cluster.url("prefix");          // etcd://127.0.0.1:A,127.0.0.1:B,127.0.0.1:C/prefix
//! let leader = cluster.leader();            // index of the current leader
//! cluster.kill(leader); cluster.restart(leader);
//! ```
//!
//! Each member runs under a small `sh` guard that reads the test process's end of a
//! pipe: when the test process exits — normally, by a panic or by SIGKILL — the pipe
//! closes and the guard kills the member and removes its directory. So a cluster may
//! live in a `static` (one cluster per test binary) without leaking processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a cluster or a restarted member may take to serve.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    /// The guard shell and its stdin (the pipe whose end kills the member).
    guard: Option<(Child, ChildStdin)>,
    /// The etcd process's id, as the guard reported it.
    pid: u32,
}

/// A cluster of etcd members on loopback. Dropping it kills every member and removes
/// the directories.
pub struct EtcdCluster {
    members: Mutex<Vec<Member>>,
    initial_cluster: String,
    token: String,
}

impl EtcdCluster {
    /// Starts `n` members and waits until the cluster has a leader and serves.
    pub fn start(n: usize) -> EtcdCluster {
        let id = format!(
            "{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let members: Vec<Member> = (0..n)
            .map(|i| {
                let name = format!("m{i}");
                let dir = std::env::temp_dir().join(format!("tower-redlock-etcd-{id}-{name}"));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).expect("creating an etcd member's directory");
                Member {
                    name,
                    client_port: free_port(),
                    peer_port: free_port(),
                    dir,
                    guard: None,
                    pid: 0,
                }
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let cluster = EtcdCluster {
            members: Mutex::new(members),
            initial_cluster,
            token: format!("tower-redlock-{id}"),
        };
        for i in 0..n {
            cluster.spawn(i);
        }
        cluster.wait_healthy();
        cluster
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.lock().unwrap().len()
    }

    /// `etcd://` URL naming every member, keys under `prefix/`.
    pub fn url(&self, prefix: &str) -> String {
        format!("etcd://{}/{prefix}", self.endpoints().join(","))
    }

    /// `127.0.0.1:PORT` of every member's client port.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .lock()
            .unwrap()
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// SIGKILLs member `i` (its data directory stays).
    pub fn kill(&self, i: usize) {
        let mut members = self.members.lock().unwrap();
        let member = &mut members[i];
        if member.guard.is_none() {
            return;
        }
        if let Some((mut child, mut stdin)) = member.guard.take() {
            // "keep": the guard kills the member and leaves its directory for a restart.
            let _ = stdin.write_all(b"keep\n");
            drop(stdin);
            let _ = child.wait();
        }
    }

    /// SIGSTOPs member `i`.
    pub fn pause(&self, i: usize) {
        let members = self.members.lock().unwrap();
        signal(members[i].pid, "STOP");
    }

    /// SIGCONTs member `i`.
    pub fn resume(&self, i: usize) {
        let members = self.members.lock().unwrap();
        signal(members[i].pid, "CONT");
    }

    /// Starts member `i` again on its data directory (after [`kill`](Self::kill)).
    pub fn restart(&self, i: usize) {
        self.kill(i);
        self.spawn(i);
    }

    /// Kills every member, then starts them all again on their data directories and
    /// waits until the cluster serves.
    pub fn restart_all(&self) {
        for i in 0..self.len() {
            self.kill(i);
        }
        for i in 0..self.len() {
            self.spawn(i);
        }
        self.wait_healthy();
    }

    /// Waits until every running member reports a healthy cluster (a leader).
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let ports: Vec<u16> = self
                .members
                .lock()
                .unwrap()
                .iter()
                .filter(|m| m.guard.is_some())
                .map(|m| m.client_port)
                .collect();
            if ports
                .iter()
                .all(|&p| http(p, "GET", "/health", "").is_some_and(|b| b.contains("\"true\"")))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd cluster not healthy within {READY_TIMEOUT:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The index of the current leader, as the running members report it.
    pub fn leader(&self) -> usize {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let ports: Vec<(usize, u16, bool)> = self
                .members
                .lock()
                .unwrap()
                .iter()
                .enumerate()
                .map(|(i, m)| (i, m.client_port, m.guard.is_some()))
                .collect();
            let mut ids = Vec::new();
            let mut leader = None;
            for &(i, port, running) in &ports {
                if !running {
                    continue;
                }
                let Some(body) = http(port, "POST", "/v3/maintenance/status", "{}") else {
                    continue;
                };
                let Ok(json) = serde_json::from_str::<serde_json::Value>(&body) else {
                    continue;
                };
                let member = json["header"]["member_id"].as_str().map(str::to_owned);
                ids.push((i, member));
                if let Some(l) = json["leader"].as_str() {
                    leader = Some(l.to_owned());
                }
            }
            if let Some(leader) = leader
                && let Some((i, _)) = ids.iter().find(|(_, id)| id.as_deref() == Some(&leader))
            {
                return *i;
            }
            assert!(Instant::now() < deadline, "no etcd leader found");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The members' logs, for failure messages.
    pub fn logs(&self) -> String {
        let members = self.members.lock().unwrap();
        members
            .iter()
            .map(|m| {
                let log = std::fs::read_to_string(m.dir.join("etcd.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                format!(
                    "--- {} ---\n{}",
                    m.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn spawn(&self, i: usize) {
        let mut members = self.members.lock().unwrap();
        let m = &mut members[i];
        let binary = std::env::var("ETCD").unwrap_or_else(|_| "etcd".to_owned());
        let args = [
            format!("--name={}", m.name),
            format!("--data-dir={}", m.dir.join("data").display()),
            format!("--listen-client-urls=http://127.0.0.1:{}", m.client_port),
            format!("--advertise-client-urls=http://127.0.0.1:{}", m.client_port),
            format!("--listen-peer-urls=http://127.0.0.1:{}", m.peer_port),
            format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{}",
                m.peer_port
            ),
            format!("--initial-cluster={}", self.initial_cluster),
            format!("--initial-cluster-token={}", self.token),
            "--initial-cluster-state=new".to_owned(),
        ];
        // The guard: starts etcd, reports its pid, and kills it when a line arrives or
        // stdin closes. Unless the line is "keep" (`kill`, for a restart) it also removes
        // the member's directory: a cluster in a `static` is never dropped, and each
        // member preallocates 64 MB of log.
        let script = r#"log="$1"; dir="$2"; shift 2; "$@" >>"$log" 2>&1 & p=$!; echo $p; read -r cmd; kill -9 $p 2>/dev/null; wait $p 2>/dev/null; [ "$cmd" = keep ] || rm -rf "$dir"; exit 0"#;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("etcd-guard")
            .arg(m.dir.join("etcd.log"))
            .arg(&m.dir)
            .arg(&binary)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {binary} (Debian: apt-get install etcd-server): {e}")
            });
        let stdin = child.stdin.take().expect("piped stdin");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("reading the etcd guard's pid line");
        m.pid = line.trim().parse().expect("the etcd guard prints a pid");
        m.guard = Some((child, stdin));
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in self.members.lock().unwrap().iter_mut() {
            if let Some((mut child, stdin)) = m.guard.take() {
                drop(stdin);
                let _ = child.wait();
            }
        }
        for m in self.members.lock().unwrap().iter() {
            let _ = std::fs::remove_dir_all(&m.dir);
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

fn signal(pid: u32, signal: &str) {
    if pid == 0 {
        return;
    }
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!("kill -s {signal} {pid}"))
        .status();
}

/// One HTTP/1.0 request to the member's client port; the body of a 200 answer.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200")
        .then(|| body.to_owned())
        .or_else(|| head.starts_with("HTTP/1.1 200").then(|| body.to_owned()))
}
