//! Shared CLI pieces: model/tokenizer location, device choice, loading.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::Device;
use clap::{Args, ValueEnum};
use kakeya_models::linear::Kernel;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_weights::{Checkpoint, DraftCheckpoint, Tokenizer};

/// Where `scripts/fetch_default_model.py` puts the default model.
pub const DEFAULT_MODEL: &str = "models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf";

/// The trained DFlash drafter for the default model (`configs/train/drafter-270m-sampled.toml`):
/// the one speculative decoding uses by default.
pub const DEFAULT_DRAFTER: &str = "checkpoints/drafter-gemma3-270m-v3";

/// The drafter the default model's f_θ was trained with (`configs/train/drafter-270m.toml`):
/// the restored KV modes read its context K/V, so on the default model they use it — for the
/// store and, by default, for drafting.
pub const F_THETA_DRAFTER: &str = "checkpoints/drafter-gemma3-270m";

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// CPU (burn-flex).
    Cpu,
    /// NVIDIA GPU (build with `--features cuda`).
    Cuda,
    /// Vulkan/Metal/DX12 through wgpu (build with `--features wgpu`).
    Wgpu,
    /// Apple Metal (build with `--features metal`).
    Metal,
}

impl DeviceKind {
    /// The Burn device, or an error when this binary was built without its feature.
    pub fn device(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::flex()),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => started(Device::cuda(0), "cuda"),
            #[cfg(feature = "wgpu")]
            DeviceKind::Wgpu => started(Device::wgpu(Default::default()), "wgpu"),
            #[cfg(feature = "metal")]
            DeviceKind::Metal => started(Device::metal(Default::default()), "metal"),
            #[allow(unreachable_patterns)]
            other => bail!(
                "this kakeya was built without the `{other:?}` device; rebuild with `--features {}`",
                format!("{other:?}").to_lowercase()
            ),
        }
    }
}

/// Runs one tiny operation on a GPU device, so that a runtime that cannot start (no driver, the
/// CUDA toolkit's `libcuda.so` stub ahead of the driver's, no NVRTC) ends in an error rather than
/// a panic in the middle of a job. The runtime's own message is printed above it.
#[cfg(any(feature = "cuda", feature = "wgpu", feature = "metal"))]
fn started(device: Device, name: &str) -> Result<Device> {
    let probe = device.clone();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        burn::tensor::Tensor::<1>::zeros([1], &probe).into_data()
    }));
    match ran {
        Ok(_) => Ok(device),
        Err(_) => bail!(
            "the `{name}` device could not be started (the runtime's message is above); for cuda: \
             the NVIDIA driver's libcuda and the toolkit's libnvrtc must be found (LD_LIBRARY_PATH, \
             without the toolkit's lib/stubs folder)"
        ),
    }
}

/// Model, tokenizer and device arguments shared by subcommands.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face folder (default: the fetched Gemma 3 270M).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// `tokenizer.json` (default: beside the GGUF, or inside the folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Products of the quantised layer weights on the CPU: `exact` (f32, the model's own
    /// greedy choices) or `int8` (inputs rounded to int8, integer dot products, as llama.cpp:
    /// faster or slower than `exact` depending on the CPU, see docs/benchmarks.md; outputs
    /// move by ≈ 1 %, so greedy text can differ from the f32 model's at
    /// near-ties). Speculation stays lossless either way.
    #[arg(long, value_enum, default_value_t = KernelKind::Exact)]
    pub kernel: KernelKind,
    /// On a GPU, issue every forward (decode steps, verify blocks, batched steps, the
    /// drafter's drafts) kernel by kernel instead of recording it once and replaying it (a
    /// CUDA graph): the same tokens, for timing the two.
    #[arg(long)]
    pub no_graph: bool,
    /// Whether `model` is the default model's file (by content), once worked out.
    #[arg(skip)]
    pub is_default: std::sync::OnceLock<bool>,
}

/// `--kernel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KernelKind {
    /// Exact f32 products.
    Exact,
    /// Int8 inputs, integer dot products.
    Int8,
}

/// SHA-256 of the default model's GGUF (what `scripts/fetch_default_model.py` checks).
pub const DEFAULT_MODEL_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

/// Size of the default model's GGUF in bytes: a file of another size is not it, and is not
/// hashed (a large model would take seconds).
pub const DEFAULT_MODEL_BYTES: u64 = 253_113_024;

impl ModelArgs {
    /// Whether the run uses the default model: no `--model`, or a file with the default
    /// model's content (a copy or a link of it gets its drafter, table and f_θ as well).
    pub fn uses_default_model(&self) -> bool {
        *self.is_default.get_or_init(|| match &self.model {
            None => true,
            Some(p) => {
                std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == DEFAULT_MODEL_BYTES)
                    && kakeya_capture::job::sha256_path(p).is_ok_and(|h| h == DEFAULT_MODEL_SHA256)
            }
        })
    }

    /// The model path, defaulting to the fetched model.
    pub fn model_path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => {
                let p = PathBuf::from(DEFAULT_MODEL);
                if !p.is_file() {
                    bail!(
                        "{}: default model not found; run `python3 scripts/fetch_default_model.py` first or pass --model",
                        p.display()
                    );
                }
                Ok(p)
            }
        }
    }

    /// The tokenizer path.
    pub fn tokenizer_path(&self, model: &Path) -> PathBuf {
        self.tokenizer.clone().unwrap_or_else(|| {
            if model.is_dir() {
                model.join("tokenizer.json")
            } else {
                model.with_file_name("tokenizer.json")
            }
        })
    }

    /// Loads model and tokenizer on the chosen device.
    pub fn load(&self) -> Result<(GemmaModel, Tokenizer)> {
        let path = self.model_path()?;
        let device = self.device.device()?;
        let ck =
            Checkpoint::load(&path).with_context(|| format!("loading model {}", path.display()))?;
        let tok = Tokenizer::load(&self.tokenizer_path(&path), ck.config.vocab_size)?;
        let mut model = GemmaModel::from_checkpoint(ck, &device)?;
        model.record_decode = !self.no_graph;
        if self.kernel == KernelKind::Int8 && model.set_kernel(Kernel::Int8) == 0 {
            bail!(
                "{}: --kernel int8 needs quantised (GGUF) weights on the CPU, and this model has none there",
                path.display()
            );
        }
        Ok((model, tok))
    }
}

/// Loads a DFlash drafter folder for `verifier`, refusing one built for another model.
pub fn load_drafter(dir: &Path, verifier: &GemmaModel) -> Result<DFlashDrafter> {
    let ck =
        DraftCheckpoint::load(dir).with_context(|| format!("loading drafter {}", dir.display()))?;
    Ok(DFlashDrafter::from_checkpoint(ck, verifier)?)
}

/// The drafter folder a run uses: `explicit` (`--drafter`), or — when `allow_default` and the
/// run uses the default model ([`ModelArgs::uses_default_model`]) — the trained drafter in `checkpoints/`, when present: the
/// default one, or in a KV mode that `restores` through f_θ the one f_θ was trained with.
pub fn drafter_dir(
    explicit: Option<&PathBuf>,
    allow_default: bool,
    model: &ModelArgs,
    restores: bool,
) -> Option<PathBuf> {
    if let Some(d) = explicit {
        return Some(d.clone());
    }
    let default = PathBuf::from(default_drafter(restores));
    if allow_default && model.uses_default_model() && default.is_dir() {
        tracing::info!("using the default drafter {}", default.display());
        return Some(default);
    }
    None
}

/// Why a run decodes without speculation (it has no `--drafter`, `--draft`), for its stats
/// or startup line: `--no-drafter`, `--chat`, a model with no known drafter, or a missing
/// default drafter.
pub fn plain_reason(no_drafter: bool, chat: bool, model: &ModelArgs, restores: bool) -> String {
    if no_drafter {
        "--no-drafter".into()
    } else if chat {
        "--chat decodes without a drafter".into()
    } else if !model.uses_default_model() {
        "no drafter is known for this model: --drafter DIR adds one, --draft ngram drafts from \
         lookups alone"
            .into()
    } else {
        format!(
            "the default drafter {} is missing",
            default_drafter(restores)
        )
    }
}

/// The default model's drafter folder: [`F_THETA_DRAFTER`] when the KV mode `restores`, else
/// [`DEFAULT_DRAFTER`].
pub fn default_drafter(restores: bool) -> &'static str {
    if restores {
        F_THETA_DRAFTER
    } else {
        DEFAULT_DRAFTER
    }
}

/// Checks a block size against the drafter and the model's context.
pub fn check_block_size(block: usize, context: usize) -> Result<()> {
    if block == 0 {
        bail!("--block-size must be at least 1 (1 = no drafts)");
    }
    if block > context {
        bail!("--block-size {block} is larger than the model's context of {context}");
    }
    Ok(())
}

/// How tokens are chosen (`kakeya infer`, `kakeya bench`): greedy at temperature 0.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k (0 = off); with temperature > 0.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p nucleus (1 = off); with temperature > 0.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampling these flags ask for; an error for a negative temperature or a top-p
    /// outside (0, 1].
    pub fn sampling(&self) -> anyhow::Result<kakeya_runtime::Sampling> {
        if self.temperature < 0.0 || !self.temperature.is_finite() {
            anyhow::bail!("--temperature must be >= 0, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            anyhow::bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        Ok(if self.temperature == 0.0 {
            kakeya_runtime::Sampling::Greedy
        } else {
            kakeya_runtime::Sampling::Sample {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            }
        })
    }
}
