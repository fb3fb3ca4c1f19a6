//! API keys: with any set, a request to `/v1/*` (and to `/metrics`, unless it is left open)
//! must carry one as `Authorization: Bearer KEY`, else it gets a 401 in OpenAI's error shape;
//! `/health` stays open. Keys are held as SHA-256 digests, compared in constant time, and
//! never logged. [llama-server's and vLLM's `--api-key`]

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::routes::AppState;

/// The keys a server accepts (none: every request is let in).
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// Accepts each of `keys`.
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Self {
        Self {
            digests: keys.into_iter().map(|k| digest(k.as_ref())).collect(),
        }
    }

    /// The keys of a key file's text: one per line, blank lines and `#` comments skipped.
    pub fn parse_file(text: &str) -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(String::from)
            .collect()
    }

    /// Whether no key is required.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Whether `presented` is one of the keys: its digest against every key's, each compared
    /// in full (no early exit on the first differing byte or the first match).
    pub fn accepts(&self, presented: &str) -> bool {
        let d = digest(presented);
        let mut any = 0u8;
        for k in &self.digests {
            let diff = k.iter().zip(&d).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            any |= u8::from(diff == 0);
        }
        any == 1
    }
}

/// Whether `path` needs a key on a server whose `/metrics` is `open_metrics`.
fn guarded(path: &str, open_metrics: bool) -> bool {
    path.starts_with("/v1/") || (path == "/metrics" && !open_metrics)
}

/// The middleware: lets a request through when it needs no key or carries a right one.
pub(crate) async fn require_key(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let keys = &st.cfg.api_keys;
    if keys.is_empty() || !guarded(req.uri().path(), st.cfg.open_metrics) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let message = match presented {
        Some(k) if keys.accepts(k.trim()) => return next.run(req).await,
        Some(_) => "incorrect API key provided",
        None => "this server needs an API key: send it as `Authorization: Bearer KEY`",
    };
    st.metrics.request("unauthorized", 401);
    let mut response = ApiError {
        code: Some("invalid_api_key"),
        ..ApiError::other(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
    }
    .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_matched_whole_and_listed_files_parsed() {
        let k = ApiKeys::new(["sk-one", "sk-two"]);
        assert!(k.accepts("sk-one") && k.accepts("sk-two"));
        assert!(!k.accepts("sk-on") && !k.accepts("sk-one ") && !k.accepts(""));
        assert!(ApiKeys::default().is_empty() && !k.is_empty());
        assert_eq!(format!("{k:?}"), "ApiKeys(2 keys)");
        let parsed = ApiKeys::parse_file("# team keys\nsk-a\n\n  sk-b  \n#sk-c\n");
        assert_eq!(parsed, vec!["sk-a", "sk-b"]);
        assert!(guarded("/v1/completions", true) && guarded("/metrics", false));
        assert!(!guarded("/metrics", true) && !guarded("/health", false));
    }
}
