//! Continuations taken from an earlier capture instead of generated again
//! (`generation.continuations`).
//!
//! Generating the verifier's greedy continuations is the costly part of a capture (one decode
//! step per token); the tensors of a sequence come from one chunked pass over its tokens. A
//! dataset that keeps only token ids is a few bytes per position — small enough to keep in
//! git — and a later job with the same prompts, verifier and generation settings rebuilds any
//! tensor columns from it: the capture pass sees exactly the tokens it would have generated, so
//! the result is the dataset a one-step capture writes, bit for bit.

use std::path::{Path, PathBuf};

use crate::config::CaptureConfig;
use crate::error::{CaptureError, Result};
use crate::reader::{Dataset, Query};
use crate::schema::ModelInfo;

/// An opened, checked dataset of earlier continuations.
#[derive(Debug, Clone)]
pub struct Continuations {
    ds: Dataset,
}

impl Continuations {
    /// Opens `dir` and checks that it holds continuations of the same prompts (`sources`),
    /// by the same verifier and tokenizer (SHA-256), with the same `gen_len` and
    /// `max_prompt_tokens` as `cfg`, every position of each sequence kept, and `sequences`
    /// prompts in all. Errors name the folder and what differs.
    pub fn open(
        dir: &Path,
        cfg: &CaptureConfig,
        verifier: &ModelInfo,
        tokenizer: &ModelInfo,
        sequences: usize,
    ) -> Result<Self> {
        let ds = Dataset::open(dir)?;
        let m = ds.manifest();
        let bad = |what: String| {
            Err(CaptureError::dataset(
                dir,
                format!("cannot supply this job's continuations: {what}"),
            ))
        };
        if m.verifier.sha256 != verifier.sha256 {
            return bad(format!(
                "captured with verifier {} (sha256 {}…), this job runs {} (sha256 {}…)",
                m.verifier.path.display(),
                short(&m.verifier.sha256),
                verifier.path.display(),
                short(&verifier.sha256)
            ));
        }
        if m.tokenizer.sha256 != tokenizer.sha256 {
            return bad("captured with another tokenizer".into());
        }
        if m.config.sources != cfg.sources {
            return bad("its [[sources]] differ from this job's".into());
        }
        let (a, b) = (&m.config.generation, &cfg.generation);
        if (a.gen_len, a.max_prompt_tokens) != (b.gen_len, b.max_prompt_tokens) {
            return bad(format!(
                "generated with gen_len {} and max_prompt_tokens {}, this job asks for {} and {}",
                a.gen_len, a.max_prompt_tokens, b.gen_len, b.max_prompt_tokens
            ));
        }
        if m.config.tensors.sample_positions.is_some() {
            return bad("it keeps sampled positions only, not whole sequences".into());
        }
        if m.sequences != sequences {
            return bad(format!(
                "it has {} prompts, this job {sequences}",
                m.sequences
            ));
        }
        Ok(Self { ds })
    }

    /// The dataset's folder.
    pub fn dir(&self) -> PathBuf {
        self.ds.dir().to_path_buf()
    }

    /// Sequences `seqs` (ascending, contiguous) as `(tokens, prompt length)`, in order; an
    /// error names the first one the dataset has not finished.
    pub fn get(&self, seqs: &[usize]) -> Result<Vec<(Vec<u32>, usize)>> {
        let (Some(&lo), Some(&hi)) = (seqs.first(), seqs.last()) else {
            return Ok(Vec::new());
        };
        let q = Query {
            sequences: Some(lo..hi + 1),
            positions: None,
            columns: Vec::new(),
        };
        let mut out = Vec::with_capacity(seqs.len());
        let mut got = self.ds.read(&q)?.peekable();
        for &s in seqs {
            let b = match got.next_if(|b| b.as_ref().map_or(true, |b| b.seq == s)) {
                Some(b) => b?,
                None => {
                    return Err(CaptureError::dataset(
                        self.ds.dir(),
                        format!(
                            "sequence {s} is not in its finished shards; finish that capture first (--resume)"
                        ),
                    ));
                }
            };
            if b.pos.iter().enumerate().any(|(i, &p)| p as usize != i) {
                return Err(CaptureError::dataset(
                    self.ds.dir(),
                    format!("sequence {s} does not hold every position in order"),
                ));
            }
            let prompt_len = b.in_prompt.iter().take_while(|&&x| x).count();
            out.push((b.token, prompt_len));
        }
        Ok(out)
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}
