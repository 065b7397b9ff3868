//! The HTTP level (scenarios 7 and 8c): axum routers behind `LockLayer`, their
//! handlers, a load of duplicate requests, and the judge of every answer.

use super::*;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::Path;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_redlock::axum::LayerLease;
use tower_redlock::http::problem::CONTENT_TYPE_PROBLEM;

/// Where the problems' `type` URIs point.
const TYPE_BASE: &str = "https://docs.rs/tower-redlock/latest/tower_redlock/http/problem/";
use tower_redlock::http::{
    key::{header, path_param},
    Contention, LockLayer, OnDisconnect, OnLost, Scope,
};
use tower_redlock::{
    http::{problem::ProblemKind, LeaseLost},
    LeaseHandle,
};

/// A request with this header is a witness: its handler stays inside until the
/// lease is lost (and, under `OnLost::Abort`, until the layer stops it).
pub const HOLD: &str = "x-hold-until-lost";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /orders/{id}/pay`: `Contention::Reject`, the lease from `LayerLease`.
    Pay,
    /// `POST /orders/{id}/ship`: `Contention::Wait`, the lease from
    /// `Extension<LeaseHandle>`.
    Ship,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::Pay => "pay",
            Route::Ship => "ship",
        }
    }
}

/// One app instance of s07: its layers' policies (each instance has its own locker).
#[derive(Debug, Clone, Copy)]
pub struct AppSpec {
    pub name: &'static str,
    pub on_lost: OnLost,
    /// `LockLayer::queue_limit` of the waiting route, if any.
    pub ship_queue_limit: Option<usize>,
}

impl AppSpec {
    /// The refusals this instance may answer on `route`.
    fn allows(&self, route: Route, status: StatusCode, code: &str) -> bool {
        match (status.as_u16(), code) {
            (409, "lock-held") => route == Route::Pay,
            (409, "lock-wait-timeout") => route == Route::Ship,
            (503, "lock-unavailable") => true,
            (503, "lock-lost") => self.on_lost == OnLost::Abort,
            (503, "lock-queue-full") => route == Route::Ship && self.ship_queue_limit.is_some(),
            _ => false,
        }
    }
}

/// What the handlers of one app instance share.
struct Ctx {
    spec: AppSpec,
    history: History,
    /// A careful handler writes only with more validity left than this.
    margin: Duration,
    /// Witness handlers announce themselves here once inside.
    witnesses: mpsc::UnboundedSender<String>,
}

/// One app instance: `/orders/{id}/pay` (reject) and `/orders/{id}/ship` (wait up to
/// `wait`), both locking `Scope::shared("order")` on the path's `id`, so that paying
/// and shipping one order exclude each other, across both routes and both instances.
pub fn order_app(
    spec: AppSpec,
    locker: &Redlock,
    wait: Duration,
    history: &History,
    witnesses: &mpsc::UnboundedSender<String>,
) -> Router {
    let ctx = Arc::new(Ctx {
        spec,
        history: history.clone(),
        margin: locker.options().get_ttl() / 10,
        witnesses: witnesses.clone(),
    });
    let pay = {
        let ctx = ctx.clone();
        move |Path(id): Path<String>, LayerLease(lease): LayerLease, headers: HeaderMap| {
            order_handler(ctx.clone(), Route::Pay, id, lease, headers)
        }
    };
    let ship = {
        let ctx = ctx.clone();
        move |Path(id): Path<String>,
              Extension(lease): Extension<LeaseHandle>,
              headers: HeaderMap| {
            order_handler(ctx.clone(), Route::Ship, id, lease, headers)
        }
    };
    // BROKEN=1: one lock per route (the default scope), although both routes change
    // the same order: paying and shipping one order then overlap.
    let scope = if broken() {
        Scope::Route
    } else {
        Scope::shared("order")
    };
    let reject = LockLayer::new(locker.clone(), path_param("id"))
        .scope(scope.clone())
        .on_lost(spec.on_lost);
    let mut waiting = LockLayer::new(locker.clone(), path_param("id"))
        .scope(scope)
        .on_lost(spec.on_lost)
        .contention(Contention::Wait { timeout: wait });
    if let Some(limit) = spec.ship_queue_limit {
        waiting = waiting.queue_limit(limit);
    }
    Router::new()
        .route("/orders/{id}/pay", post(pay).layer(reject))
        .route("/orders/{id}/ship", post(ship).layer(waiting))
}

/// The critical section of a request on order `id`: recorded in the history, one
/// write to the order in the fenced storage with the token of the layer's lease (if
/// enough validity is left), and the token as the body, so that the client can
/// compare it with the `Fencing-Token` header.
async fn order_handler(
    ctx: Arc<Ctx>,
    route: Route,
    id: String,
    lease: LeaseHandle,
    headers: HeaderMap,
) -> String {
    let token = lease.fencing_token();
    let holder = format!(
        "app {} {} ({})",
        ctx.spec.name,
        route.name(),
        lease.resource()
    );
    let mut section = ctx
        .history
        .begin(format!("order {id}"), token.get(), holder);
    if headers.contains_key(HOLD) {
        let _ = ctx.witnesses.send(lease.resource().to_string());
        match ctx.spec.on_lost {
            // Only the layer can end this request: it must stop the handler.
            OnLost::Abort => std::future::pending::<()>().await,
            _ => {
                let _ = tokio::time::timeout(bound(30), lease.lost()).await;
            }
        }
    } else {
        // The work: a few polls and up to 2 ms (sets how long a holder works).
        for _ in 0..rand::random_range(0..3u32) {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_micros(rand::random_range(0..2000))).await;
    }
    if lease.remaining() > ctx.margin {
        section.write();
    } else {
        ctx.history.skipped_write();
    }
    tokio::task::yield_now().await;
    section.end(lease.lost_cause().is_some());
    token.to_string()
}

/// A response read to the end.
pub struct Answer {
    pub parts: http::response::Parts,
    pub body: Bytes,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem code of a refusal, after checking its envelope: problem+json, a
    /// `type` of this crate whose kind has this status, `status` member equal to the
    /// HTTP status, title and detail, and `Retry-After`.
    pub fn problem_code(&self) -> Result<&'static str, String> {
        let status = self.parts.status;
        let content_type = self
            .parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        if content_type != Some(CONTENT_TYPE_PROBLEM) {
            return Err(format!(
                "{status} with content type {content_type:?}: {}",
                self.text()
            ));
        }
        let json: serde_json::Value = serde_json::from_slice(&self.body)
            .map_err(|e| format!("{status}: body is not JSON ({e}): {}", self.text()))?;
        let type_uri = json["type"].as_str().unwrap_or_default();
        let kind = ProblemKind::from_type_uri(type_uri)
            .filter(|kind| kind.type_uri() == type_uri && type_uri.starts_with(TYPE_BASE))
            .ok_or_else(|| format!("{status}: unknown problem type: {json}"))?;
        let well_formed = kind.status() == status
            && json["status"] == status.as_u16()
            && json["title"].as_str().is_some_and(|t| !t.is_empty())
            && json["detail"].as_str().is_some_and(|d| !d.is_empty())
            && self.parts.headers.contains_key(RETRY_AFTER);
        if !well_formed {
            return Err(format!(
                "{status}: malformed problem (headers {:?}): {json}",
                self.parts.headers
            ));
        }
        Ok(kind.code())
    }

    /// The token of a 200: the body, which must equal the `Fencing-Token` header.
    pub fn token(&self) -> Result<u64, String> {
        let header = self
            .parts
            .headers
            .get("fencing-token")
            .and_then(|v| v.to_str().ok());
        let body = self.text();
        match header {
            Some(header) if header == body => body
                .parse()
                .map_err(|e| format!("200 with a token that is not a number ({e}): {body}")),
            _ => Err(format!(
                "200 whose Fencing-Token {header:?} is not the handler's token {body:?}"
            )),
        }
    }

    pub fn lease_lost(&self) -> Option<LostCause> {
        self.parts.extensions.get::<LeaseLost>().map(|lost| lost.0)
    }
}

/// Sends `request` to `app` and reads the whole response, or `None` after `limit`.
pub async fn send(app: &Router, request: Request<Body>, limit: Duration) -> Option<Answer> {
    let exchange = async {
        let response = app
            .clone()
            .oneshot(request)
            .await
            .unwrap_or_else(|e| match e {});
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map(|c| c.to_bytes());
        (parts, body)
    };
    match tokio::time::timeout(limit, exchange).await {
        Ok((parts, Ok(body))) => Some(Answer { parts, body }),
        Ok((parts, Err(e))) => panic!("{}: the response body failed: {e}", parts.status),
        Err(_) => None,
    }
}

pub fn order_request(id: &str, route: Route, witness: bool) -> Request<Body> {
    let mut request = Request::post(format!("/orders/{id}/{}", route.name()));
    if witness {
        request = request.header(HOLD, "1");
    }
    request.body(Body::empty()).expect("request")
}

/// What the clients saw.
pub struct Tally {
    responses: watch::Sender<u64>,
    pub ok: AtomicU64,
    pub unavailable: AtomicU64,
    pub ok_after_loss: AtomicU64,
    pub hung: AtomicU64,
    /// Answers per "app route status[ code]".
    by_kind: Mutex<BTreeMap<String, u64>>,
    slowest: Mutex<Duration>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            responses: watch::Sender::new(0),
            ok: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            ok_after_loss: AtomicU64::new(0),
            hung: AtomicU64::new(0),
            by_kind: Mutex::default(),
            slowest: Mutex::default(),
        }
    }

    pub fn responses(&self) -> u64 {
        *self.responses.borrow()
    }

    pub fn slowest(&self) -> Duration {
        *self.slowest.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn kinds(&self) -> BTreeMap<String, u64> {
        self.by_kind
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Answers of one kind, over both instances and routes (e.g. `409 lock-held`).
    pub fn count(&self, kind: &str) -> u64 {
        self.kinds()
            .iter()
            .filter(|(k, _)| k.ends_with(kind))
            .map(|(_, n)| n)
            .sum()
    }

    fn add(&self, kind: String, took: Duration) {
        *self
            .by_kind
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default() += 1;
        let mut slowest = self.slowest.lock().unwrap_or_else(|p| p.into_inner());
        *slowest = (*slowest).max(took);
        drop(slowest);
        self.responses.send_modify(|n| *n += 1);
    }

    /// Checks one answer; every breach becomes a recorded failure of the history.
    #[allow(clippy::too_many_arguments)]
    fn judge(
        &self,
        history: &History,
        spec: AppSpec,
        route: Route,
        label: &str,
        answer: Option<Answer>,
        in_outage: bool,
        limit: Duration,
        took: Duration,
    ) {
        let prefix = format!("{} {}", spec.name, route.name());
        let Some(answer) = answer else {
            self.hung.fetch_add(1, Ordering::Relaxed);
            history.fail(format!(
                "{label}: no answer within {limit:?}: the request hung"
            ));
            return self.add(format!("{prefix} hung"), took);
        };
        let status = answer.parts.status;
        let kind = if status == StatusCode::OK {
            if let Err(e) = answer.token() {
                history.fail(format!("{label}: {e}"));
            }
            if in_outage {
                history.fail(format!(
                    "{label}: 200 while a majority of the nodes was down"
                ));
            }
            if answer.lease_lost().is_some() {
                self.ok_after_loss.fetch_add(1, Ordering::Relaxed);
            }
            self.ok.fetch_add(1, Ordering::Relaxed);
            "200".to_owned()
        } else {
            match answer.problem_code() {
                Ok(code) if spec.allows(route, status, code) => {
                    match code {
                        "lock-unavailable" => {
                            self.unavailable.fetch_add(1, Ordering::Relaxed);
                            history.unavailable();
                        }
                        "lock-lost" => {}
                        _ => history.contended(),
                    }
                    format!("{} {code}", status.as_u16())
                }
                Ok(code) => {
                    history.fail(format!(
                        "{label}: unexpected answer {status} `{code}`: {}",
                        answer.text()
                    ));
                    format!("{} {code} (unexpected)", status.as_u16())
                }
                Err(e) => {
                    history.fail(format!("{label}: {e}"));
                    format!("{} (malformed)", status.as_u16())
                }
            }
        };
        self.add(format!("{prefix} {kind}"), took);
    }
}

/// Clients sending duplicate requests (a few order ids) to both instances and both
/// routes at random, until stopped.
pub struct Clients {
    stop: watch::Sender<bool>,
    handles: Vec<JoinHandle<()>>,
    pub tally: Arc<Tally>,
}

impl Clients {
    pub fn spawn(
        apps: &[(AppSpec, Router)],
        count: usize,
        ids: u32,
        limit: Duration,
        outage: &Arc<AtomicBool>,
        history: &History,
    ) -> Clients {
        let (stop, _) = watch::channel(false);
        let tally = Arc::new(Tally::new());
        let apps: Arc<Vec<(AppSpec, Router)>> = Arc::new(apps.to_vec());
        let handles = (0..count)
            .map(|c| {
                let (apps, tally, outage, history) =
                    (apps.clone(), tally.clone(), outage.clone(), history.clone());
                let stop = stop.subscribe();
                tokio::spawn(async move {
                    while !*stop.borrow() {
                        let (spec, app) = &apps[rand::random_range(0..apps.len())];
                        let route = if rand::random() {
                            Route::Pay
                        } else {
                            Route::Ship
                        };
                        let id = rand::random_range(0..ids).to_string();
                        let label =
                            format!("client {c}: {} {} order {id}", spec.name, route.name());
                        let outage_before = outage.load(Ordering::SeqCst);
                        let started = Instant::now();
                        let answer = send(app, order_request(&id, route, false), limit).await;
                        let took = started.elapsed();
                        // Strict only for requests that ran entirely inside the outage.
                        let in_outage = outage_before && outage.load(Ordering::SeqCst);
                        tally.judge(
                            &history, *spec, route, &label, answer, in_outage, limit, took,
                        );
                    }
                })
            })
            .collect();
        Clients {
            stop,
            handles,
            tally,
        }
    }

    /// Lets every client finish its request, then joins them.
    pub async fn stop(self) -> Arc<Tally> {
        self.stop.send_replace(true);
        join_all(self.handles).await;
        self.tally
    }
}

/// Waits until `responses` more answers and `sections` more critical sections;
/// panics naming the phase after `limit`.
pub async fn phase(
    tally: &Tally,
    history: &History,
    responses: u64,
    sections: u64,
    limit: Duration,
    phase: &str,
) {
    let (answers, cycles) = (tally.responses() + responses, history.cycles() + sections);
    let started = Instant::now();
    let reached = tokio::time::timeout(limit, async {
        let _ = tally
            .responses
            .subscribe()
            .wait_for(|n| *n >= answers)
            .await;
        history.cycles_reached(cycles).await;
    })
    .await;
    if verbose() {
        println!(
            "[faults]   phase `{phase}`: {responses} answers, {sections} sections in {:.2}s (200: {}, 503 unavailable: {})",
            started.elapsed().as_secs_f64(),
            tally.ok.load(Ordering::Relaxed),
            tally.unavailable.load(Ordering::Relaxed),
        );
    }
    assert!(
        reached.is_ok(),
        "no progress during `{phase}`: {} of {answers} answers, {} of {cycles} sections after {limit:?}",
        tally.responses(),
        history.cycles()
    );
}

/// Sends a witness request until its handler is inside (a loaded machine may refuse
/// one with 503); returns the request's task.
pub async fn enter_witness(
    app: &Router,
    id: &str,
    route: Route,
    entered: &mut mpsc::UnboundedReceiver<String>,
    limit: Duration,
) -> JoinHandle<Option<Answer>> {
    for _ in 0..20 {
        let (app, request) = (app.clone(), order_request(id, route, true));
        let mut task = tokio::spawn(async move { send(&app, request, limit).await });
        tokio::select! {
            Some(_) = entered.recv() => return task,
            answer = &mut task => {
                let answer = answer.expect("witness task");
                eprintln!(
                    "[faults]   witness `{id}` refused, again: {:?}",
                    answer.map(|a| a.text())
                );
            }
        }
    }
    panic!("witness `{id}` never got its lease");
}

// -----------------------------------------------------------------------------------
// 8c: a real server, raw clients that go away
// -----------------------------------------------------------------------------------

/// A handler of s08c, inside its critical section.
pub struct Entered {
    pub app: &'static str,
    pub resource: String,
    pub owner: String,
    /// Fails (the sender is gone) once the handler future has been dropped.
    pub dropped: oneshot::Receiver<()>,
}

/// One app instance of s08c, served over TCP: `POST /jobs` (reject) and
/// `POST /jobs/wait` (wait up to `wait`), both locking `Scope::shared("job")` on the
/// `Idempotency-Key` header. The handler announces itself, then never finishes; the
/// layer cancels a handler whose client left (`OnDisconnect::Cancel`: the default runs
/// it to its end, which s08d checks).
pub fn job_app(
    name: &'static str,
    locker: &Redlock,
    wait: Duration,
    history: &History,
    entered: &mpsc::UnboundedSender<Entered>,
) -> Router {
    let handler = {
        let (history, entered) = (history.clone(), entered.clone());
        move |Extension(lease): Extension<LeaseHandle>| {
            let (history, entered) = (history.clone(), entered.clone());
            async move {
                let mut section = history.begin(
                    lease.resource().as_str(),
                    lease.fencing_token().get(),
                    format!("app {name} job"),
                );
                section.write();
                let (guard, dropped) = oneshot::channel::<()>();
                let _ = entered.send(Entered {
                    app: name,
                    resource: lease.resource().as_str().to_owned(),
                    owner: lease.owner().to_owned(),
                    dropped,
                });
                // Until the client goes away: the section ends when this is dropped.
                let _inside = (guard, section);
                std::future::pending::<()>().await;
                "unreachable"
            }
        }
    };
    let layer = || {
        LockLayer::new(locker.clone(), header("Idempotency-Key"))
            .scope(Scope::shared("job"))
            .on_disconnect(OnDisconnect::Cancel)
    };
    Router::new()
        .route("/jobs", post(handler.clone()).layer(layer()))
        .route(
            "/jobs/wait",
            post(handler).layer(layer().contention(Contention::Wait { timeout: wait })),
        )
}

/// Serves `app` on a free port of 127.0.0.1.
pub async fn serve(app: Router) -> (SocketAddr, JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local_addr");
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("axum::serve");
    });
    (addr, server)
}

/// A raw HTTP/1.1 client: connects, sends `POST path` with `key`, and leaves the
/// connection open (the caller closes or resets it).
pub async fn open_request(addr: SocketAddr, path: &str, key: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: {key}\r\nContent-Length: 0\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    stream
}

/// Sends `POST path` with `key` until its handler is inside (a loaded machine may
/// refuse one with 503: then the answer arrives instead); returns the connection,
/// still open, and the handler's announcement.
pub async fn enter_job(
    addr: SocketAddr,
    path: &str,
    key: &str,
    entered: &mut mpsc::UnboundedReceiver<Entered>,
) -> (TcpStream, Entered) {
    for _ in 0..20 {
        let mut stream = open_request(addr, path, key).await;
        let mut answer = [0u8; 2048];
        let outcome = tokio::select! {
            Some(inside) = entered.recv() => Ok(inside),
            read = stream.read(&mut answer) => Err(read),
            () = tokio::time::sleep(bound(10)) => panic!("`{key}`: no handler, no answer"),
        };
        match outcome {
            Ok(inside) => return (stream, inside),
            Err(read) => eprintln!(
                "[faults]   `{key}` refused, again: {}",
                read.map_or_else(
                    |e| e.to_string(),
                    |n| String::from_utf8_lossy(&answer[..n]).into_owned()
                )
            ),
        }
    }
    panic!("`{key}`: refused 20 times");
}

/// The Redis key of a resource's lock (`resource` as `Resource::as_str` gives it).
pub fn lock_key(resource: &str) -> String {
    format!("{PREFIX}{{{resource}}}")
}

/// Nodes on which `owner` holds `resource`.
pub fn holding(servers: &[RedisServer], resource: &str, owner: &str) -> usize {
    let key = lock_key(resource);
    servers
        .iter()
        .filter(|s| super::held_by(s.get(&key), owner))
        .count()
}
