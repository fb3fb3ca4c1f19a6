//! The connections of `kakeya serve`: an accept loop that caps how many are open (below the
//! process's open-file limit), answers one past the cap with a fast 503 in OpenAI's error
//! shape, keeps accepting when the process runs out of descriptors, and closes a connection
//! whose request head does not arrive in time — a half-sent request, or a keep-alive
//! connection left idle. [llama-server's `--timeout`; nginx's `client_header_timeout`]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::metrics::Metrics;

/// Descriptors kept back from the connection cap: the model's files, the listener, logs.
pub const RESERVED_FILES: usize = 64;

/// How connections are limited.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Most connections open at once; one more gets a 503 and is closed.
    pub max_open: usize,
    /// Time a connection gets to send a request's head (from its opening, or from the end of
    /// the previous response on a kept-alive connection).
    pub header_timeout: Duration,
}

/// The process's soft limit on open files (Linux: `/proc/self/limits`), when known.
pub fn open_file_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line.split_whitespace().nth(3)?;
    match soft {
        "unlimited" => Some(usize::MAX),
        n => n.parse().ok(),
    }
}

/// The connection cap a process with `file_limit` open files can hold: the limit less
/// [`RESERVED_FILES`] (at least 1), or `wanted` when that is lower.
pub fn connection_cap(wanted: usize, file_limit: Option<usize>) -> usize {
    match file_limit {
        Some(limit) => wanted.min(limit.saturating_sub(RESERVED_FILES).max(1)),
        None => wanted,
    }
}

/// The body of the 503 a connection past the cap gets.
const BUSY: &str = r#"{"error":{"message":"the server has too many open connections; retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#;

/// Writes the 503 of a connection past the cap and closes it (within a second).
async fn refuse(mut stream: TcpStream) {
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{BUSY}",
        BUSY.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting, lets every
/// open connection finish its request (idle ones close at once) and returns when all are
/// closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let open = Arc::new(Semaphore::new(limits.max_open.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (EMFILE, ENFILE) or a connection reset before it was
                // taken: the pending ones wait in the backlog; try again shortly.
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics.connection_refused();
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        metrics.connections_open(limits.max_open - open.available_permits());
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        let (metrics, open, max) = (metrics.clone(), open.clone(), limits.max_open);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection closed: {e}");
            }
            drop(permit);
            metrics.connections_open(max - open.available_permits());
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_below_the_file_limit() {
        assert_eq!(connection_cap(1000, Some(256)), 256 - RESERVED_FILES);
        assert_eq!(connection_cap(100, Some(256)), 100);
        assert_eq!(connection_cap(100, Some(10)), 1);
        assert_eq!(connection_cap(100, None), 100);
        assert!(open_file_limit().is_some_and(|n| n > 0));
    }
}
