//! The OpenAI request bodies Kakeya accepts, and their checks.
//!
//! Unknown fields are refused (400), as OpenAI refuses unrecognised arguments. Fields of the
//! API that Kakeya does not implement (`n` > 1, log-probabilities, penalties, logit bias,
//! tools, `echo`, `suffix`, `best_of` > 1) are accepted only at their neutral values, and
//! otherwise refused with a message naming them, never silently ignored.

use std::collections::BTreeMap;

use kakeya_runtime::Sampling;
use kakeya_runtime::chat::Message;
use serde::Deserialize;

use crate::error::ApiError;

/// `prompt`: a string, a list of one string, or a list of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch of texts (only one is served per request).
    Texts(Vec<String>),
}

/// `stop`: one string or a list of up to four.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// The served model's name (optional: the one model is used).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Sampling temperature in [0, 2]; 0 is greedy. OpenAI's default: 1.
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens (0 or -1: all). An extension, as vLLM and llama.cpp have.
    pub top_k: Option<i64>,
    /// RNG seed: the same seed gives the same tokens.
    pub seed: Option<i64>,
    /// Up to four strings that end the output (not included).
    pub stop: Option<Stop>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices per prompt: only 1.
    pub n: Option<i64>,
    /// The caller's end-user id (recorded nowhere).
    pub user: Option<String>,
    /// Only 0.
    pub presence_penalty: Option<f64>,
    /// Only 0.
    pub frequency_penalty: Option<f64>,
    /// Only empty.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Keep generating past end-of-sequence and end-of-turn tokens, and past the runaway-loop
    /// guard (an extension, as vLLM's and llama.cpp's: fixed-length outputs for load tests;
    /// stop strings still apply).
    pub ignore_eos: Option<bool>,
}

/// Fields of [`Common`].
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
];

/// Refuses a body that is not a JSON object or names a field outside `own` and the shared
/// ones (serde cannot refuse unknown fields next to a flattened struct).
pub fn check_fields(body: &serde_json::Value, own: &[&str]) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    };
    for key in obj.keys() {
        if !own.contains(&key.as_str()) && !COMMON_FIELDS.contains(&key.as_str()) {
            return Err(ApiError::invalid(
                format!("unrecognized request argument supplied: {key}"),
                Some(key),
            ));
        }
    }
    Ok(())
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Only null/false/0.
    pub logprobs: Option<serde_json::Value>,
    /// Only false.
    pub echo: Option<bool>,
    /// Only 1.
    pub best_of: Option<i64>,
    /// Only null.
    pub suffix: Option<String>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// One part of a message's content given as a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// Only `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// A message's content: a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts (text only).
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: Content,
    /// A participant name (ignored by Gemma's template).
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Only false.
    pub logprobs: Option<bool>,
    /// Only null.
    pub top_logprobs: Option<i64>,
    /// Only `{"type": "text"}`.
    pub response_format: Option<serde_json::Value>,
    /// Not supported (refused when non-empty).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Not supported (only `none`).
    pub tool_choice: Option<serde_json::Value>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// What the server's settings bound.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens: usize,
    /// `max_tokens` of a completion that names none (OpenAI's default is 16).
    pub default_completion_tokens: usize,
    /// Longest prompt, in tokens.
    pub max_prompt_tokens: usize,
}

/// A request's generation settings, checked.
#[derive(Debug, Clone)]
pub struct Params {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Do not stop on end-of-sequence tokens or by the loop guard.
    pub ignore_eos: bool,
}

fn unsupported(field: &str, what: &str) -> ApiError {
    ApiError::invalid(
        format!("`{field}` {what} is not supported by this server"),
        Some(field),
    )
}

impl Common {
    /// Checks the shared fields against `limits`; `max_tokens` is the request's (or `None`),
    /// `default_max` what applies without one; a missing seed draws `fresh_seed`.
    pub fn params(
        &self,
        max_tokens: Option<i64>,
        default_max: usize,
        limits: &Limits,
        fresh_seed: u64,
    ) -> Result<Params, ApiError> {
        let max_tokens = match max_tokens {
            None => default_max.min(limits.max_tokens),
            Some(n) if n < 1 => {
                return Err(ApiError::invalid(
                    format!("max_tokens must be at least 1, got {n}"),
                    Some("max_tokens"),
                ));
            }
            Some(n) if n as u64 > limits.max_tokens as u64 => {
                return Err(ApiError::invalid(
                    format!(
                        "max_tokens {n} is over this server's limit of {}",
                        limits.max_tokens
                    ),
                    Some("max_tokens"),
                ));
            }
            Some(n) => n as usize,
        };
        if let Some(n) = self.n
            && n != 1
        {
            return Err(unsupported("n", &format!("= {n} (only 1)")));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v
                && v != 0.0
            {
                return Err(unsupported(field, &format!("= {v} (only 0)")));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(unsupported("logit_bias", "(non-empty)"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature must be in [0, 2], got {temperature}"),
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                format!("top_p must be in (0, 1], got {top_p}"),
                Some("top_p"),
            ));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::invalid(
                    format!("top_k must be >= 0 (or -1 for all), got {k}"),
                    Some("top_k"),
                ));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ApiError::invalid(
                format!("stop takes at most 4 strings, got {}", stop.len()),
                Some("stop"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop strings must not be empty",
                Some("stop"),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options is only allowed with stream: true",
                Some("stream_options"),
            ));
        }
        let sampling = if temperature == 0.0 {
            Sampling::Greedy
        } else {
            Sampling::Sample {
                temperature: temperature as f32,
                top_k,
                top_p: top_p as f32,
                seed: self.seed.map_or(fresh_seed, |s| s as u64),
            }
        };
        Ok(Params {
            max_tokens,
            sampling,
            stop,
            stream,
            include_usage,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

impl CompletionRequest {
    /// Its own fields (besides the shared ones).
    pub const FIELDS: &[&str] = &["prompt", "logprobs", "echo", "best_of", "suffix"];

    /// Refuses the fields this server does not implement at non-neutral values.
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        match &self.logprobs {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
            Some(v) if v.as_i64() == Some(0) => {}
            Some(v) => return Err(unsupported("logprobs", &format!("= {v}"))),
        }
        if self.echo == Some(true) {
            return Err(unsupported("echo", "= true"));
        }
        if let Some(b) = self.best_of
            && b != 1
        {
            return Err(unsupported("best_of", &format!("= {b} (only 1)")));
        }
        if self.suffix.is_some() {
            return Err(unsupported("suffix", "(insertion)"));
        }
        Ok(())
    }
}

impl ChatRequest {
    /// Its own fields (besides the shared ones).
    pub const FIELDS: &[&str] = &[
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
    ];

    /// Refuses the fields this server does not implement at non-neutral values.
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.logprobs == Some(true) {
            return Err(unsupported("logprobs", "= true"));
        }
        if self.top_logprobs.is_some() {
            return Err(unsupported("top_logprobs", ""));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(unsupported("tools", "(function calling)"));
        }
        if let Some(c) = &self.tool_choice
            && c != "none"
        {
            return Err(unsupported("tool_choice", &format!("= {c}")));
        }
        if let Some(f) = &self.response_format
            && f.get("type").and_then(|t| t.as_str()) != Some("text")
        {
            return Err(unsupported(
                "response_format",
                &format!("= {f} (only {{\"type\": \"text\"}})"),
            ));
        }
        if self.common.max_tokens.is_some() && self.max_completion_tokens.is_some() {
            return Err(ApiError::invalid(
                "give max_tokens or max_completion_tokens, not both",
                Some("max_tokens"),
            ));
        }
        Ok(())
    }

    /// The conversation as the runtime's messages (`developer` is a system message; text
    /// parts are joined).
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages must hold at least one message",
                Some("messages"),
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let param = format!("messages[{i}]");
                let role = match m.role.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => {
                        return Err(ApiError::invalid(
                            format!(
                                "messages[{i}].role `{other}` is not one of system, developer, user, assistant"
                            ),
                            Some(&format!("{param}.role")),
                        ));
                    }
                };
                let content = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::Parts(parts) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::invalid(
                                        format!(
                                            "messages[{i}].content: only text parts are supported, got `{kind}`"
                                        ),
                                        Some(&format!("{param}.content")),
                                    ));
                                }
                            }
                        }
                        text
                    }
                };
                Ok(Message {
                    role: role.to_string(),
                    content,
                })
            })
            .collect()
    }
}
