//! [`LeaseBody`]: the response body of [`LockService`](super::LockService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use super::extensions::LeaseLost;
use crate::{Lease, LeaseHandle, LostCause, ReleaseOutcome};

/// The error type of [`LeaseBody`].
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

type Pending<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The response body of [`LockService`](super::LockService): the handler's body,
/// holding the lease until it ends, or a complete body of the layer's.
///
/// The lease is released **before** the body's end is handed on, so a client that has
/// read the whole response finds the lock free (see
/// [Lease lifetime](super#lease-lifetime)). Under [`OnLost::Abort`](super::OnLost::Abort)
/// a body whose lease is lost ends with a [`LeaseLost`] error, so that hyper cuts the
/// response short rather than send a complete-looking one; otherwise its errors are the
/// handler body's own (downcast to tell them apart). A body dropped before its end
/// releases in the background.
#[pin_project]
pub struct LeaseBody<B: Body> {
    #[pin]
    kind: Kind<B>,
}

#[pin_project(project = KindProj)]
enum Kind<B: Body> {
    Inner {
        #[pin]
        body: B,
        hold: Option<Hold<B::Data>>,
    },
    /// A complete body: a problem's, or the handler's read by the layer, and its
    /// trailers.
    Full {
        bytes: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    /// The start of the handler's body, read by the layer, then the rest of it.
    Rest {
        prefix: Option<Bytes>,
        body: Pin<Box<B>>,
        hold: Option<Hold<B::Data>>,
    },
}

/// The lease a body holds until its end.
struct Hold<D> {
    lease: Option<Lease>,
    /// [`OnLost::Abort`](super::OnLost::Abort): end the body with an error once lost.
    abort: bool,
    /// Made the first time the body waits, so a body that never waits (a complete one)
    /// allocates nothing for it.
    lost: Option<Pending<LostCause>>,
    /// The release under way, and the frame that ends the body (`None`: the end of a
    /// stream), handed on once the nodes answered.
    releasing: Option<(Pending<ReleaseOutcome>, Option<Frame<D>>)>,
}

impl<D> Hold<D> {
    fn new(lease: Lease, abort: bool) -> Self {
        Hold {
            lease: Some(lease),
            abort,
            lost: None,
            releasing: None,
        }
    }

    /// The cause, once the lease is lost (checked without waiting).
    fn lost_now(&self) -> Option<LostCause> {
        self.lease.as_ref().and_then(|lease| lease.lost_cause())
    }

    /// Waits for a loss alongside the body.
    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<LostCause> {
        let Some(lease) = &self.lease else {
            return Poll::Pending;
        };
        let lost = self.lost.get_or_insert_with(|| {
            let handle = lease.handle();
            Box::pin(async move { handle.lost().await })
        });
        lost.as_mut().poll(cx)
    }
}

/// One frame of a body holding `hold`: the body's frame, the release awaited before the
/// last one, or an error once the lease is lost under `abort`.
fn poll_held<B>(
    mut body: Pin<&mut B>,
    slot: &mut Option<Hold<B::Data>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<B::Data>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let Some(hold) = slot else {
        return body.poll_frame(cx).map_err(Into::into);
    };
    if let Some((release, _)) = &mut hold.releasing {
        ready!(release.as_mut().poll(cx));
        let last = slot
            .take()
            .and_then(|hold| hold.releasing)
            .and_then(|(_, last)| last);
        return Poll::Ready(last.map(Ok));
    }
    if hold.abort
        && let Some(cause) = hold.lost_now()
    {
        // Dropping the lease releases it in the background.
        *slot = None;
        return Poll::Ready(Some(Err(Box::new(LeaseLost(cause)))));
    }
    let frame = match body.as_mut().poll_frame(cx) {
        Poll::Ready(frame) => frame,
        Poll::Pending => {
            if hold.abort
                && let Poll::Ready(cause) = hold.poll_lost(cx)
            {
                *slot = None;
                return Poll::Ready(Some(Err(Box::new(LeaseLost(cause)))));
            }
            return Poll::Pending;
        }
    };
    let last = match frame {
        Some(Ok(frame)) if !body.is_end_stream() => return Poll::Ready(Some(Ok(frame))),
        Some(Ok(frame)) => Some(frame),
        None => None,
        Some(Err(error)) => {
            *slot = None;
            return Poll::Ready(Some(Err(error.into())));
        }
    };
    match hold.lease.take() {
        Some(lease) => {
            hold.releasing = Some((Box::pin(lease.release()), last));
            poll_held(body, slot, cx)
        }
        None => {
            *slot = None;
            Poll::Ready(last.map(Ok))
        }
    }
}

impl<B: Body> LeaseBody<B> {
    /// `body` holding no lease.
    pub fn new(body: B) -> Self {
        LeaseBody {
            kind: Kind::Inner { body, hold: None },
        }
    }

    /// `body` holding `lease` until it ends (released before the end is handed on) or
    /// is dropped; with `abort`, ending with [`LeaseLost`] once the lease is lost.
    pub(crate) fn holding(body: B, lease: Lease, abort: bool) -> Self {
        LeaseBody {
            kind: Kind::Inner {
                body,
                hold: Some(Hold::new(lease, abort)),
            },
        }
    }

    /// A complete body of `bytes`, as the layer's problem responses have.
    pub fn full(bytes: Bytes) -> Self {
        LeaseBody::recorded(bytes, None)
    }

    /// A complete body of `bytes` read from the handler's body, then `trailers`.
    pub(crate) fn recorded(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        LeaseBody {
            kind: Kind::Full {
                bytes: (!bytes.is_empty()).then_some(bytes),
                trailers,
            },
        }
    }

    /// `prefix`, already read from `body`, then the rest of `body`, holding `lease` as
    /// [`holding`](Self::holding) does.
    pub(crate) fn rest(
        prefix: Bytes,
        body: Pin<Box<B>>,
        lease: Option<Lease>,
        abort: bool,
    ) -> Self {
        LeaseBody {
            kind: Kind::Rest {
                prefix: (!prefix.is_empty()).then_some(prefix),
                body,
                hold: lease.map(|lease| Hold::new(lease, abort)),
            },
        }
    }

    /// The lease this body still holds, if any.
    pub fn lease(&self) -> Option<&LeaseHandle> {
        match &self.kind {
            Kind::Inner {
                hold: Some(hold), ..
            }
            | Kind::Rest {
                hold: Some(hold), ..
            } => hold.lease.as_deref(),
            _ => None,
        }
    }
}

impl<B> Body for LeaseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, hold } => poll_held(body, hold, cx),
            KindProj::Full { bytes, trailers } => Poll::Ready(match bytes.take() {
                Some(b) => Some(Ok(Frame::data(b.into()))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Rest { prefix, body, hold } => {
                if let Some(b) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(b.into()))));
                }
                poll_held(body.as_mut(), hold, cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            // A body holding its lease is polled to its end, where the release runs.
            Kind::Inner { body, hold } => hold.is_none() && body.is_end_stream(),
            Kind::Full { bytes, trailers } => bytes.is_none() && trailers.is_none(),
            Kind::Rest { prefix, body, hold } => {
                prefix.is_none() && hold.is_none() && body.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { bytes, .. } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Rest { prefix, body, .. } => {
                let prefix = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let rest = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(prefix));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(prefix));
                }
                hint
            }
        }
    }
}

impl<B: Body + fmt::Debug> fmt::Debug for LeaseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("LeaseBody");
        match &self.kind {
            Kind::Inner { body, .. } => out.field("body", body),
            Kind::Full { bytes, .. } => out.field("full", bytes),
            Kind::Rest { prefix, body, .. } => out.field("prefix", prefix).field("body", body),
        };
        out.field("lease", &self.lease()).finish()
    }
}
