//! Answers: a request's engine events turned into OpenAI's JSON response, or into server-sent
//! events in OpenAI's chunk format ending in `data: [DONE]`; `usage`, `finish_reason` and
//! Kakeya's own figures under `"kakeya"`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kakeya_runtime::StopReason;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Event, Outcome};
use crate::error::ApiError;
use crate::routes::{AppState, Kind, Prepared, engine_gone, unix_now};
use crate::text::TextOut;

fn finish_reason(outcome: Option<&Outcome>, stopped_by_string: bool) -> &'static str {
    if stopped_by_string {
        return "stop";
    }
    match outcome.map(|o| o.stop_reason) {
        Some(StopReason::MaxTokens | StopReason::ContextFull) => "length",
        _ => "stop",
    }
}

/// OpenAI's `usage`, with `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix
/// cache supplied.
fn usage(prompt: usize, completion: usize, outcome: Option<&Outcome>) -> Value {
    let cached = outcome.map_or(0, |o| o.cached_prompt_tokens);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn extension(outcome: Option<&Outcome>, stopped_by_string: bool) -> Value {
    let mut v = outcome.map_or(Value::Null, |o| {
        serde_json::to_value(o).unwrap_or(Value::Null)
    });
    if let Some(obj) = v.as_object_mut() {
        obj.insert("stop_string".into(), stopped_by_string.into());
    }
    v
}

/// A request handed to the engine, to be answered.
pub(crate) struct Pending {
    pub(crate) st: Arc<AppState>,
    pub(crate) p: Prepared,
    /// The engine's events for it.
    pub(crate) rx: mpsc::UnboundedReceiver<Event>,
    pub(crate) kind: Kind,
    /// The response id (`cmpl-…` or `chatcmpl-…`).
    pub(crate) id: String,
}

impl Pending {
    /// Its parts: the state, the request, the engine's events, the endpoint, the id.
    #[allow(clippy::type_complexity)]
    fn into_parts(
        self,
    ) -> (
        Arc<AppState>,
        Prepared,
        mpsc::UnboundedReceiver<Event>,
        Kind,
        String,
    ) {
        (self.st, self.p, self.rx, self.kind, self.id)
    }
}

/// A non-streamed answer: waits for the whole completion.
pub(crate) async fn whole(pending: Pending) -> Response {
    let (st, p, mut rx, kind, id) = pending.into_parts();
    let mut out = TextOut::new(&st.tok, p.params.stop.clone());
    let mut text = String::new();
    let mut generated = 0;
    let mut outcome = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Tokens(ids) => {
                generated += ids.len();
                text.push_str(&out.push(&ids));
                if out.stopped {
                    break; // dropping `rx` ends the sequence
                }
            }
            Event::Done(o) => {
                outcome = Some(o);
                break;
            }
            Event::Failed(status, msg) => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                st.metrics.request(kind.path(), status.as_u16());
                return ApiError::other(status, "server_error", msg).into_response();
            }
        }
    }
    drop(rx);
    if outcome.is_none() && !out.stopped {
        st.metrics.request(kind.path(), 500);
        return engine_gone().into_response();
    }
    text.push_str(&out.finish());
    let stopped = out.stopped;
    let reason = finish_reason(outcome.as_deref(), stopped);
    let choice = match kind {
        Kind::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
        }
        Kind::Chat => {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": reason})
        }
    };
    let object = if kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    st.metrics.request(kind.path(), 200);
    axum::Json(json!({
        "id": id,
        "object": object,
        "created": unix_now(),
        "model": st.cfg.model_name,
        "choices": [choice],
        "usage": usage(p.ids.len(), generated, outcome.as_deref()),
        "kakeya": extension(outcome.as_deref(), stopped),
    }))
    .into_response()
}

/// A streamed answer: OpenAI's chunks as server-sent events, then `data: [DONE]`.
pub(crate) fn stream(pending: Pending) -> Response {
    let (st, p, mut rx, kind, id) = pending.into_parts();
    let (tx, events) = mpsc::channel::<SseEvent>(64);
    let created = unix_now();
    tokio::spawn(async move {
        let object = if kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choices: Value, extra: Option<(&str, Value)>| {
            let mut v = json!({"id": id, "object": object, "created": created, "model": st.cfg.model_name, "choices": choices});
            if let Some((k, x)) = extra {
                v[k] = x;
            }
            SseEvent::default().data(v.to_string())
        };
        let piece = |text: &str| match kind {
            Kind::Completion => {
                json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": null}])
            }
            Kind::Chat => {
                json!([{"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null}])
            }
        };
        if kind == Kind::Chat {
            let first = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            if tx.send(chunk(first, None)).await.is_err() {
                return;
            }
        }
        let mut out = TextOut::new(&st.tok, p.params.stop.clone());
        let mut generated = 0;
        let mut outcome = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Tokens(ids) => {
                    generated += ids.len();
                    let text = out.push(&ids);
                    if !text.is_empty() && tx.send(chunk(piece(&text), None)).await.is_err() {
                        return; // client gone: dropping `rx` frees the sequence
                    }
                    if out.stopped {
                        break;
                    }
                }
                Event::Done(o) => {
                    outcome = Some(o);
                    break;
                }
                Event::Failed(status, msg) => {
                    let e = ApiError::other(
                        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                        "server_error",
                        msg,
                    );
                    let _ = tx
                        .send(SseEvent::default().data(e.body().to_string()))
                        .await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
            }
        }
        drop(rx);
        if outcome.is_none() && !out.stopped {
            let _ = tx
                .send(SseEvent::default().data(engine_gone().body().to_string()))
                .await;
            let _ = tx.send(SseEvent::default().data("[DONE]")).await;
            return;
        }
        let rest = out.finish();
        if !rest.is_empty() && tx.send(chunk(piece(&rest), None)).await.is_err() {
            return;
        }
        let reason = finish_reason(outcome.as_deref(), out.stopped);
        let last = match kind {
            Kind::Completion => {
                json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": reason}])
            }
            Kind::Chat => {
                json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}])
            }
        };
        let ext = extension(outcome.as_deref(), out.stopped);
        let _ = tx.send(chunk(last, Some(("kakeya", ext)))).await;
        if p.params.include_usage {
            let u = usage(p.ids.len(), generated, outcome.as_deref());
            let _ = tx.send(chunk(json!([]), Some(("usage", u)))).await;
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    let body = futures_util::stream::unfold(events, |mut events| async move {
        events
            .recv()
            .await
            .map(|e| (Ok::<_, Infallible>(e), events))
    });
    Sse::new(body)
        .keep_alive(KeepAlive::default())
        .into_response()
}
