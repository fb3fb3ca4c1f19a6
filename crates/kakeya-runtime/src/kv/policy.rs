//! KV policies: what each layer keeps exactly and what happens to the positions it evicts.
//!
//! Every bounded mode keeps, per layer, `sink` first positions and the `window` most recent ones
//! exactly. Query `q` reads key `k` exactly when `k < sink`, `q − k < window`, or `k` is in the
//! same forward as `q` (a prefill chunk or a verified block); otherwise it reads the evicted
//! tier — nothing (dropped), the quantised copy, or the restored K/V. With blocks no longer than
//! the window, speculative decoding therefore reads exactly what plain decoding reads.

use std::path::Path;

use kakeya_models::CacheSpec;
use serde::{Deserialize, Serialize};

use super::channels::CHANNEL_BLOCK;
use super::native::KvDtype;
use super::rows::Bits;
use super::store::{DraftReach, StoreFormat};
use crate::error::{Result, RuntimeError};

mod mode;

pub use mode::{BOUNDED_PRESETS, GLOBAL_WINDOW, KvMode, MIXED_PRESETS, RESIDUAL_PRESETS};

/// How a bounded layer quantises the positions it evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    /// Key bits.
    pub k_bits: Bits,
    /// Value bits.
    pub v_bits: Bits,
    /// Keys grouped per channel over blocks of 64 positions (else per token, groups of 64
    /// values, as values always are).
    pub k_per_channel: bool,
    /// What is grouped per token (values, and keys grouped per token) rotated before
    /// quantisation ([`super::rotation::Rotation`]).
    pub rotate: bool,
    /// How each group's range is chosen.
    pub ranges: Ranges,
    /// Keys per channel: `k_bits` on average, each block's bits shared among its channels by
    /// their ranges (else every channel `k_bits`).
    pub k_mixed: bool,
}

/// How a quantised group's range is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ranges {
    /// From the group's minimum to its maximum: every value within half a step.
    MinMax,
    /// Fitted for the least squared error (ends may be clipped: see [`super::rows`]).
    Fitted,
}

impl QuantFormat {
    /// Keys and values `bits`-bit per token, unrotated (the `quant8`/`quant4` modes).
    pub fn per_token(bits: Bits) -> Self {
        Self {
            k_bits: bits,
            v_bits: bits,
            k_per_channel: false,
            rotate: false,
            ranges: Ranges::MinMax,
            k_mixed: false,
        }
    }

    /// The presets' format: keys `k`-bit per channel (on average when `mixed`), values
    /// `v`-bit per head after a rotation, ranges fitted.
    pub fn preset(k: Bits, v: Bits, mixed: bool) -> Self {
        Self {
            k_bits: k,
            v_bits: v,
            k_per_channel: true,
            rotate: true,
            ranges: Ranges::Fitted,
            k_mixed: mixed,
        }
    }
}

/// What happens to a position a bounded layer evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// Nothing is kept.
    Drop,
    /// Kept quantised.
    Quantise(QuantFormat),
    /// Rebuilt by the restorer.
    Restore,
    /// Kept as the quantised difference from the restorer's prediction (raw K/V space).
    Residual(QuantFormat),
}

impl Evicted {
    /// The quantised format, when evicted positions are quantised (as they are or as a
    /// residual).
    pub fn format(self) -> Option<QuantFormat> {
        match self {
            Evicted::Quantise(f) | Evicted::Residual(f) => Some(f),
            Evicted::Drop | Evicted::Restore => None,
        }
    }
}

/// What one layer keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerPlan {
    /// The model's native cache (every position it needs, exactly).
    Native,
    /// `sink` first and `window` most recent positions exact; evicted positions as given.
    Bounded {
        /// What happens to evicted positions.
        evicted: Evicted,
        /// First positions kept exactly.
        sink: usize,
        /// Most recent positions kept exactly.
        window: usize,
    },
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
    /// How exact K/V (native caches, sinks, windows) are stored.
    #[serde(default)]
    pub dtype: KvDtype,
    /// What global (full-attention) layers keep, over the mode's plan.
    #[serde(default)]
    pub global: Option<LayerRule>,
    /// What sliding-window layers keep, over the mode's plan.
    #[serde(default)]
    pub sliding: Option<LayerRule>,
    /// Most recent positions the drafter's compact store keeps for drafts (with the first
    /// [`DraftReach::DEFAULT`]`.sink`); a window as long as the context keeps every position.
    /// The restored modes keep every position whatever this says (restoration reads them).
    #[serde(default = "default_draft_window")]
    pub draft_window: usize,
}

fn default_draft_window() -> usize {
    DraftReach::DEFAULT.window
}

/// What one kind of layer keeps (a policy file's `[global]` or `[sliding]` table); every
/// field left out keeps the mode's choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRule {
    /// `native` (the model's cache), `drop`, `quantise` or `residual` (evicted positions).
    pub keep: Option<Keep>,
    /// First positions kept exactly.
    pub sink: Option<usize>,
    /// Most recent positions kept exactly.
    pub window: Option<usize>,
    /// Key bits of the quantised tier (2 to 8).
    pub k_bits: Option<u32>,
    /// Value bits of the quantised tier (2 to 8).
    pub v_bits: Option<u32>,
    /// Key groups: `channel` (per channel over blocks of 64 positions) or `token`.
    pub k_groups: Option<KeyGroups>,
    /// Rotate what is grouped per token (values; keys grouped per token) before quantising.
    pub rotate: Option<bool>,
    /// Group ranges: `min-max` or `fitted` (least squared error).
    pub ranges: Option<Ranges>,
    /// Keys per channel: bits mixed among each block's channels by range (`k_bits` on
    /// average).
    pub k_mixed: Option<bool>,
}

/// What a layer does with what falls out of its exact tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Keep {
    /// The model's native cache: nothing is evicted.
    Native,
    /// Evicted positions dropped.
    Drop,
    /// Evicted positions quantised.
    Quantise,
    /// Evicted positions quantised as the residual of f_θ's prediction (the mode must be
    /// one that restores: it provides f_θ and the whole compact store).
    Residual,
}

/// How quantised keys are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyGroups {
    /// Per channel over blocks of 64 positions.
    Channel,
    /// Per token, groups of 64 values.
    Token,
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
            dtype: KvDtype::default(),
            global: None,
            sliding: None,
            draft_window: default_draft_window(),
        }
    }

    /// How the drafter's compact store holds its rows under this policy: restoration reads
    /// every row as f_θ was trained on them (f32, or the mode's bits); drafts read rows held in
    /// the exact tiers' dtype.
    pub fn store_format(&self) -> StoreFormat {
        // A residual is taken against the prediction from the rows as stored, so the store
        // may be held in the exact tiers' dtype.
        let residual = matches!(self.mode, KvMode::Residual { .. });
        match (
            self.mode.restores() && !residual,
            self.mode.store_bits(),
            self.dtype,
        ) {
            (true, Some(b), _) => StoreFormat::Quant(b),
            (true, None, _) | (false, _, KvDtype::F32) => StoreFormat::F32,
            (false, _, KvDtype::F16) => StoreFormat::F16,
        }
    }

    /// What the drafter's compact store keeps under this policy: `None` (every position) in
    /// the restored modes.
    pub fn draft_reach(&self) -> Option<DraftReach> {
        (!self.mode.restores()).then_some(DraftReach {
            window: self.draft_window,
            ..DraftReach::DEFAULT
        })
    }

    /// Reads a policy file (TOML: `mode`, optional `sink`, `window`, `dtype`, `draft_window`,
    /// and `[global]` / `[sliding]` tables of [`LayerRule`]; nothing else), checking every bit
    /// width.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))?;
        let policy: Self = toml::from_str(&text)
            .map_err(|e| RuntimeError::Input(format!("{}: {}", path.display(), e.message())))?;
        for (kind, rule) in [("global", policy.global), ("sliding", policy.sliding)] {
            let Some(rule) = rule else { continue };
            for (what, bits) in [("k_bits", rule.k_bits), ("v_bits", rule.v_bits)] {
                if let Some(n) = bits.filter(|&n| Bits::new(n).is_none()) {
                    return Err(RuntimeError::Input(format!(
                        "{}: [{kind}] {what} = {n}: unsupported bit width (2 to 8)",
                        path.display()
                    )));
                }
            }
        }
        // What can be checked without the model (its context, the block size) is checked
        // here, with the file named.
        policy
            .check(usize::MAX, 1)
            .map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))?;
        Ok(policy)
    }

    /// What a layer with `spec` keeps: the mode's plan, then the policy's `[global]` or
    /// `[sliding]` rule over it. A sliding layer whose own window fits in the kept recent
    /// window keeps its native ring: it never reads a position the policy would evict
    /// (Gemma 4's small tiny-test windows; Gemma 3/4's 512 or 1024 against a 64-position
    /// policy window are bounded as before).
    pub fn plan(&self, spec: CacheSpec) -> LayerPlan {
        let global = spec == CacheSpec::Full;
        let plan = self.mode_plan(global);
        let rule = if global { self.global } else { self.sliding };
        let plan = match rule {
            Some(r) => r.over(plan, (self.sink, self.window)),
            None => plan,
        };
        match (plan, spec) {
            (LayerPlan::Bounded { window: w, .. }, CacheSpec::Sliding { window })
                if window <= w =>
            {
                LayerPlan::Native
            }
            _ => plan,
        }
    }

    /// The mode's plan for a global or a sliding layer.
    fn mode_plan(&self, global: bool) -> LayerPlan {
        let bounded = |evicted| LayerPlan::Bounded {
            evicted,
            sink: self.sink,
            window: self.window,
        };
        let quant = |b| bounded(Evicted::Quantise(QuantFormat::per_token(b)));
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
            KvMode::Quant8 => quant(Bits::B8),
            KvMode::Quant4 => quant(Bits::B4),
            KvMode::Quant8All => LayerPlan::QuantAll(Bits::B8),
            KvMode::Quant4All => LayerPlan::QuantAll(Bits::B4),
            KvMode::Bounded { k, v, mixed } if global => LayerPlan::Bounded {
                evicted: Evicted::Quantise(QuantFormat::preset(k, v, mixed)),
                sink: self.sink,
                window: self.window.max(GLOBAL_WINDOW),
            },
            KvMode::Residual { k, v } if global => LayerPlan::Bounded {
                evicted: Evicted::Residual(QuantFormat::preset(k, v, false)),
                sink: self.sink,
                window: self.window.max(GLOBAL_WINDOW),
            },
            KvMode::Bounded { .. } | KvMode::Residual { .. } => bounded(Evicted::Drop),
        }
    }

    /// Checks the policy against the model's context and the speculative block size
    /// (`block` 1 for plain decoding), for global and sliding layers alike.
    pub fn check(&self, context: usize, block: usize) -> Result<()> {
        let kinds = [
            ("global", CacheSpec::Full),
            ("sliding", CacheSpec::Sliding { window: usize::MAX }),
        ];
        for (kind, spec) in kinds {
            let LayerPlan::Bounded {
                evicted,
                sink,
                window,
            } = self.plan(spec)
            else {
                continue;
            };
            let mode = &self.mode;
            if matches!(evicted, Evicted::Residual(_)) && !mode.restores() {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: the {kind} layers keep residuals of f_θ's prediction, which needs a mode that loads f_θ and keeps the drafter's whole store: use mode = \"residual-k<K>v<V>\""
                )));
            }
            if window == 0 {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: the {kind} layers' window must keep at least 1 position"
                )));
            }
            if sink + window > context {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: {kind} layers' sink {sink} + window {window} is larger than the model's context of {context}"
                )));
            }
            if block > window {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: block size {block} is larger than the {kind} layers' exact window of {window}: a verified block would read its own keys exactly where plain decoding reads evicted copies; use a block of at most {window} or a larger window"
                )));
            }
            if let Some(f) = evicted.format()
                && f.k_mixed
                && !f.k_per_channel
            {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: the {kind} layers mix key bits per channel (k_mixed), which needs keys grouped per channel (k_groups = \"channel\")"
                )));
            }
            if let Some(f) = evicted.format()
                && f.k_per_channel
            {
                let b = CHANNEL_BLOCK;
                if window < b {
                    return Err(RuntimeError::Input(format!(
                        "KV mode {mode}: the {kind} layers quantise keys per channel over blocks of {b} positions, so their exact window must hold at least {b} (it is {window}): a query would read a block still being filled"
                    )));
                }
                if block > b {
                    return Err(RuntimeError::Input(format!(
                        "KV mode {mode}: block size {block} is over the {b}-position slack of per-channel keys: a rollback could reopen a block already quantised; use a block of at most {b}"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl LayerRule {
    /// This rule over the mode's `plan`; `(sink, window)` are the policy's, for a layer the
    /// rule bounds where the mode did not.
    fn over(&self, plan: LayerPlan, (sink, window): (usize, usize)) -> LayerPlan {
        let (evicted, sink, window) = match plan {
            LayerPlan::Bounded {
                evicted,
                sink,
                window,
            } => (Some(evicted), sink, window),
            LayerPlan::Native | LayerPlan::QuantAll(_) => (None, sink, window),
        };
        let fmt = evicted
            .and_then(Evicted::format)
            .unwrap_or(QuantFormat::per_token(Bits::B8));
        let fmt = QuantFormat {
            k_bits: self.k_bits.and_then(Bits::new).unwrap_or(fmt.k_bits),
            v_bits: self.v_bits.and_then(Bits::new).unwrap_or(fmt.v_bits),
            k_per_channel: self
                .k_groups
                .map_or(fmt.k_per_channel, |g| g == KeyGroups::Channel),
            rotate: self.rotate.unwrap_or(fmt.rotate),
            ranges: self.ranges.unwrap_or(fmt.ranges),
            k_mixed: self.k_mixed.unwrap_or(fmt.k_mixed),
        };
        let evicted = match (self.keep, evicted) {
            (Some(Keep::Native), _) => return LayerPlan::Native,
            (Some(Keep::Drop), _) => Evicted::Drop,
            (Some(Keep::Quantise), _) | (None, Some(Evicted::Quantise(_))) => {
                Evicted::Quantise(fmt)
            }
            (Some(Keep::Residual), _) | (None, Some(Evicted::Residual(_))) => {
                Evicted::Residual(fmt)
            }
            (None, Some(e)) => e,
            (None, None) => return plan,
        };
        LayerPlan::Bounded {
            evicted,
            sink: self.sink.unwrap_or(sink),
            window: self.window.unwrap_or(window),
        }
    }
}
