//! What hyper writes to the socket for a locked response. A response whose head and
//! body leave in two writes waits, on a kept-alive connection without `TCP_NODELAY`
//! (`axum::serve`'s default), for the client's delayed ACK: 40 ms per request. The
//! writes are counted by the server's own connections, so no clock is read.

use crate::http_client::{Conn, Req};
use crate::sockets::Store;
use crate::support::{self, eventually, RedisServer};

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tower_redlock::http::{key::path_param, replay::Replay, LockLayer};
use tower_redlock::{LeaseHandle, Redlock};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);

/// A loopback listener whose connections count the writes made to them; each tells its
/// count when hyper drops it (the connection closed).
struct Counting {
    listener: TcpListener,
    counts: mpsc::UnboundedSender<oneshot::Receiver<usize>>,
}

struct Counted {
    stream: TcpStream,
    writes: usize,
    closed: Option<oneshot::Sender<usize>>,
}

impl axum::serve::Listener for Counting {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        let (stream, addr) = self.listener.accept().await.expect("accept");
        let (closed, count) = oneshot::channel();
        let _ = self.counts.send(count);
        let io = Counted {
            stream,
            writes: 0,
            closed: Some(closed),
        };
        (io, addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

impl Counted {
    fn count(&mut self, written: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(1..)) = written {
            self.writes += 1;
        }
        written
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(closed) = self.closed.take() {
            let _ = closed.send(self.writes);
        }
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.count(written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.count(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// `requests` sent one after the other on one keep-alive connection, each once the last
/// response was read; the number of writes the server made on it.
async fn writes_for(app: Router, requests: &[Req]) -> usize {
    let (counts, mut conns) = mpsc::unbounded_channel();
    let listener = Counting {
        listener: TcpListener::bind("127.0.0.1:0").await.expect("bind"),
        counts,
    };
    let addr = listener.listener.local_addr().expect("local addr");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut conn = Conn::open(addr).await;
    for request in requests {
        let reply = conn.send(request.clone()).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    drop(conn);
    let count = conns.recv().await.expect("a connection");
    let writes = tokio::time::timeout(PROMPTLY, count)
        .await
        .expect("the server closed the connection")
        .expect("a count");
    server.abort();
    writes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_response_leaves_in_one_write() {
    for store in [Store::redis(1), Store::redis(3)] {
        let pay = post(|Path(id): Path<String>| async move { Json(vec![id]) });
        let app = Router::new()
            .route("/orders/{id}/pay", pay.clone())
            .route_layer(LockLayer::new(store.locker(), path_param("id")))
            .merge(Router::new().route("/payments/{id}", pay).route_layer(
                LockLayer::new(store.locker(), path_param("id")).replay(Replay::global()),
            ));
        let mut requests = vec![Req::post("/orders/a/pay"); 10];
        // Replay's first answers, recorded before they are sent.
        requests.extend((0..5).map(|i| Req::post(format!("/payments/{i}"))));
        let writes = writes_for(app, &requests).await;
        assert_eq!(
            writes,
            requests.len(),
            "{}: one write per response",
            store.name()
        );
    }
}

/// A body of announced length whose bytes the test sends.
struct Announced {
    chunks: mpsc::Receiver<Bytes>,
    len: u64,
}

impl http_body::Body for Announced {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.chunks
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len)
    }
}

/// The layer reads a body of known length before anything is sent; a lease lost
/// meanwhile (`OnLost::Abort`, the default) stops the reading, and the client is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_while_its_body_is_read_is_answered_lock_lost() {
    let server = RedisServer::start();
    let options = support::patient().ttl(Duration::from_secs(3));
    let locker = Redlock::from_urls([server.url()], options).unwrap();
    let (chunks_tx, chunks) = mpsc::channel::<Bytes>(1);
    let chunks = std::sync::Arc::new(std::sync::Mutex::new(Some(chunks)));
    let (lease_tx, mut lease_rx) = mpsc::channel::<LeaseHandle>(1);
    let export = post(move |Extension(lease): Extension<LeaseHandle>| {
        let chunks = chunks.lock().unwrap().take().expect("one request");
        let lease_tx = lease_tx.clone();
        async move {
            lease_tx.send(lease).await.unwrap();
            Body::new(Announced { chunks, len: 10 })
        }
    });
    let app = Router::new()
        .route("/exports/{id}", export)
        .route_layer(LockLayer::new(locker, path_param("id")));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let served = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut conn = Conn::open(addr).await;
    conn.write(&Req::post("/exports/e1")).await;
    let lease = lease_rx.recv().await.unwrap();
    chunks_tx.send(Bytes::from_static(b"first")).await.unwrap();
    // Someone deletes the key: the watchdog finds it gone and the lease is lost.
    server.cmd(&["DEL", &format!("redlock:{{{}}}", lease.resource().as_str())]);
    lease.lost().await;
    let reply = conn.read_reply().await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(reply.problem().as_deref(), Some("lock-lost"));
    eventually("the body was dropped", PROMPTLY, || chunks_tx.is_closed()).await;
    served.abort();
}
