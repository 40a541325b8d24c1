//! The accept loop: HTTP/1.1 connections with the limits a server open to a network needs
//! (docs/server.md "Limits"). axum's own `serve` has no header-read timeout and no
//! connection cap, so idle or half-open connections could hold the server's file
//! descriptors and starve new clients.
//!
//! - at most `max_connections` at once; one more is answered 503 and closed at once, so a
//!   client at the cap learns why instead of waiting in the backlog;
//! - a connection must send a complete request head within `header_read_timeout`, whether
//!   it is new or kept alive between requests (hyper's timer covers both), or it is closed;
//! - a connection whose client accepts none of its response for as long (a client that
//!   pipelines requests and never reads the answers: hyper stops reading while a response
//!   cannot be written, so no read timer runs) is closed too (`StallLimited`);
//! - on shutdown, connections get `shutdown_timeout` to finish; then they are dropped.
//! - half-closed clients (a `shutdown(SHUT_WR)` after a complete request) get their answer;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Result;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// The connection limits (`strata serve --max-connections`, `--header-read-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// How long connections get to finish once shutdown starts (beyond it they are
    /// dropped: the requests in them were cancelled at `--shutdown-timeout` already).
    pub shutdown_timeout: Duration,
}

/// Serves `router` on `listener` until `shutdown` completes, then lets the connections in
/// flight finish their responses.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Refusals in flight; past them a connection is closed without an answer.
    let refusals = Arc::new(Semaphore::new(64));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .half_close(true);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors or a connection reset before it was accepted:
                // not the server's end; wait a moment for descriptors to come back.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if let Ok(permit) = Arc::clone(&refusals).try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(permit);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(
            TokioIo::new(StallLimited::new(stream, limits.header_read_timeout)),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    // Past the grace (requests in flight are cancelled at its end) plus a moment for the
    // cancelled streams to end, connections still open are dropped with the runtime.
    let _ = tokio::time::timeout(
        limits.shutdown_timeout + Duration::from_secs(1),
        graceful.shutdown(),
    )
    .await;
    Ok(())
}

/// A socket whose writes fail (`TimedOut`) once they have made no progress for `limit`:
/// hyper has no write timeout, and a client that stops reading would otherwise hold its
/// connection (and its slot of `--max-connections`) for ever.
struct StallLimited<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write or flush first returns `Pending`; disarmed by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> StallLimited<S> {
    fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// What a pending write or flush returns: still pending, or the stall's error.
    fn on_pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client accepted none of its response",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn track<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => self.on_pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallLimited<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallLimited<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.track(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.track(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.track(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.track(cx, r)
    }
}

/// Answers a connection over the cap with a 503 (an OpenAI-style error) and closes it.
async fn refuse(mut stream: TcpStream) {
    let body = super::error::ApiError::unavailable(
        "the server is at its connection limit (--max-connections); retry shortly",
    )
    .body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}
