//! Generated ids to the text a client sees: decoded as they arrive ([`TextStream`]), cut at
//! the first stop string (which is not included), and streamed without ever sending text
//! that a stop string could still swallow.

use kakeya_runtime::TextStream;
use kakeya_weights::Tokenizer;

/// The text of one completion, piece by piece.
#[derive(Debug)]
pub struct TextOut<'t> {
    stream: TextStream<'t>,
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` handed out.
    sent: usize,
    /// A stop string was found (the text ends before it).
    pub stopped: bool,
}

impl<'t> TextOut<'t> {
    /// An empty completion over `tok` ending at the first of `stops`.
    pub fn new(tok: &'t Tokenizer, stops: Vec<String>) -> Self {
        Self {
            stream: TextStream::new(tok),
            stops,
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Adds generated ids; returns the text that became safe to send (possibly empty).
    /// After a stop string, nothing more.
    pub fn push(&mut self, ids: &[u32]) -> String {
        if self.stopped {
            return String::new();
        }
        for &id in ids {
            match self.stream.push(id) {
                Ok(Some(piece)) => self.text.push_str(&piece),
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot decode generated tokens: {e}"),
            }
        }
        self.settle(false)
    }

    /// The rest of the text, once generation ended.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        match self.stream.finish() {
            Ok(Some(piece)) => self.text.push_str(&piece),
            Ok(None) => {}
            Err(e) => tracing::warn!("cannot decode generated tokens: {e}"),
        }
        self.settle(true)
    }

    /// Everything handed out so far.
    pub fn sent_text(&self) -> &str {
        &self.text[..self.sent]
    }

    fn settle(&mut self, last: bool) -> String {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string can only newly appear in what was not yet sent plus a tail of what was.
        let mut from = self.sent.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match hit {
            Some(i) => {
                let i = i.max(self.sent);
                self.stopped = true;
                self.text.truncate(i);
                i
            }
            None if last => self.text.len(),
            None => {
                // Hold back the longest tail that begins some stop string.
                let mut keep = self.text.len();
                for s in &self.stops {
                    for k in (1..s.len()).rev() {
                        if self.text.len() >= k
                            && s.is_char_boundary(k)
                            && self.text.is_char_boundary(self.text.len() - k)
                            && self.text.ends_with(&s[..k])
                        {
                            keep = keep.min(self.text.len() - k);
                            break;
                        }
                    }
                }
                keep.max(self.sent)
            }
        };
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kakeya_models::testing::{Scratch, word_level_tokenizer_json};

    /// A 20-word tokenizer loaded from its own folder: tests run in parallel threads of one
    /// process, so each needs its own file (a shared one was read while another test rewrote it).
    fn tok(test: &str) -> Tokenizer {
        let dir = Scratch::new(&format!("text-{test}"));
        let p = dir.0.join("tokenizer.json");
        std::fs::write(&p, word_level_tokenizer_json(20)).unwrap();
        Tokenizer::load(&p, 20).unwrap()
    }

    /// Feeds `ids` one at a time; returns the pieces and the final text.
    fn run(tok: &Tokenizer, stops: &[&str], ids: &[u32]) -> (Vec<String>, String, bool) {
        let mut out = TextOut::new(tok, stops.iter().map(|s| s.to_string()).collect());
        let mut pieces: Vec<String> = ids.iter().map(|&i| out.push(&[i])).collect();
        pieces.push(out.finish());
        let all: String = pieces.concat();
        assert_eq!(all, out.sent_text());
        (pieces, all, out.stopped)
    }

    #[test]
    fn pieces_add_up_to_the_whole_text_without_stops() {
        let t = tok("pieces");
        let ids = [5, 6, 7, 8];
        let (_, all, stopped) = run(&t, &[], &ids);
        assert_eq!(all, t.decode(&ids).unwrap());
        assert!(!stopped);
    }

    #[test]
    fn cuts_before_the_first_stop_string_and_never_sends_part_of_it() {
        let t = tok("stops");
        let ids = [5, 6, 7, 8, 9];
        let whole = t.decode(&ids).unwrap();
        assert_eq!(whole, "w5 w6 w7 w8 w9");
        let (pieces, all, stopped) = run(&t, &["w7 w8"], &ids);
        assert!(stopped);
        assert_eq!(all, "w5 w6 ");
        // While "w7" could still begin the stop string it was held back.
        assert!(pieces.iter().all(|p| !p.contains("w7")), "{pieces:?}");
        // The earliest of several stops wins; a stop that never appears changes nothing.
        assert_eq!(run(&t, &["w9", "w6"], &ids).1, "w5 ");
        let (_, all, stopped) = run(&t, &["w12"], &ids);
        assert_eq!((all.as_str(), stopped), (whole.as_str(), false));
    }
}
