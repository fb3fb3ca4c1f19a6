//! The HTTP side: OpenAI's endpoints, health and metrics. Handlers check and tokenise a
//! request, hand it to the engine, and turn its events into a JSON response or server-sent
//! events; a handler that is dropped (client gone) drops its event receiver, which frees the
//! sequence in the engine.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kakeya_runtime::chat::format_chat;
use kakeya_runtime::{GenerationConfig, RunawayGuard};
use kakeya_weights::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::answer::{Pending, stream, whole};
use crate::api::{ChatRequest, CompletionRequest, Limits, Params, Prompt, check_fields};
use crate::connections::{ConnectionLimits, Tls};
use crate::engine::{Command, Event, Job};
use crate::error::ApiError;
use crate::keys::ApiKeys;
use crate::metrics::Metrics;

/// Settings of the HTTP side.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// Request limits.
    pub limits: Limits,
    /// Most requests waiting for a sequence slot; more get 429.
    pub max_queue: usize,
    /// Largest request body, in bytes; larger get 413.
    pub max_body_bytes: usize,
    /// Stop runaway repetition, as `kakeya infer` does by default.
    pub loop_guard: bool,
    /// Keys a request to `/v1/*` (and `/metrics`) must carry (none: open).
    pub api_keys: ApiKeys,
    /// Serve `/metrics` without a key.
    pub open_metrics: bool,
    /// Time a request's body gets to arrive once its head has; later gets 408.
    pub body_timeout: Duration,
    /// Time a streamed answer waits for a client that stopped reading before it ends the
    /// sequence and frees its caches.
    pub stall_timeout: Duration,
    /// Open connections and the time their request heads get.
    pub connections: ConnectionLimits,
    /// Serve over TLS with this certificate (none: plain HTTP).
    pub tls: Option<Tls>,
}

/// What every handler shares.
pub struct AppState {
    pub(crate) tok: Arc<Tokenizer>,
    pub(crate) cfg: HttpConfig,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) engine: Mutex<Sender<Command>>,
    pub(crate) waiting: Arc<AtomicUsize>,
    pub(crate) context: usize,
    /// Why chat requests are refused for this model (its template is not built in).
    pub(crate) chat_refusal: Option<String>,
    pub(crate) next_id: AtomicU64,
    pub(crate) created: u64,
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::keys::require_key,
        ))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint", None, "unknown_url")
}

async fn method_not_allowed() -> ApiError {
    ApiError::other(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "this endpoint does not take that HTTP method",
    )
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("/health", 200);
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("/metrics", 200);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.cfg.model_name, "object": "model", "created": st.created, "owned_by": "kakeya"})
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("/v1/models", 200);
    axum::Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id != st.cfg.model_name {
        st.metrics.request("/v1/models", 404);
        return unknown_model(&id).into_response();
    }
    st.metrics.request("/v1/models", 200);
    axum::Json(model_card(&st)).into_response()
}

fn unknown_model(name: &str) -> ApiError {
    ApiError::not_found(
        format!("the model `{name}` does not exist (this server serves one model: see /v1/models)"),
        Some("model"),
        "model_not_found",
    )
}

/// The parsed body: size limit, JSON, known fields, then the typed request.
async fn parse<T: serde::de::DeserializeOwned>(
    st: &AppState,
    body: Body,
    own_fields: &[&str],
) -> Result<T, ApiError> {
    let read = tokio::time::timeout(st.cfg.body_timeout, to_bytes(body, st.cfg.max_body_bytes));
    let bytes = read
        .await
        .map_err(|_| {
            ApiError::other(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {:?}",
                    st.cfg.body_timeout
                ),
            )
        })?
        .map_err(|_| {
            ApiError::other(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "the request body is over this server's limit of {} bytes",
                    st.cfg.max_body_bytes
                ),
            )
        })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    check_fields(&value, own_fields)?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("invalid request: {e}"), None))
}

/// Which endpoint, for responses and metrics.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }
}

/// A checked request ready for the engine.
pub(crate) struct Prepared {
    pub(crate) ids: Vec<u32>,
    pub(crate) params: Params,
    pub(crate) stop_tokens: Vec<u32>,
}

impl AppState {
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.cfg.model_name => Err(unknown_model(m)),
            _ => Ok(()),
        }
    }

    fn fresh_seed(&self) -> u64 {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// End-of-sequence and end-of-turn, unless the request ignores them.
    fn stop_tokens(&self, params: &Params) -> Vec<u32> {
        if params.ignore_eos {
            return Vec::new();
        }
        [Some(self.tok.eos), self.tok.end_of_turn]
            .into_iter()
            .flatten()
            .collect()
    }

    fn check_prompt(&self, ids: &[u32]) -> Result<(), ApiError> {
        let limit = self.cfg.limits.max_prompt_tokens.min(self.context - 1);
        if ids.len() > limit {
            let mut e = ApiError::invalid(
                format!(
                    "the prompt has {} tokens, over this server's limit of {limit}",
                    ids.len()
                ),
                Some("prompt"),
            );
            e.code = Some("context_length_exceeded");
            return Err(e);
        }
        Ok(())
    }

    fn prepare_completion(&self, req: &CompletionRequest) -> Result<Prepared, ApiError> {
        self.check_model(req.common.model.as_deref())?;
        req.check_unsupported()?;
        let params = req.common.params(
            req.common.max_tokens,
            self.cfg.limits.default_completion_tokens,
            &self.cfg.limits,
            self.fresh_seed(),
        )?;
        let encode = |text: &str| -> Result<Vec<u32>, ApiError> {
            if text.is_empty() {
                return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
            }
            let mut ids = vec![self.tok.bos];
            ids.extend(self.tok.encode(text).map_err(|e| {
                ApiError::invalid(format!("cannot tokenise the prompt: {e}"), Some("prompt"))
            })?);
            Ok(ids)
        };
        let ids = match &req.prompt {
            Prompt::Text(t) => encode(t)?,
            Prompt::Texts(v) if v.len() == 1 => encode(&v[0])?,
            Prompt::Texts(v) => {
                return Err(ApiError::invalid(
                    format!("one prompt per request is supported, got {}", v.len()),
                    Some("prompt"),
                ));
            }
            Prompt::Ids(ids) => {
                if ids.is_empty() {
                    return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
                }
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.tok.vocab_size()) {
                    return Err(ApiError::invalid(
                        format!(
                            "token id {bad} is outside the vocabulary of {}",
                            self.tok.vocab_size()
                        ),
                        Some("prompt"),
                    ));
                }
                ids.clone()
            }
        };
        self.check_prompt(&ids)?;
        Ok(Prepared {
            ids,
            stop_tokens: self.stop_tokens(&params),
            params,
        })
    }

    fn prepare_chat(&self, req: &ChatRequest) -> Result<Prepared, ApiError> {
        self.check_model(req.common.model.as_deref())?;
        req.check_unsupported()?;
        let params = req.common.params(
            req.common.max_tokens.or(req.max_completion_tokens),
            self.cfg.limits.max_tokens,
            &self.cfg.limits,
            self.fresh_seed(),
        )?;
        if let Some(why) = &self.chat_refusal {
            return Err(ApiError::invalid(why.clone(), Some("messages")));
        }
        let messages = req.messages()?;
        let text = format_chat(&messages)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        let mut ids = vec![self.tok.bos];
        ids.extend(self.tok.encode(&text).map_err(|e| {
            ApiError::invalid(
                format!("cannot tokenise the messages: {e}"),
                Some("messages"),
            )
        })?);
        self.check_prompt(&ids)?;
        Ok(Prepared {
            ids,
            stop_tokens: self.stop_tokens(&params),
            params,
        })
    }

    /// Queues `p`; the receiver of its events.
    fn submit(&self, p: &Prepared) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        if self.waiting.load(Ordering::SeqCst) >= self.cfg.max_queue {
            return Err(ApiError::other(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "the server is busy: {} requests are already waiting; retry later",
                    self.cfg.max_queue
                ),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            prompt: p.ids.clone(),
            cfg: GenerationConfig {
                max_tokens: p.params.max_tokens,
                sampling: p.params.sampling.clone(),
                stop_tokens: p.stop_tokens.clone(),
                prefill_chunk: 0,
                // A fixed-length request is not cut short by the guard either.
                loop_guard: (self.cfg.loop_guard && !p.params.ignore_eos)
                    .then(RunawayGuard::default),
            },
            events: tx,
            arrived: Instant::now(),
        };
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let sent = self
            .engine
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send(Command::Job(job));
        if sent.is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::other(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the engine is not running",
            ));
        }
        Ok(rx)
    }
}

/// The engine dropped a sequence without ending it (it stopped).
pub(crate) fn engine_gone() -> ApiError {
    ApiError::other(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine stopped before the answer was complete",
    )
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    handle(st, body, Kind::Completion).await
}

async fn chat(State(st): State<Arc<AppState>>, body: Body) -> Response {
    handle(st, body, Kind::Chat).await
}

async fn handle(st: Arc<AppState>, body: Body, kind: Kind) -> Response {
    let prepared = match kind {
        Kind::Completion => parse::<CompletionRequest>(&st, body, CompletionRequest::FIELDS)
            .await
            .and_then(|r| st.prepare_completion(&r)),
        Kind::Chat => parse::<ChatRequest>(&st, body, ChatRequest::FIELDS)
            .await
            .and_then(|r| st.prepare_chat(&r)),
    };
    let result = prepared.and_then(|p| st.submit(&p).map(|rx| (p, rx)));
    let (p, rx) = match result {
        Ok(x) => x,
        Err(e) => {
            st.metrics.request(kind.path(), e.status.as_u16());
            return e.into_response();
        }
    };
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        st.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let streamed = p.params.stream;
    if streamed {
        st.metrics.request(kind.path(), 200);
    }
    let pending = Pending {
        st,
        p,
        rx,
        kind,
        id,
    };
    if streamed {
        stream(pending)
    } else {
        whole(pending).await
    }
}
