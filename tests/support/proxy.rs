//! A test-only TCP proxy on 127.0.0.1 in front of one `redis-server`, to make the
//! network misbehave: latency (fixed or random jitter per chunk and direction),
//! blackhole (connections are accepted and held, nothing is forwarded either way)
//! and heal, reset of every current connection, and a reply cut in the middle.
//!
//! ```ignore
//! let redis = support::RedisServer::start();
//! let proxy = support::proxy::Proxy::start(redis.addr());
//! let locker = Redlock::connect([proxy.url()], options).await?;
//! proxy.set_latency(Latency::Jitter(Duration::from_millis(30)));
//! proxy.blackhole();   // held: bytes stay queued in the kernel buffers
//! proxy.heal();        // the queued bytes flow again, in order
//! proxy.reset_connections(); // RST on both sides of every current connection
//! proxy.cut_next_reply();    // half of the next chunk from the server, then close
//! ```
//!
//! The proxy runs on the Tokio runtime it was started in. [`Proxy`] is a cheap,
//! cloneable handle; when the last clone drops, the proxy stops listening and closes
//! every connection.
//!
//! Semantics worth knowing:
//! - A blackhole stops *reading* from both sockets of every connection, so bytes are
//!   neither lost nor forwarded: they wait in the kernel buffers, as in a network
//!   partition that TCP survives (retransmission). On [`heal`](Proxy::heal) they are
//!   delivered late, in order. Connections accepted during a blackhole are held without
//!   connecting upstream. Combine with [`reset_connections`](Proxy::reset_connections)
//!   to model a partition that killed the connections instead.
//! - Latency is applied per chunk read and per direction, and never reorders bytes:
//!   a chunk is delivered at `max(read time + delay, delivery of the previous chunk)`.
//! - A connection whose upstream cannot be reached (server killed) is closed at once.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Delay added to every chunk, in each direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Latency {
    /// Forward at once.
    #[default]
    None,
    /// The same delay for every chunk.
    Fixed(Duration),
    /// A delay drawn uniformly from `0..=max` for every chunk.
    Jitter(Duration),
}

impl Latency {
    fn sample(self) -> Duration {
        match self {
            Latency::None => Duration::ZERO,
            Latency::Fixed(d) => d,
            Latency::Jitter(max) => {
                let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
                Duration::from_micros(rand::random_range(0..=max_us))
            }
        }
    }
}

/// Handle to a running proxy. Clones control the same proxy; it shuts down when the
/// last clone is dropped.
#[derive(Clone)]
pub struct Proxy {
    guard: Arc<Guard>,
}

struct Guard {
    state: Arc<State>,
    addr: SocketAddr,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.state.shutdown.send_replace(true);
    }
}

struct State {
    upstream: SocketAddr,
    latency: Mutex<Latency>,
    /// `true` while blackholed.
    blackhole: watch::Sender<bool>,
    /// Bumped by `reset_connections`: connections of older generations are reset.
    generation: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    /// Replies still to be cut.
    cuts_armed: AtomicUsize,
    /// Replies cut so far.
    cuts_done: watch::Sender<u64>,
    accepted: AtomicU64,
    active: AtomicUsize,
}

impl State {
    fn latency(&self) -> Latency {
        *self.latency.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns once the proxy is not blackholed (at once when it is not).
    async fn open(&self) {
        let mut rx = self.blackhole.subscribe();
        // The sender lives in `State`, which outlives this call.
        let _ = rx.wait_for(|blackholed| !*blackholed).await;
    }

    fn take_cut(&self) -> bool {
        self.cuts_armed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }
}

impl Proxy {
    /// Starts a proxy on a free port of 127.0.0.1 that forwards to `upstream`.
    /// Must be called inside a Tokio runtime.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .expect("proxy: binding 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("proxy: set_nonblocking");
        let addr = listener.local_addr().expect("proxy: local_addr");
        let listener = TcpListener::from_std(listener).expect("proxy: needs a Tokio runtime");
        let state = Arc::new(State {
            upstream,
            latency: Mutex::new(Latency::None),
            blackhole: watch::Sender::new(false),
            generation: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            cuts_armed: AtomicUsize::new(0),
            cuts_done: watch::Sender::new(0),
            accepted: AtomicU64::new(0),
            active: AtomicUsize::new(0),
        });
        tokio::spawn(accept_loop(listener, state.clone()));
        Proxy {
            guard: Arc::new(Guard { state, addr }),
        }
    }

    fn state(&self) -> &State {
        &self.guard.state
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.guard.addr
    }

    /// `redis://127.0.0.1:PORT/0` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}/0", self.guard.addr)
    }

    /// The server behind the proxy.
    pub fn upstream(&self) -> SocketAddr {
        self.state().upstream
    }

    /// Latency for chunks read from now on.
    pub fn set_latency(&self, latency: Latency) {
        *self
            .state()
            .latency
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = latency;
    }

    /// Stops forwarding in both directions; new connections are accepted and held.
    pub fn blackhole(&self) {
        self.state().blackhole.send_replace(true);
    }

    /// Forwards again; bytes held during the blackhole are delivered now, in order.
    pub fn heal(&self) {
        self.state().blackhole.send_replace(false);
    }

    /// `true` while blackholed.
    pub fn is_blackholed(&self) -> bool {
        *self.state().blackhole.borrow()
    }

    /// Resets (RST) both sides of every connection open now. New connections work.
    pub fn reset_connections(&self) {
        self.state().generation.send_modify(|g| *g += 1);
    }

    /// Arms one cut: the next chunk the server sends on any connection is forwarded
    /// only in part (its first half), then that connection is closed. Await
    /// [`cuts_reached`](Proxy::cuts_reached) to know it happened.
    pub fn cut_next_reply(&self) {
        self.state().cuts_armed.fetch_add(1, Ordering::AcqRel);
    }

    /// Replies cut so far.
    pub fn cuts_done(&self) -> u64 {
        *self.state().cuts_done.borrow()
    }

    /// Returns once at least `n` replies were cut in total.
    pub async fn cuts_reached(&self, n: u64) {
        let mut rx = self.state().cuts_done.subscribe();
        let _ = rx.wait_for(|done| *done >= n).await;
    }

    /// Connections accepted since start.
    pub fn connections_accepted(&self) -> u64 {
        self.state().accepted.load(Ordering::Acquire)
    }

    /// Connections open now.
    pub fn active_connections(&self) -> usize {
        self.state().active.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.guard.addr)
            .field("upstream", &self.state().upstream)
            .field("latency", &self.state().latency())
            .field("blackholed", &self.is_blackholed())
            .field("active", &self.active_connections())
            .finish()
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    let mut shutdown = state.shutdown.subscribe();
    loop {
        tokio::select! {
            () = until(&mut shutdown, |s| *s) => return,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    state.accepted.fetch_add(1, Ordering::AcqRel);
                    tokio::spawn(serve(state.clone(), socket));
                }
                // E.g. too many open files: back off a little instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            },
        }
    }
}

/// Resolves once the watched value satisfies `ready` (never if the sender is gone).
async fn until<T>(rx: &mut watch::Receiver<T>, ready: impl FnMut(&T) -> bool) {
    if rx.wait_for(ready).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Decrements the active count when a connection ends, however it ends.
struct Active<'a>(&'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

enum End {
    /// One side closed: close the other.
    Closed,
    /// A reply was cut: close gracefully so the partial bytes arrive before EOF.
    Cut,
    /// Reset or shutdown: RST both sides.
    Reset,
}

async fn serve(state: Arc<State>, mut client: TcpStream) {
    state.active.fetch_add(1, Ordering::AcqRel);
    let _active = Active(&state.active);
    let generation = *state.generation.borrow();
    let mut generations = state.generation.subscribe();
    let mut shutdown = state.shutdown.subscribe();
    let _ = client.set_nodelay(true);

    // Hold new connections while blackholed; then reach the server.
    let connect = async {
        state.open().await;
        tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(state.upstream)).await
    };
    let mut upstream = tokio::select! {
        connected = connect => match connected {
            Ok(Ok(upstream)) => upstream,
            // Server down or unreachable: the client sees its connection closed.
            _ => return reset(&client, None),
        },
        () = until(&mut generations, |g| *g != generation) => return reset(&client, None),
        () = until(&mut shutdown, |s| *s) => return reset(&client, None),
    };
    let _ = upstream.set_nodelay(true);

    let end = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = upstream.split();
        tokio::select! {
            _ = pipe(&state, client_read, server_write, false) => End::Closed,
            cut = pipe(&state, server_read, client_write, true) => if cut { End::Cut } else { End::Closed },
            () = until(&mut generations, |g| *g != generation) => End::Reset,
            () = until(&mut shutdown, |s| *s) => End::Reset,
        }
    };
    match end {
        End::Closed => {}
        End::Reset => reset(&client, Some(&upstream)),
        End::Cut => {
            state.cuts_done.send_modify(|n| *n += 1);
            // FIN after the partial reply, then wait (bounded) for the client to close
            // its side: closing a socket with unread input would send RST, which could
            // overtake the partial reply.
            let _ = client.shutdown().await;
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                while matches!(client.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        }
    }
}

/// Makes the coming close of the sockets an RST (abortive close).
fn reset(client: &TcpStream, upstream: Option<&TcpStream>) {
    let _ = client.set_zero_linger();
    if let Some(upstream) = upstream {
        let _ = upstream.set_zero_linger();
    }
}

/// Copies `from` to `to` with the proxy's latency and blackhole applied. Returns
/// `true` when it stopped because it cut a reply (only when `cuttable`).
async fn pipe<R, W>(state: &State, mut from: R, mut to: W, cuttable: bool) -> bool
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>, bool)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            state.open().await;
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut chunk = buf[..n].to_vec();
            let cut = cuttable && state.take_cut();
            if cut {
                chunk.truncate(n / 2);
            }
            let due = Instant::now() + state.latency().sample();
            if tx.send((due, chunk, cut)).is_err() || cut {
                break;
            }
        }
    };
    let write = async move {
        let mut last_due = Instant::now();
        while let Some((due, chunk, cut)) = rx.recv().await {
            let due = due.max(last_due);
            last_due = due;
            tokio::time::sleep_until(due).await;
            state.open().await;
            if to.write_all(&chunk).await.is_err() {
                return false;
            }
            if cut {
                let _ = to.flush().await;
                return true;
            }
        }
        false
    };
    let ((), cut) = tokio::join!(read, write);
    cut
}
