//! KV policies: what each layer keeps exactly and what happens to the positions it evicts.
//!
//! Every bounded mode keeps, per layer, `sink` first positions and the `window` most recent ones
//! exactly. Query `q` reads key `k` exactly when `k < sink`, `q − k < window`, or `k` is in the
//! same forward as `q` (a prefill chunk or a verified block); otherwise it reads the evicted
//! tier — nothing (dropped), the quantised copy, or the restored K/V. With blocks no longer than
//! the window, speculative decoding therefore reads exactly what plain decoding reads.

use std::path::Path;
use std::str::FromStr;

use kakeya_models::CacheSpec;
use serde::{Deserialize, Serialize};

use super::rows::Bits;
use crate::error::{Result, RuntimeError};

/// The KV modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvMode {
    /// The model's native caches (the oracle).
    Full,
    /// Sink + window exact, evicted positions dropped (StreamingLLM).
    SinkWindow,
    /// Global layers keep every position exactly; sliding layers sink + window, evicted dropped.
    ExactGlobal,
    /// Sink + window exact; evicted K/V of every layer rebuilt by f_θ from the compact store.
    Restored,
    /// Global layers exact; sliding layers' evicted K/V rebuilt by f_θ (the seed's "S5").
    RestoredSliding,
    /// Sink + window exact; evicted positions kept 8-bit (affine, group 64).
    Quant8,
    /// Sink + window exact; evicted positions kept 4-bit (affine, group 64).
    Quant4,
    /// Every position 8-bit, as llama.cpp's `--cache-type-k q8_0` / mlx-lm's `--kv-bits 8`.
    Quant8All,
    /// Every position 4-bit, as llama.cpp's `--cache-type-k q4_0` / mlx-lm's `--kv-bits 4`.
    Quant4All,
    /// `restored` with the compact store itself 8-bit.
    RestoredQ8,
    /// `restored` with the compact store itself 4-bit.
    RestoredQ4,
}

impl KvMode {
    /// Every mode, `full` first.
    pub const ALL: [KvMode; 11] = [
        KvMode::Full,
        KvMode::SinkWindow,
        KvMode::ExactGlobal,
        KvMode::Restored,
        KvMode::RestoredSliding,
        KvMode::Quant8,
        KvMode::Quant4,
        KvMode::Quant8All,
        KvMode::Quant4All,
        KvMode::RestoredQ8,
        KvMode::RestoredQ4,
    ];

    /// The mode's name (as on the command line).
    pub fn name(self) -> &'static str {
        match self {
            KvMode::Full => "full",
            KvMode::SinkWindow => "sink-window",
            KvMode::ExactGlobal => "exact-global",
            KvMode::Restored => "restored",
            KvMode::RestoredSliding => "restored-sliding",
            KvMode::Quant8 => "quant8",
            KvMode::Quant4 => "quant4",
            KvMode::Quant8All => "quant8-all",
            KvMode::Quant4All => "quant4-all",
            KvMode::RestoredQ8 => "restored-q8",
            KvMode::RestoredQ4 => "restored-q4",
        }
    }

    /// Whether evicted K/V are rebuilt by a restorer.
    pub fn restores(self) -> bool {
        matches!(
            self,
            KvMode::Restored | KvMode::RestoredSliding | KvMode::RestoredQ8 | KvMode::RestoredQ4
        )
    }

    /// Bits of the compact store (`None`: f32).
    pub fn store_bits(self) -> Option<Bits> {
        match self {
            KvMode::RestoredQ8 => Some(Bits::B8),
            KvMode::RestoredQ4 => Some(Bits::B4),
            _ => None,
        }
    }

    /// Whether any layer keeps a sink + window instead of its native cache.
    pub fn windowed(self) -> bool {
        !matches!(self, KvMode::Full | KvMode::Quant8All | KvMode::Quant4All)
    }
}

impl std::fmt::Display for KvMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvMode {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self> {
        KvMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                RuntimeError::Input(format!(
                    "unknown KV mode {s:?}; the modes are {}",
                    KvMode::ALL.map(KvMode::name).join(", ")
                ))
            })
    }
}

/// What happens to a position a bounded layer evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// Nothing is kept.
    Drop,
    /// Kept quantised.
    Quantise(Bits),
    /// Rebuilt by the restorer.
    Restore,
}

/// What one layer keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerPlan {
    /// The model's native cache (every position it needs, exactly).
    Native,
    /// Sink + window exact; evicted positions as given.
    Bounded(Evicted),
    /// Every position quantised.
    QuantAll(Bits),
}

/// A KV policy: the mode and the exact tier's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvPolicy {
    /// The mode.
    pub mode: KvMode,
    /// First positions kept exactly (attention sinks).
    #[serde(default = "default_sink")]
    pub sink: usize,
    /// Most recent positions kept exactly.
    #[serde(default = "default_window")]
    pub window: usize,
}

fn default_sink() -> usize {
    4
}

fn default_window() -> usize {
    64
}

impl Default for KvPolicy {
    fn default() -> Self {
        Self::new(KvMode::Full)
    }
}

impl KvPolicy {
    /// `mode` with the default sink (4) and window (64).
    pub fn new(mode: KvMode) -> Self {
        Self {
            mode,
            sink: default_sink(),
            window: default_window(),
        }
    }

    /// Reads a policy file (TOML: `mode`, optional `sink`, `window`; nothing else).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))?;
        toml::from_str(&text)
            .map_err(|e| RuntimeError::Input(format!("{}: {}", path.display(), e.message())))
    }

    /// What a layer with `spec` keeps. A sliding layer whose own window fits in the kept
    /// recent window keeps its native ring under every windowed mode: it never reads a
    /// position the policy would evict (Gemma 4's small tiny-test windows; Gemma 3/4's 512 or
    /// 1024 against a 64-position policy window are bounded as before).
    pub fn plan(&self, spec: CacheSpec) -> LayerPlan {
        let global = spec == CacheSpec::Full;
        let bounded = |ev| match spec {
            CacheSpec::Sliding { window } if window <= self.window => LayerPlan::Native,
            _ => LayerPlan::Bounded(ev),
        };
        match self.mode {
            KvMode::Full => LayerPlan::Native,
            KvMode::SinkWindow => bounded(Evicted::Drop),
            KvMode::ExactGlobal if global => LayerPlan::Native,
            KvMode::ExactGlobal => bounded(Evicted::Drop),
            KvMode::RestoredSliding if global => LayerPlan::Native,
            KvMode::Restored
            | KvMode::RestoredSliding
            | KvMode::RestoredQ8
            | KvMode::RestoredQ4 => bounded(Evicted::Restore),
            KvMode::Quant8 => bounded(Evicted::Quantise(Bits::B8)),
            KvMode::Quant4 => bounded(Evicted::Quantise(Bits::B4)),
            KvMode::Quant8All => LayerPlan::QuantAll(Bits::B8),
            KvMode::Quant4All => LayerPlan::QuantAll(Bits::B4),
        }
    }

    /// Checks the policy against the model's context and the speculative block size
    /// (`block` 1 for plain decoding).
    pub fn check(&self, context: usize, block: usize) -> Result<()> {
        if !self.mode.windowed() {
            return Ok(());
        }
        if self.window == 0 {
            return Err(RuntimeError::Input(format!(
                "KV mode {}: the window must keep at least 1 position",
                self.mode
            )));
        }
        if self.sink + self.window > context {
            return Err(RuntimeError::Input(format!(
                "KV mode {}: sink {} + window {} is larger than the model's context of {context}",
                self.mode, self.sink, self.window
            )));
        }
        if block > self.window {
            return Err(RuntimeError::Input(format!(
                "KV mode {}: block size {block} is larger than the exact window of {}: a verified block would read its own keys exactly where plain decoding reads evicted copies; use a block of at most {} or a larger window",
                self.mode, self.window, self.window
            )));
        }
        Ok(())
    }
}
