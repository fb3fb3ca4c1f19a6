//! `kakeya serve`: an OpenAI-compatible HTTP server on Kakeya's engine.
//!
//! `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as server-sent events),
//! `GET /v1/models`, `GET /health`, `GET /metrics`. The HTTP side runs on tokio (axum) in its
//! own thread; generation runs in the [`engine`] loop on the caller's thread, which batches
//! the decode steps of concurrent requests and decodes a request that runs alone
//! speculatively. Outputs are those of plain decoding (`kakeya infer`) for the same prompt
//! and settings.

mod answer;
pub mod api;
pub mod connections;
pub mod engine;
pub mod error;
pub mod keys;
mod memory;

pub use memory::keep_large_buffers_apart;
pub mod metrics;
pub mod routes;
pub mod text;

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kakeya_weights::Tokenizer;

pub use api::Limits;
pub use connections::{ConnectionLimits, Tls};
pub use engine::{EngineParts, Outcome};
pub use error::{ApiError, ServerError};
pub use keys::ApiKeys;
pub use metrics::Metrics;
pub use routes::HttpConfig;

use engine::Command;

/// Waits for SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Serves `parts` on `listener` until SIGTERM or Ctrl-C: then new connections are refused,
/// requests in flight get up to `drain` to finish, and what still runs after that is ended
/// with a 503 error (a streamed one gets an error event and `data: [DONE]`). Runs the engine
/// on the calling thread (call it from a rayon worker) and the HTTP side on a thread of its
/// own.
pub fn serve(
    parts: EngineParts,
    tok: Tokenizer,
    cfg: HttpConfig,
    listener: TcpListener,
    drain: Duration,
) -> Result<(), ServerError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let metrics = Arc::new(Metrics::default());
    let waiting = Arc::new(AtomicUsize::new(0));
    let state = Arc::new(routes::AppState {
        tok: Arc::new(tok),
        cfg,
        metrics: metrics.clone(),
        engine: Mutex::new(tx.clone()),
        waiting: waiting.clone(),
        context: parts.model.config.max_position_embeddings,
        chat_refusal: kakeya_runtime::chat::check_template(&parts.model.config)
            .err()
            .map(|e| e.to_string()),
        next_id: AtomicU64::new(0),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    listener.set_nonblocking(true)?;
    let limits = state.cfg.connections;
    let tls = state.cfg.tls.clone();
    let metrics_http = metrics.clone();
    let http = std::thread::Builder::new()
        .name("kakeya-http".into())
        .spawn(move || -> Result<(), ServerError> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let engine = tx;
            let result = rt.block_on(async {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let abort = engine.clone();
                let shutdown = async move {
                    shutdown_signal().await;
                    tracing::info!("shutting down: requests in flight get {drain:?} to finish");
                    tokio::spawn(async move {
                        tokio::time::sleep(drain).await;
                        let _ = abort.send(Command::Abort);
                    });
                };
                let app = routes::router(state);
                connections::serve(listener, (app, tls), limits, metrics_http, shutdown).await;
                Ok::<(), std::io::Error>(())
            });
            let _ = engine.send(Command::Shutdown);
            result.map_err(ServerError::from)
        })?;
    engine::run(parts, rx, &metrics, &waiting);
    http.join()
        .map_err(|_| ServerError::Engine("the HTTP thread panicked".into()))?
}
