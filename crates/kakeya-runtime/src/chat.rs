//! Gemma's chat template.
//!
//! ```text
//! <bos><start_of_turn>user
//! {system}\n\n{user}<end_of_turn>
//! <start_of_turn>model
//! {reply}<end_of_turn>
//! ...
//! <start_of_turn>model
//! ```
//! A system message is folded into the first user turn, as Gemma's template does; the role
//! `assistant` is written `model`.

use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `model`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Errors of chat formatting.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ChatError {
    /// A role the template does not know.
    #[error("unknown chat role `{0}` (use system, user, assistant or model)")]
    Role(String),
    /// No messages, or nothing for the model to answer.
    #[error("the conversation has no user message")]
    Empty,
}

/// The text of one turn, opened and closed (without `<bos>`).
pub fn turn(role: &str, content: &str) -> String {
    format!("<start_of_turn>{role}\n{content}<end_of_turn>\n")
}

/// The text that makes the model start its reply.
pub const MODEL_PROMPT: &str = "<start_of_turn>model\n";

/// Formats a conversation (without `<bos>`), ending with the model's turn opened.
pub fn format_chat(messages: &[Message]) -> Result<String, ChatError> {
    let mut system: Option<&str> = None;
    let mut out = String::new();
    let mut users = 0;
    for m in messages {
        match m.role.as_str() {
            "system" => system = Some(&m.content),
            "user" => {
                let content = match system.take() {
                    Some(s) => format!("{s}\n\n{}", m.content),
                    None => m.content.clone(),
                };
                out.push_str(&turn("user", &content));
                users += 1;
            }
            "assistant" | "model" => out.push_str(&turn("model", &m.content)),
            other => return Err(ChatError::Role(other.to_string())),
        }
    }
    if users == 0 {
        return Err(ChatError::Empty);
    }
    out.push_str(MODEL_PROMPT);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn multi_turn_with_system() {
        let text = format_chat(&[
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "Hello!"),
            m("user", "2+2?"),
        ])
        .unwrap();
        assert_eq!(
            text,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn bad_roles_and_empty() {
        assert_eq!(
            format_chat(&[m("robot", "x")]),
            Err(ChatError::Role("robot".into()))
        );
        assert_eq!(format_chat(&[]), Err(ChatError::Empty));
    }
}
