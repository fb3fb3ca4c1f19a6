//! The connections of `kakeya serve`: an accept loop that caps how many are open (below the
//! process's open-file limit), answers one past the cap with a fast 503 in OpenAI's error
//! shape, keeps accepting when the process runs out of descriptors, and closes a connection
//! whose request head does not arrive in time — a half-sent request, or a keep-alive
//! connection left idle; optionally over TLS (rustls). [llama-server's `--timeout` and
//! `--ssl-cert-file`; nginx's `client_header_timeout`]

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

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

/// TLS for `kakeya serve`: the server's certificate chain and private key.
#[derive(Clone)]
pub struct Tls(TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

impl Tls {
    /// TLS 1.2 and 1.3 with the certificate chain in PEM file `cert` and the private key in
    /// PEM file `key`; an error names the file and what is wrong with it.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(Iterator::collect)
            .map_err(|e| format!("{}: not a PEM certificate chain ({e})", cert.display()))?;
        if certs.is_empty() {
            return Err(format!("{}: no certificate in it", cert.display()));
        }
        let private = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("{}: not a PEM private key ({e})", key.display()))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, private)
            .map_err(|e| {
                format!(
                    "{} and {}: the key does not serve the certificate ({e})",
                    cert.display(),
                    key.display()
                )
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self(TlsAcceptor::from(Arc::new(config))))
    }
}

/// Serves one accepted connection's HTTP/1.1 over `io` until it closes (or shutdown closes
/// it).
async fn run_connection<I>(io: I, builder: http1::Builder, app: Router, watcher: Watcher)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(app);
    let conn = watcher.watch(builder.serve_connection(TokioIo::new(io), service));
    if let Err(e) = conn.await {
        tracing::debug!("connection closed: {e}");
    }
}

/// Serves `app` on `listener` (over TLS when `tls` is given) until `shutdown` completes; then
/// stops accepting, lets every open connection finish its request (idle ones close at once)
/// and returns when all are closed.
pub async fn serve(
    listener: TcpListener,
    (app, tls): (Router, Option<Tls>),
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
        let (app, builder, watcher) = (app.clone(), builder.clone(), graceful.watcher());
        let (metrics, open, tls) = (metrics.clone(), open.clone(), tls.clone());
        tokio::spawn(async move {
            match tls {
                None => run_connection(stream, builder, app, watcher).await,
                Some(Tls(acceptor)) => {
                    // The handshake gets the time a request head does.
                    let shake =
                        tokio::time::timeout(limits.header_timeout, acceptor.accept(stream));
                    match shake.await {
                        Ok(Ok(tls_stream)) => {
                            run_connection(tls_stream, builder, app, watcher).await
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
            drop(permit);
            metrics.connections_open(limits.max_open - open.available_permits());
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
