//! Errors: what a client gets back (an HTTP status and OpenAI's error object) and what
//! starting the server can fail with.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Errors of starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound or served.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The engine could not be started or failed.
    #[error("{0}")]
    Engine(String),
    /// A runtime error (model, caches).
    #[error(transparent)]
    Runtime(#[from] kakeya_runtime::RuntimeError),
}

/// A request the server refuses or could not complete, answered as OpenAI does:
/// `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `not_found_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code, when there is one.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or asks for something out of range.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 404: an unknown model or route.
    pub fn not_found(message: impl Into<String>, param: Option<&str>, code: &'static str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: param.map(str::to_string),
            code: Some(code),
        }
    }

    /// Another 4xx/5xx with its own type.
    pub fn other(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
