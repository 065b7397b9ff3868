//! A critical section runs whole: for the layer's leases and, with
//! [`FinishOnDisconnectLayer`], the `Locked` extractor's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tower_layer::Layer;
use tower_service::Service;

use crate::metrics;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Handlers of this process running on after their client left.
static FINISHING: AtomicUsize = AtomicUsize::new(0);

/// How many handlers of this process run on, under their leases, after their client
/// left ([`OnDisconnect::Finish`](super::OnDisconnect::Finish),
/// [`FinishOnDisconnectLayer`]); also the `tower_redlock_http_handlers_finishing`
/// gauge (feature `metrics`). Log it at shutdown, before
/// [`Redlock::drain`](crate::Redlock::drain) waits for them. Each is bounded by its
/// lease (lost under [`OnLost::Abort`](super::OnLost::Abort), renewed at most for
/// [`LockOptions::max_hold`](crate::LockOptions::max_hold)).
pub fn handlers_finishing() -> usize {
    FINISHING.load(Ordering::Relaxed)
}

/// Runs a critical section whose response no one awaits any more to its end; what it
/// answers is dropped, which releases a lease its body still holds.
pub(crate) fn finish_detached<O: 'static>(section: BoxFuture<O>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // No runtime (it is shutting down): nothing can run it; the lease drops.
        tracing::warn!("response future dropped outside a runtime: the handler is cancelled");
        return;
    };
    tracing::debug!("the client left while the handler held its lease: finishing it");
    metrics::handlers_finishing(1.0);
    FINISHING.fetch_add(1, Ordering::Relaxed);
    runtime.spawn(async move {
        drop(section.await);
        FINISHING.fetch_sub(1, Ordering::Relaxed);
        metrics::handlers_finishing(-1.0);
        tracing::debug!("handler finished after its client left");
    });
}

/// A request extension [`FinishOnDisconnectLayer`] gives the request, set by whatever
/// takes a lease for it inside the handler (the `Locked` extractor): from then on the
/// handler is in its critical section.
#[derive(Clone, Default)]
pub(crate) struct Critical(Arc<AtomicBool>);

#[cfg(feature = "axum")]
impl Critical {
    /// The handler holds a lease now.
    pub(crate) fn enter(extensions: &http::Extensions) {
        if let Some(critical) = extensions.get::<Critical>() {
            critical.0.store(true, Ordering::Release);
        }
    }
}

/// A [`Layer`] that lets a handler which took a lock itself run to its end when its
/// client goes away, as [`LockLayer`](super::LockLayer) does for its own locks
/// ([`OnDisconnect::Finish`](super::OnDisconnect::Finish)).
///
/// hyper drops a request's future when its connection closes: a handler holding a
/// `Locked` lease would be cut at its next `.await`, halfway through what it protects.
/// Under this layer, once a `Locked` extractor of the request acquired its lease, a
/// dropped response future is run to its end in a task of its own
/// ([`handlers_finishing`]); before that, it is dropped as usual. A handler that panics
/// is dropped as the panic unwinds, never run on. Put it on the routes that use
/// `Locked`:
///
/// ```
/// # use tower_redlock::axum::{LockKey, Locked};
/// # use tower_redlock::http::key::{header, Header};
/// # struct PaymentKey;
/// # impl LockKey for PaymentKey {
/// #     type Extractor = Header;
/// #     fn extractor() -> Header { header("Idempotency-Key") }
/// # }
/// # async fn pay(lock: Locked<PaymentKey>) {}
/// use axum::{routing::post, Router};
/// use tower_redlock::http::FinishOnDisconnectLayer;
/// use tower_redlock::Redlock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app: Router = Router::new()
///     .route("/payments", post(pay))
///     .route_layer(FinishOnDisconnectLayer::new())
///     .with_state(Redlock::in_memory());
/// # let _ = app;
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct FinishOnDisconnectLayer {
    _private: (),
}

impl FinishOnDisconnectLayer {
    /// The layer.
    pub fn new() -> Self {
        FinishOnDisconnectLayer::default()
    }
}

impl<S> Layer<S> for FinishOnDisconnectLayer {
    type Service = FinishOnDisconnect<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FinishOnDisconnect { inner }
    }
}

/// The service of [`FinishOnDisconnectLayer`]. Public in a private module, as is its
/// future: the layer's `Service` type names them, no user needs to.
#[derive(Debug, Clone)]
pub struct FinishOnDisconnect<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for FinishOnDisconnect<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
    S::Response: 'static,
    S::Error: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = FinishingFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let critical = Critical::default();
        request.extensions_mut().insert(critical.clone());
        FinishingFuture::new(Box::pin(self.inner.call(request)), Some(critical), true)
    }
}

/// A critical section's future: the response future of [`FinishOnDisconnect`], and
/// the layer's once its lease is held. Dropped before its end while critical, it is run
/// on to its end by `detach` (made where the output is known to be `'static`); without
/// `detach` it is dropped, and its lease released in the background.
pub struct FinishingFuture<O> {
    future: Option<BoxFuture<O>>,
    /// `None`: critical from the start (the layer's own lease).
    critical: Option<Critical>,
    detach: Option<fn(BoxFuture<O>)>,
}

impl<O: 'static> FinishingFuture<O> {
    /// `section`, run on to its end when dropped while critical if `finish`.
    pub(crate) fn new(section: BoxFuture<O>, critical: Option<Critical>, finish: bool) -> Self {
        FinishingFuture {
            future: Some(section),
            critical,
            detach: finish.then_some(finish_detached::<O> as fn(_)),
        }
    }
}

impl<O> Future for FinishingFuture<O> {
    type Output = O;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        // Out of `self` while it is polled: a section whose poll panics is dropped by the
        // unwinding (its lease released at once), never detached to be polled again. A
        // panic is not a disconnect.
        let Some(mut future) = self.future.take() else {
            panic!("FinishingFuture polled after completion");
        };
        let output = future.as_mut().poll(cx);
        if output.is_pending() {
            self.future = Some(future);
        }
        output
    }
}

impl<O> Drop for FinishingFuture<O> {
    fn drop(&mut self) {
        let critical = (self.critical.as_ref()).is_none_or(|c| c.0.load(Ordering::Acquire));
        if let (Some(future), Some(detach), true) = (self.future.take(), self.detach, critical) {
            detach(future);
        }
    }
}

impl<O> fmt::Debug for FinishingFuture<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FinishingFuture")
            .field("done", &self.future.is_none())
            .finish()
    }
}
