//! The KV modes (`--kv-mode`): their names, parsing and presets, and what each keeps.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::*;

/// The KV modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
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
    /// The bounded presets `bounded-k{k}v{v}`: sliding layers keep sink + window and drop
    /// what they evict; global layers keep sink + [`GLOBAL_WINDOW`] positions in 16-bit and
    /// the rest quantised, keys `k`-bit per channel over blocks of 64 positions, values
    /// `v`-bit per token (one group per head) after a rotation. `bounded-k{k}v{v}-mixed`:
    /// keys `k` bits per channel on average, each block's bits shared among its channels by
    /// their ranges (0 to 8 each).
    Bounded {
        /// Key bits (on average, when mixed).
        k: Bits,
        /// Value bits.
        v: Bits,
        /// Key bits mixed per channel.
        mixed: bool,
    },
    /// The residual modes `residual-k{k}v{v}`: as `bounded-k{k}v{v}`, but the global layers'
    /// evicted K/V are held as the quantised difference between the raw K/V (k_proj / v_proj
    /// outputs) and f_θ's prediction of them from the drafter's compact store, which is kept
    /// whole (its bytes count): a position is read back as prediction + residual.
    Residual {
        /// Key bits (of the residual).
        k: Bits,
        /// Value bits (of the residual).
        v: Bits,
    },
}

/// Exact recent positions the global layers of the `bounded-*` presets keep (at least two
/// per-channel blocks, so a verified block never reads a block still being filled).
pub const GLOBAL_WINDOW: usize = 128;

/// The named `bounded-*` presets (any `bounded-k{2..8}v{2..8}` parses).
pub const BOUNDED_PRESETS: [(u32, u32); 6] = [(8, 4), (4, 4), (4, 3), (4, 2), (3, 2), (2, 2)];

/// The named `bounded-k<K>v<V>-mixed` presets (any `bounded-k{2..8}v{2..8}-mixed` parses).
pub const MIXED_PRESETS: [(u32, u32); 3] = [(3, 3), (3, 2), (2, 2)];

/// The named `residual-*` presets (any `residual-k{2..8}v{2..8}` parses).
pub const RESIDUAL_PRESETS: [(u32, u32); 2] = [(4, 3), (3, 2)];

impl KvMode {
    /// The bounded mode the docs recommend (docs/kv-modes.md has the measurements).
    pub const RECOMMENDED: KvMode = KvMode::Bounded {
        k: Bits::B2,
        v: Bits::B2,
        mixed: true,
    };

    /// Every mode of `--modes all`, `full` first: the fixed modes, then the `bounded-*`
    /// (uniform, then mixed) and `residual-*` presets.
    pub fn all() -> Vec<KvMode> {
        let bits = |n| Bits::new(n).expect("preset bits");
        let mut out = Self::FIXED.to_vec();
        out.extend(BOUNDED_PRESETS.map(|(k, v)| KvMode::Bounded {
            k: bits(k),
            v: bits(v),
            mixed: false,
        }));
        out.extend(MIXED_PRESETS.map(|(k, v)| KvMode::Bounded {
            k: bits(k),
            v: bits(v),
            mixed: true,
        }));
        out.extend(RESIDUAL_PRESETS.map(|(k, v)| KvMode::Residual {
            k: bits(k),
            v: bits(v),
        }));
        out
    }

    /// The modes without parameters, `full` first.
    pub const FIXED: [KvMode; 11] = [
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
    pub fn name(self) -> String {
        match self {
            KvMode::Bounded { k, v, mixed } => format!(
                "bounded-k{}v{}{}",
                k.count(),
                v.count(),
                if mixed { "-mixed" } else { "" }
            ),
            KvMode::Residual { k, v } => format!("residual-k{}v{}", k.count(), v.count()),
            fixed => fixed.fixed_name().to_string(),
        }
    }

    fn fixed_name(self) -> &'static str {
        match self {
            KvMode::Bounded { .. } => "bounded",
            KvMode::Residual { .. } => "residual",
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

    /// Whether evicted K/V are rebuilt by a restorer (alone, or as the prediction a residual
    /// is added to): the mode needs f_θ and keeps the whole compact store.
    pub fn restores(self) -> bool {
        matches!(
            self,
            KvMode::Restored
                | KvMode::RestoredSliding
                | KvMode::RestoredQ8
                | KvMode::RestoredQ4
                | KvMode::Residual { .. }
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

    /// Whether the mode bounds some layer with a sink + window (a policy file's rules may
    /// bound layers of other modes too: [`KvPolicy::check`] asks the plans).
    pub fn windowed(self) -> bool {
        !matches!(self, KvMode::Full | KvMode::Quant8All | KvMode::Quant4All)
    }
}

impl std::fmt::Display for KvMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<KvMode> for String {
    fn from(m: KvMode) -> String {
        m.name()
    }
}

impl TryFrom<String> for KvMode {
    type Error = RuntimeError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// `k{K}v{V}` → the two bit widths, each checked.
fn parse_kv_bits(s: &str, whole: &str, family: &str) -> Result<(Bits, Bits)> {
    let bad = |why: String| {
        RuntimeError::Input(format!(
            "KV mode {whole:?}: {why}; the {family} modes are named {family}-k<K>v<V> with K and V from 2 to 8 bits (e.g. {family}-k4v3{})",
            if family == "bounded" {
                ", or bounded-k<K>v<V>-mixed"
            } else {
                ""
            }
        ))
    };
    let rest = s
        .strip_prefix('k')
        .ok_or_else(|| bad("expected k<K>v<V>".into()))?;
    let (k, v) = rest
        .split_once('v')
        .ok_or_else(|| bad("expected k<K>v<V>".into()))?;
    let bits = |t: &str, what: &str| -> Result<Bits> {
        let n: u32 = t
            .parse()
            .map_err(|_| bad(format!("{what} bits {t:?} are not a number")))?;
        Bits::new(n).ok_or_else(|| bad(format!("unsupported {what} bit width {n}")))
    };
    Ok((bits(k, "key")?, bits(v, "value")?))
}

impl FromStr for KvMode {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self> {
        if let Some(kv) = s.strip_prefix("bounded-") {
            let (kv, mixed) = match kv.strip_suffix("-mixed") {
                Some(kv) => (kv, true),
                None => (kv, false),
            };
            let (k, v) = parse_kv_bits(kv, s, "bounded")?;
            return Ok(KvMode::Bounded { k, v, mixed });
        }
        if let Some(kv) = s.strip_prefix("residual-") {
            let (k, v) = parse_kv_bits(kv, s, "residual")?;
            return Ok(KvMode::Residual { k, v });
        }
        KvMode::FIXED
            .into_iter()
            .find(|m| m.fixed_name() == s)
            .ok_or_else(|| {
                RuntimeError::Input(format!(
                    "unknown KV mode {s:?}; the modes are {}, and bounded-k<K>v<V> and residual-k<K>v<V> (K, V from 2 to 8 bits)",
                    KvMode::all().into_iter().map(KvMode::name).collect::<Vec<_>>().join(", ")
                ))
            })
    }
}
