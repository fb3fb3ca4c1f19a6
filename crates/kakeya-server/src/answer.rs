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

/// A request's engine events read as text, through its stop strings: each answer form (JSON,
/// SSE) reads them the same way.
struct Reader<'t> {
    rx: mpsc::UnboundedReceiver<Event>,
    out: TextOut<'t>,
    generated: usize,
    outcome: Option<Box<Outcome>>,
}

impl<'t> Reader<'t> {
    fn new(rx: mpsc::UnboundedReceiver<Event>, out: TextOut<'t>) -> Self {
        Self {
            rx,
            out,
            generated: 0,
            outcome: None,
        }
    }

    /// The text the next tokens add (possibly empty); `None` once the sequence ended or a stop
    /// string cut it; an error when it failed or the engine went away first.
    async fn read(&mut self) -> Option<Result<String, ApiError>> {
        if self.out.stopped || self.outcome.is_some() {
            return None;
        }
        match self.rx.recv().await {
            Some(Event::Tokens(ids)) => {
                self.generated += ids.len();
                Some(Ok(self.out.push(&ids)))
            }
            Some(Event::Done(o)) => {
                self.outcome = Some(o);
                None
            }
            Some(Event::Failed(status, msg)) => Some(Err(ApiError::other(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                "server_error",
                msg,
            ))),
            None => Some(Err(engine_gone())),
        }
    }

    /// Ends the reading (dropping the receiver ends the sequence, if it still runs): the text
    /// still held back, the outcome, the tokens generated, and whether a stop string cut it.
    fn finish(mut self) -> (String, Option<Box<Outcome>>, usize, bool) {
        drop(self.rx);
        (
            self.out.finish(),
            self.outcome,
            self.generated,
            self.out.stopped,
        )
    }
}

/// A non-streamed answer: waits for the whole completion.
pub(crate) async fn whole(pending: Pending) -> Response {
    let (st, p, rx, kind, id) = pending.into_parts();
    let mut reader = Reader::new(rx, TextOut::new(&st.tok, p.params.stop.clone()));
    let mut text = String::new();
    while let Some(read) = reader.read().await {
        match read {
            Ok(piece) => text.push_str(&piece),
            Err(e) => {
                st.metrics.request(kind.path(), e.status.as_u16());
                return e.into_response();
            }
        }
    }
    let (rest, outcome, generated, stopped) = reader.finish();
    text.push_str(&rest);
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

/// Hands `event` to a streamed answer's body: false when the client is gone, or has read
/// nothing for `stall` while the body's buffer stayed full (the answer then ends, and dropping
/// its reader frees the sequence).
async fn offer(tx: &mpsc::Sender<SseEvent>, event: SseEvent, stall: std::time::Duration) -> bool {
    matches!(
        tokio::time::timeout(stall, tx.send(event)).await,
        Ok(Ok(()))
    )
}

/// A streamed answer: OpenAI's chunks as server-sent events, then `data: [DONE]`.
pub(crate) fn stream(pending: Pending) -> Response {
    let (st, p, rx, kind, id) = pending.into_parts();
    let (tx, events) = mpsc::channel::<SseEvent>(64);
    let created = unix_now();
    let stall = st.cfg.stall_timeout;
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
            if !offer(&tx, chunk(first, None), stall).await {
                return;
            }
        }
        let mut reader = Reader::new(rx, TextOut::new(&st.tok, p.params.stop.clone()));
        while let Some(read) = reader.read().await {
            match read {
                Ok(text) => {
                    if !text.is_empty() && !offer(&tx, chunk(piece(&text), None), stall).await {
                        return; // client gone: dropping the reader frees the sequence
                    }
                }
                Err(e) => {
                    let _ = offer(&tx, SseEvent::default().data(e.body().to_string()), stall).await;
                    let _ = offer(&tx, SseEvent::default().data("[DONE]"), stall).await;
                    return;
                }
            }
        }
        let (rest, outcome, generated, stopped) = reader.finish();
        if !rest.is_empty() && !offer(&tx, chunk(piece(&rest), None), stall).await {
            return;
        }
        let reason = finish_reason(outcome.as_deref(), stopped);
        let last = match kind {
            Kind::Completion => {
                json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": reason}])
            }
            Kind::Chat => {
                json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}])
            }
        };
        let ext = extension(outcome.as_deref(), stopped);
        let _ = offer(&tx, chunk(last, Some(("kakeya", ext))), stall).await;
        if p.params.include_usage {
            let u = usage(p.ids.len(), generated, outcome.as_deref());
            let _ = offer(&tx, chunk(json!([]), Some(("usage", u))), stall).await;
        }
        let _ = offer(&tx, SseEvent::default().data("[DONE]"), stall).await;
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
