//! Loading a Hugging Face `tokenizer.json` and checking it fits the model.

use std::path::{Path, PathBuf};

use crate::error::{Result, WeightsError};

/// A tokenizer bound to a model's vocabulary size, with Gemma's special tokens resolved.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Beginning-of-sequence id (`<bos>`).
    pub bos: u32,
    /// End-of-sequence id (`<eos>`).
    pub eos: u32,
    /// End-of-turn id (`<end_of_turn>`), when the vocabulary has one.
    pub end_of_turn: Option<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `path` and checks that its base vocabulary has exactly `model_vocab` entries
    /// (the rows of the model's embedding).
    pub fn load(path: &Path, model_vocab: usize) -> Result<Self> {
        let err = |msg: String| WeightsError::Tokenizer {
            path: path.to_path_buf(),
            msg,
        };
        if !path.is_file() {
            return Err(WeightsError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer file not found"),
            ));
        }
        let mut inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| err(format!("cannot load tokenizer: {e}")))?;
        // `tokenizers` keeps each word's BPE merges in a cache per thread, up to 10 000 words
        // a thread. A server tokenizes on a pool of threads, so its memory grew with every
        // new word (≈ 3.7 KiB per request of `scripts/load_test.py`'s prompts, past 14 000
        // requests); and merging a word costs microseconds against a forward's milliseconds.
        // No cache, then.
        if let tokenizers::ModelWrapper::BPE(bpe) = inner.get_model() {
            let mut bpe = bpe.clone();
            bpe.resize_cache(0);
            inner.with_model(bpe);
        }
        let base = inner.get_vocab_size(false);
        if base != model_vocab {
            return Err(err(format!(
                "tokenizer vocabulary has {base} tokens but the model's embedding has {model_vocab} rows; \
                 this tokenizer does not belong to this model"
            )));
        }
        let id = |t: &str| inner.token_to_id(t);
        let bos = id("<bos>").ok_or_else(|| err("tokenizer has no <bos> token".into()))?;
        let eos = id("<eos>").ok_or_else(|| err("tokenizer has no <eos> token".into()))?;
        let end_of_turn = id("<end_of_turn>");
        Ok(Self {
            inner,
            path: path.to_path_buf(),
            bos,
            eos,
            end_of_turn,
            vocab_size: model_vocab,
        })
    }

    /// The model's vocabulary size (ids at or above it do not exist).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encodes text. Special-token strings in `text` (e.g. `<start_of_turn>`) become their ids;
    /// no `<bos>` is added (callers add it once at the start of a sequence).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| WeightsError::Tokenizer {
                path: self.path.clone(),
                msg: format!("encode failed: {e}"),
            })?;
        let ids = enc.get_ids().to_vec();
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(WeightsError::Tokenizer {
                path: self.path.clone(),
                msg: format!(
                    "token id {bad} is outside the model's vocabulary of {}",
                    self.vocab_size
                ),
            });
        }
        Ok(ids)
    }

    /// True for a token that decoding may merge with its neighbours or drop: a byte-fallback
    /// token (`<0xNN>`; a run of them decodes as one byte string, and one invalid byte turns
    /// the whole run into U+FFFD) or a special token (skipped when decoding).
    pub fn joins_neighbours(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| {
            let hex = t.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'));
            hex.is_some_and(|h| h.len() == 2 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                || self.inner.get_added_vocabulary().is_special_token(&t)
        })
    }

    /// Decodes ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| WeightsError::Tokenizer {
                path: self.path.clone(),
                msg: format!("decode failed: {e}"),
            })
    }
}
