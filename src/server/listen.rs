//! The accept loop: HTTP/1.1 connections with the limits a server open to a network needs
//! (docs/server.md "Limits"). axum's own `serve` has no header-read timeout and no
//! connection cap, so idle or half-open connections could hold the server's file
//! descriptors and starve new clients.
//!
//! - at most `max_connections` at once; one more is answered 503 and closed at once, so a
//!   client at the cap learns why instead of waiting in the backlog;
//! - a connection must send a complete request head within `header_read_timeout`, whether
//!   it is new or kept alive between requests (hyper's timer covers both), or it is closed;
//! - half-closed clients (a `shutdown(SHUT_WR)` after a complete request) get their answer;
//! - on shutdown, accepting stops and each connection ends after its response in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The connection limits (`strata serve --max-connections`, `--header-read-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
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
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
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
