//! Real HTTP/1.1 over loopback sockets: an axum router served by `axum::serve` on a free
//! 127.0.0.1 port, and a client that speaks to it the way real clients do — keeping a
//! connection alive for its next request, or hanging up mid-request. `oneshot` cannot
//! show what hyper does with a connection that closes or stays open.

// Each test binary that includes this file uses part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Bound on any one read or write; only reached when a test fails.
const IO_LIMIT: Duration = Duration::from_secs(20);

/// A router served on a loopback port until dropped.
pub struct Served {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Served {
    pub async fn start(app: Router) -> Served {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        Served { addr, task }
    }

    /// A new keep-alive connection.
    pub async fn connect(&self) -> Conn {
        Conn::open(self.addr).await
    }

    /// One request on a connection of its own.
    pub async fn send(&self, request: Req) -> Reply {
        self.connect().await.send(request).await
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A request, written by hand.
#[derive(Clone)]
pub struct Req {
    method: &'static str,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    pub fn new(method: &'static str, path: impl Into<String>) -> Req {
        Req {
            method,
            path: path.into(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    pub fn post(path: impl Into<String>) -> Req {
        Req::new("POST", path)
    }

    pub fn get(path: impl Into<String>) -> Req {
        Req::new("GET", path)
    }

    pub fn put(path: impl Into<String>) -> Req {
        Req::new("PUT", path)
    }

    pub fn header(mut self, name: &str, value: &str) -> Req {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn json(self, body: &str) -> Req {
        let mut req = self.header("content-type", "application/json");
        req.body = body.as_bytes().to_vec();
        req
    }

    fn encode(&self) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {}\r\n",
            self.method,
            self.path,
            self.body.len()
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(&self.body);
        bytes
    }
}

/// A response as the client read it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem type's fragment, e.g. `lock-held`.
    pub fn problem(&self) -> Option<String> {
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        let kind = json.get("type")?.as_str()?;
        Some(kind.rsplit('#').next().unwrap_or(kind).to_owned())
    }
}

/// The connection closed before a chunked body's terminating chunk: the body was cut
/// short.
#[derive(Debug, PartialEq, Eq)]
pub struct Cut;

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Conn {
        Conn::try_open(addr).await.expect("connect")
    }

    /// A new connection, or `None` when nothing listens at `addr` (a killed server).
    pub async fn try_open(addr: SocketAddr) -> Option<Conn> {
        let stream = tokio::time::timeout(IO_LIMIT, TcpStream::connect(addr))
            .await
            .expect("connect timed out")
            .ok()?;
        stream.set_nodelay(true).expect("nodelay");
        Some(Conn {
            reader: BufReader::new(stream),
        })
    }

    /// Writes `request` and reads the whole response.
    pub async fn send(&mut self, request: Req) -> Reply {
        self.write(&request).await;
        self.read_reply().await
    }

    /// Writes `request` and reads the whole response; `None` when the connection broke
    /// first (the server process was killed). Only a hang panics.
    pub async fn try_send(&mut self, request: &Req) -> Option<Reply> {
        let bytes = request.encode();
        tokio::time::timeout(IO_LIMIT, self.reader.get_mut().write_all(&bytes))
            .await
            .expect("write timed out")
            .ok()?;
        self.try_read_reply().await
    }

    /// Writes `request` without reading anything.
    pub async fn write(&mut self, request: &Req) {
        let bytes = request.encode();
        tokio::time::timeout(IO_LIMIT, self.reader.get_mut().write_all(&bytes))
            .await
            .expect("write timed out")
            .expect("write");
    }

    /// Reads the status line and headers of a response.
    pub async fn read_head(&mut self) -> (u16, HashMap<String, String>) {
        self.try_read_head()
            .await
            .expect("the server closed the connection")
    }

    async fn try_read_head(&mut self) -> Option<(u16, HashMap<String, String>)> {
        let mut line = String::new();
        self.try_read_line(&mut line).await?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {line:?}"));
        let mut headers = HashMap::new();
        loop {
            line.clear();
            self.try_read_line(&mut line).await?;
            let trimmed = line.trim_end();
            if trimmed.is_empty() {
                break;
            }
            if let Some((name, value)) = trimmed.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
            }
        }
        Some((status, headers))
    }

    /// Reads a whole response.
    pub async fn read_reply(&mut self) -> Reply {
        self.try_read_reply()
            .await
            .expect("a whole response before the connection closed")
    }

    /// Reads a whole response; `None` when the connection closed or failed first.
    pub async fn try_read_reply(&mut self) -> Option<Reply> {
        let (status, headers) = self.try_read_head().await?;
        let body = if let Some(length) = headers.get("content-length") {
            let mut body = vec![0; length.parse().expect("content-length")];
            tokio::time::timeout(IO_LIMIT, self.reader.read_exact(&mut body))
                .await
                .expect("body timed out")
                .ok()?;
            body
        } else if headers
            .get("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            let mut body = Vec::new();
            while let Some(chunk) = self.read_chunk().await.ok()? {
                body.extend(chunk);
            }
            body
        } else {
            Vec::new()
        };
        Some(Reply {
            status,
            headers,
            body,
        })
    }

    /// The next chunk of a chunked body: `Ok(None)` at the terminating chunk,
    /// `Err(Cut)` when the connection closed first.
    pub async fn read_chunk(&mut self) -> Result<Option<Vec<u8>>, Cut> {
        let mut line = String::new();
        let read = tokio::time::timeout(IO_LIMIT, self.reader.read_line(&mut line))
            .await
            .expect("chunk timed out");
        if !matches!(read, Ok(n) if n > 0) {
            return Err(Cut);
        }
        let size = usize::from_str_radix(line.trim(), 16).map_err(|_| Cut)?;
        let mut chunk = vec![0; size + 2];
        let read = tokio::time::timeout(IO_LIMIT, self.reader.read_exact(&mut chunk))
            .await
            .expect("chunk timed out");
        if read.is_err() {
            return Err(Cut);
        }
        chunk.truncate(size);
        Ok((size > 0).then_some(chunk))
    }

    /// `true` when the server closes the connection without a response, as hyper does
    /// when the task serving it panicked.
    pub async fn closed_without_reply(&mut self) -> bool {
        let mut line = String::new();
        let read = tokio::time::timeout(IO_LIMIT, self.reader.read_line(&mut line))
            .await
            .expect("read timed out");
        matches!(read, Ok(0) | Err(_))
    }

    /// `None` at the end of the stream or on an error of the connection.
    async fn try_read_line(&mut self, line: &mut String) -> Option<()> {
        let read = tokio::time::timeout(IO_LIMIT, self.reader.read_line(line))
            .await
            .expect("read timed out");
        matches!(read, Ok(n) if n > 0).then_some(())
    }
}

/// A tower layer for tests, outside the lock layer: tells when a response future was
/// dropped before it finished — what hyper does when the client hangs up.
#[derive(Clone, Default)]
pub struct DropWatch {
    pub dropped: Arc<Notify>,
}

impl<S> tower::Layer<S> for DropWatch {
    type Service = DropWatchService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DropWatchService {
            inner,
            dropped: self.dropped.clone(),
        }
    }
}

#[derive(Clone)]
pub struct DropWatchService<S> {
    inner: S,
    dropped: Arc<Notify>,
}

impl<S, R> tower::Service<R> for DropWatchService<S>
where
    S: tower::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        struct Guard(Option<Arc<Notify>>);
        impl Guard {
            fn disarm(mut self) {
                self.0 = None;
            }
        }
        impl Drop for Guard {
            fn drop(&mut self) {
                if let Some(dropped) = self.0.take() {
                    dropped.notify_one();
                }
            }
        }
        let future = self.inner.call(request);
        let guard = Guard(Some(self.dropped.clone()));
        Box::pin(async move {
            let output = future.await;
            guard.disarm();
            output
        })
    }
}
