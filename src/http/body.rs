//! [`LeaseBody`]: the response body of [`LockService`](super::LockService).

use std::fmt;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use crate::lock::{Lease, LeaseHandle};

/// The response body of [`LockService`](super::LockService): the handler's body,
/// holding the lease until it ends, or a problem body of the layer.
///
/// The lease is released (in the background, never blocking) when the body yields its
/// last frame or an error, or when it is dropped — for example because the client went
/// away mid-stream. So a streamed response is produced entirely under the lock.
#[pin_project]
pub struct LeaseBody<B> {
    #[pin]
    kind: Kind<B>,
}

#[pin_project(project = KindProj)]
enum Kind<B> {
    Inner {
        #[pin]
        body: B,
        lease: Option<Lease>,
    },
    Problem {
        bytes: Option<Bytes>,
    },
    /// A complete body read by the layer (idempotent replay), and its trailers.
    Recorded {
        bytes: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
    /// The start of the handler's body, read by the layer, then the rest of it.
    Rest {
        prefix: Option<Bytes>,
        body: Pin<Box<B>>,
        lease: Option<Lease>,
    },
}

impl<B> LeaseBody<B> {
    /// `body` holding no lease.
    pub fn new(body: B) -> Self {
        LeaseBody {
            kind: Kind::Inner { body, lease: None },
        }
    }

    /// `body` holding `lease` until it ends or is dropped.
    pub(crate) fn holding(body: B, lease: Lease) -> Self {
        LeaseBody {
            kind: Kind::Inner {
                body,
                lease: Some(lease),
            },
        }
    }

    /// A complete body of `bytes`, as the layer's problem responses have.
    pub fn full(bytes: Bytes) -> Self {
        LeaseBody {
            kind: Kind::Problem {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }

    /// A complete body of `bytes` read from the handler's body, then `trailers`.
    pub(crate) fn recorded(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        LeaseBody {
            kind: Kind::Recorded {
                bytes: (!bytes.is_empty()).then_some(bytes),
                trailers,
            },
        }
    }

    /// `prefix`, already read from `body`, then the rest of `body`, holding `lease`
    /// until it ends or is dropped.
    pub(crate) fn rest(prefix: Bytes, body: Pin<Box<B>>, lease: Option<Lease>) -> Self {
        LeaseBody {
            kind: Kind::Rest {
                prefix: (!prefix.is_empty()).then_some(prefix),
                body,
                lease,
            },
        }
    }

    /// The lease this body still holds, if any.
    pub fn lease(&self) -> Option<&LeaseHandle> {
        match &self.kind {
            Kind::Inner {
                lease: Some(lease), ..
            }
            | Kind::Rest {
                lease: Some(lease), ..
            } => Some(lease),
            _ => None,
        }
    }
}

impl<B> Body for LeaseBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { mut body, lease } => {
                let frame = ready!(body.as_mut().poll_frame(cx));
                let finished = match &frame {
                    None | Some(Err(_)) => true,
                    Some(Ok(_)) => body.is_end_stream(),
                };
                if finished {
                    // Dropping the lease releases it in the background.
                    drop(lease.take());
                }
                Poll::Ready(frame)
            }
            KindProj::Problem { bytes } => {
                Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b.into()))))
            }
            KindProj::Recorded { bytes, trailers } => Poll::Ready(match bytes.take() {
                Some(b) => Some(Ok(Frame::data(b.into()))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Rest {
                prefix,
                body,
                lease,
            } => {
                if let Some(b) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(b.into()))));
                }
                let frame = ready!(body.as_mut().poll_frame(cx));
                let finished = match &frame {
                    None | Some(Err(_)) => true,
                    Some(Ok(_)) => body.is_end_stream(),
                };
                if finished {
                    drop(lease.take());
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Problem { bytes } => bytes.is_none(),
            Kind::Recorded { bytes, trailers } => bytes.is_none() && trailers.is_none(),
            Kind::Rest { prefix, body, .. } => prefix.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Problem { bytes } | Kind::Recorded { bytes, .. } => {
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

impl<B: fmt::Debug> fmt::Debug for LeaseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { body, lease } => f
                .debug_struct("LeaseBody")
                .field("body", body)
                .field("lease", lease)
                .finish(),
            Kind::Problem { bytes } => f.debug_struct("LeaseBody").field("problem", bytes).finish(),
            Kind::Recorded { bytes, .. } => f
                .debug_struct("LeaseBody")
                .field("recorded", bytes)
                .finish(),
            Kind::Rest {
                prefix,
                body,
                lease,
                ..
            } => f
                .debug_struct("LeaseBody")
                .field("prefix", prefix)
                .field("body", body)
                .field("lease", lease)
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::convert::Infallible;
    use tokio::sync::mpsc;

    use crate::lock::Redlock;

    #[tokio::test]
    async fn problem_bodies_are_complete() {
        let body = LeaseBody::<Full<Bytes>>::full(Bytes::from_static(b"{}"));
        assert_eq!(body.size_hint().exact(), Some(2));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "{}");
        let empty = LeaseBody::<Full<Bytes>>::full(Bytes::new());
        assert!(empty.is_end_stream());
    }

    #[tokio::test]
    async fn the_lease_is_released_after_the_last_frame() {
        let locker = Redlock::in_memory();
        let lease = locker.try_acquire("body").await.unwrap();
        let handle = lease.handle();
        let (tx, rx) = mpsc::channel::<Bytes>(1);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        let mut body = std::pin::pin!(LeaseBody::holding(StreamBody::new(stream), lease));
        tx.send(Bytes::from_static(b"a")).await.unwrap();
        let frame = body.as_mut().frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "a");
        assert!(body.lease().is_some());
        assert!(handle.is_held());
        drop(tx);
        assert!(body.as_mut().frame().await.is_none());
        assert!(body.lease().is_none());
        // The release runs in the background; the local queue frees once it is done.
        locker
            .acquire("body", std::time::Duration::from_secs(5))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn known_length_bodies_release_with_their_last_frame() {
        let locker = Redlock::in_memory();
        let lease = locker.try_acquire("full").await.unwrap();
        let mut body = LeaseBody::holding(Full::new(Bytes::from_static(b"x")), lease);
        assert!(body.frame().await.is_some());
        assert!(body.lease().is_none());
        assert!(body.is_end_stream());
    }
}
