//! Text streaming: turns generated token ids into text pieces as they arrive, so that the
//! pieces add up to decoding all the ids at once.
//!
//! Decoding is not token by token: a run of byte-fallback tokens decodes as one byte string
//! (a character split over several tokens; one invalid byte turns the whole run into U+FFFD),
//! and special tokens are skipped inside such a run. So a trailing run of such tokens is held
//! back until an ordinary token closes it (or [`TextStream::finish`]).

use kakeya_weights::Tokenizer;

use crate::error::Result;

/// Decodes a growing list of ids into text pieces whose concatenation, once
/// [`TextStream::finish`] has run, equals decoding all the ids at once.
#[derive(Debug)]
pub struct TextStream<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    /// Bytes of the decoded text already handed out.
    emitted: usize,
}

impl<'t> TextStream<'t> {
    /// An empty stream over `tok`.
    pub fn new(tok: &'t Tokenizer) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// Adds `id`; returns the text that became final, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        if self.tok.joins_neighbours(id) {
            return Ok(None);
        }
        self.settle()
    }

    /// Everything not yet handed out (a trailing incomplete character as U+FFFD, which is what
    /// decoding all the ids gives).
    pub fn finish(&mut self) -> Result<Option<String>> {
        self.settle()
    }

    fn settle(&mut self) -> Result<Option<String>> {
        let text = self.tok.decode(&self.ids)?;
        if text.len() > self.emitted && text.is_char_boundary(self.emitted) {
            let piece = text[self.emitted..].to_string();
            self.emitted = text.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }
}
