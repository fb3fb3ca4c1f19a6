//! Gemma's chat template, and a multi-turn chat over one session whose caches carry across
//! turns.
//!
//! ```text
//! <bos><start_of_turn>user
//! {system}\n\n{user}<end_of_turn>
//! <start_of_turn>model
//! {reply}<end_of_turn>
//! ...
//! <start_of_turn>model
//! ```
//! As Gemma's own template (the `chat_template` of its `tokenizer_config.json`) does: a first
//! system message is folded into the first user turn (a later one, in a model turn's place, is
//! written as a `system` turn); turns must alternate user / model starting with user
//! (`assistant` is written `model`); every message's content is trimmed of surrounding
//! whitespace, the folded system text is kept as given. Our own rule on top: the conversation
//! must end with a user turn, which the model answers.
//! `tests/fixtures/chat/make_chat.py` renders conversations with Gemma's template for the tests.

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};
use crate::generate::{Generation, GenerationConfig, StopReason, generate};
use crate::guard::RunawayGuard;
use crate::session::Session;

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
    /// Two user or two model turns in a row, or a conversation opening with the model.
    #[error(
        "message {index} has role `{role}`, but turns must alternate user / model starting with user"
    )]
    Order {
        /// 0-based index of the message in the list.
        index: usize,
        /// Its role.
        role: String,
    },
    /// The last message is the model's: there is nothing to answer.
    #[error("the conversation ends with a model turn; it must end with a user message to answer")]
    EndsWithModel,
    /// The model's chat template is not the one built in (Gemma 3's).
    #[error(
        "the chat template built into Kakeya is Gemma 3's; a Gemma 4 model's turns follow its \
         tokenizer's own template, which is not built in (and could not be checked here): send \
         the prompt already formatted, as a completion (`--prompt`, `/v1/completions`)"
    )]
    OtherTemplate,
}

/// Whether [`format_chat`]'s turns are `config`'s model's own: Gemma 3's, not Gemma 4's.
pub fn check_template(config: &kakeya_weights::GemmaConfig) -> std::result::Result<(), ChatError> {
    if config.gemma4.is_some() {
        return Err(ChatError::OtherTemplate);
    }
    Ok(())
}

/// The text of one turn, opened and closed (without `<bos>`); `content` is trimmed.
pub fn turn(role: &str, content: &str) -> String {
    format!("<start_of_turn>{role}\n{}<end_of_turn>\n", content.trim())
}

/// The text that makes the model start its reply.
pub const MODEL_PROMPT: &str = "<start_of_turn>model\n";

/// What closes the model's turn in the context after its reply.
pub const END_OF_TURN: &str = "<end_of_turn>\n";

/// Formats a conversation (without `<bos>`), ending with the model's turn opened.
pub fn format_chat(messages: &[Message]) -> Result<String, ChatError> {
    let (system, rest) = match messages.first() {
        Some(m) if m.role == "system" => (Some(m.content.as_str()), &messages[1..]),
        _ => (None, messages),
    };
    let offset = usize::from(system.is_some());
    let mut out = String::new();
    for (i, m) in rest.iter().enumerate() {
        let role = match m.role.as_str() {
            "user" => "user",
            "assistant" | "model" => "model",
            // Gemma's template writes a later system message as a turn of its own.
            "system" => "system",
            other => return Err(ChatError::Role(other.to_string())),
        };
        if (role == "user") != (i % 2 == 0) {
            return Err(ChatError::Order {
                index: i + offset,
                role: m.role.clone(),
            });
        }
        match system.filter(|_| i == 0) {
            // Gemma's template keeps the system text as given and trims only the user's.
            Some(s) => out.push_str(&format!(
                "<start_of_turn>user\n{s}\n\n{}<end_of_turn>\n",
                m.content.trim()
            )),
            None => out.push_str(&turn(role, &m.content)),
        }
    }
    match rest.len() {
        0 => return Err(ChatError::Empty),
        n if n % 2 == 0 => return Err(ChatError::EndsWithModel),
        _ => {}
    }
    out.push_str(MODEL_PROMPT);
    Ok(out)
}

/// A multi-turn chat over one [`Session`]: each turn prefills only the new user turn (the
/// caches carry every earlier turn), generates the reply, and closes the model's turn in the
/// context. [`ChatSession::transcript`] is exactly what the caches hold, so a fresh session
/// prefilled with it continues identically.
#[derive(Debug)]
pub struct ChatSession<'m> {
    session: Session<'m>,
    transcript: Vec<u32>,
}

impl<'m> ChatSession<'m> {
    /// An empty chat. Sliding-window rings keep enough slack to roll back what the loop guard
    /// `guard` can trim from a reply.
    pub fn new(model: &'m kakeya_models::GemmaModel, guard: &RunawayGuard) -> Self {
        Self {
            session: Session::new(model, guard.max_unit * guard.min_repeats + 1),
            transcript: Vec::new(),
        }
    }

    /// Every token the caches hold, in order (`<bos>`, turns, replies, turn ends).
    pub fn transcript(&self) -> &[u32] {
        &self.transcript
    }

    /// The session (read-only: for inspection and tests).
    pub fn session(&self) -> &Session<'m> {
        &self.session
    }

    /// The token ids that open the next turn for `user` (with `<bos>` on the first turn).
    pub fn turn_ids(&self, tok: &kakeya_weights::Tokenizer, user: &str) -> Result<Vec<u32>> {
        let mut ids = if self.transcript.is_empty() {
            vec![tok.bos]
        } else {
            Vec::new()
        };
        ids.extend(tok.encode(&format!("{}{MODEL_PROMPT}", turn("user", user)))?);
        Ok(ids)
    }

    /// Answers `user`: prefills its turn, generates under `cfg` (streaming through
    /// `on_token`), then closes the model's turn in the caches. A reply the loop guard trimmed
    /// has its cut repeats rolled out of the caches first.
    pub fn reply(
        &mut self,
        tok: &kakeya_weights::Tokenizer,
        user: &str,
        cfg: &GenerationConfig,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation> {
        let ids = self.turn_ids(tok, user)?;
        let base = self.session.len() + ids.len();
        let g = generate(&mut self.session, &ids, cfg, on_token)?;
        self.transcript.extend(&ids);
        // The session has run every kept token but the last (a reply cut by a stop token has
        // run them all, and the stop token is not kept). After a runaway trim it has also run
        // cut repeats: forget them.
        let ran = match g.stop_reason {
            StopReason::StopToken => g.tokens.len(),
            _ => g.tokens.len() - 1,
        };
        if self.session.len() > base + ran {
            self.session.truncate(base + ran)?;
        }
        self.transcript.extend(&g.tokens[..ran]);
        let mut close = g.tokens[ran..].to_vec();
        close.extend(tok.encode(END_OF_TURN)?);
        let ctx = self.session.model().config.max_position_embeddings;
        if self.session.len() + close.len() > ctx {
            return Err(RuntimeError::Input(format!(
                "the conversation has filled the model's context of {ctx} tokens; start a new chat"
            )));
        }
        self.session.run(&close, close.len())?;
        self.transcript.extend(&close);
        Ok(g)
    }
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
    fn bad_roles_order_and_empty() {
        assert_eq!(
            format_chat(&[m("robot", "x")]),
            Err(ChatError::Role("robot".into()))
        );
        assert_eq!(format_chat(&[]), Err(ChatError::Empty));
        assert_eq!(format_chat(&[m("system", "s")]), Err(ChatError::Empty));
        assert_eq!(
            format_chat(&[m("user", "a"), m("user", "b"), m("system", "s")]),
            Err(ChatError::Order {
                index: 1,
                role: "user".into()
            })
        );
        assert_eq!(
            format_chat(&[m("user", "a"), m("user", "b")]),
            Err(ChatError::Order {
                index: 1,
                role: "user".into()
            })
        );
        assert_eq!(
            format_chat(&[m("system", "s"), m("assistant", "a"), m("user", "b")]),
            Err(ChatError::Order {
                index: 1,
                role: "assistant".into()
            })
        );
        assert_eq!(
            format_chat(&[m("user", "a"), m("model", "b")]),
            Err(ChatError::EndsWithModel)
        );
    }

    #[test]
    fn contents_are_trimmed_but_the_system_text_is_kept() {
        assert_eq!(
            format_chat(&[m("system", " S "), m("user", "  hi \n")]).unwrap(),
            "<start_of_turn>user\n S \n\nhi<end_of_turn>\n<start_of_turn>model\n"
        );
    }
}
