//! The KV options shared by `infer`, `bench` and `eval`: the mode (flags or a TOML policy
//! file) and f_θ for the restored modes.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use kakeya_capture::job::sha256_path;
use kakeya_models::{DFlashDrafter, FTheta, GemmaModel};
use kakeya_runtime::{FThetaRestorer, KvDtype, KvMode, KvPolicy};
use kakeya_weights::FThetaCheckpoint;

/// f_θ of the default model and its trained drafter.
pub const DEFAULT_F_THETA: &str = "checkpoints/f-theta-gemma3-270m";

/// How the verifier keeps its K/V.
#[derive(Args, Debug, Clone)]
pub struct KvArgs {
    /// KV mode: full, sink-window, exact-global, restored, restored-sliding, quant8, quant4,
    /// quant8-all, quant4-all, restored-q8, restored-q4, a bounded preset bounded-k<K>v<V>
    /// or bounded-k<K>v<V>-mixed (e.g. bounded-k2v2-mixed, the recommended one), or
    /// residual-k<K>v<V> (f_θ's prediction plus a quantised residual; see docs/kv-modes.md).
    #[arg(long, default_value = "full")]
    pub kv_mode: KvMode,
    /// First positions every bounded layer keeps exactly.
    #[arg(long, default_value_t = 4)]
    pub kv_sink: usize,
    /// Most recent positions every bounded layer keeps exactly.
    #[arg(long, default_value_t = 64)]
    pub kv_window: usize,
    /// How exact K/V are stored: f16 (the default, as llama.cpp's and vLLM's caches) or f32.
    /// Attention computes in f32 either way; on a GPU the caches stay f32.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Most recent positions the drafter's compact store keeps and drafts read (with the
    /// first 4); a window as long as the context keeps every position. The restored modes
    /// keep every position.
    #[arg(long, default_value_t = kakeya_runtime::DraftReach::DEFAULT.window)]
    pub draft_window: usize,
    /// A TOML policy file (`mode`, optional `sink`, `window`, `dtype`, `draft_window`, and
    /// `[global]`/`[sliding]` tables) instead of the flags.
    #[arg(long, conflicts_with_all = ["kv_mode", "kv_sink", "kv_window", "kv_dtype", "draft_window"])]
    pub kv_policy: Option<PathBuf>,
    /// An exported f_θ folder for the restored and residual modes (default:
    /// checkpoints/f-theta-gemma3-270m with the default model and drafter).
    #[arg(long)]
    pub f_theta: Option<PathBuf>,
}

impl KvArgs {
    /// The policy the flags or the file give.
    pub fn policy(&self) -> Result<KvPolicy> {
        match &self.kv_policy {
            Some(p) => Ok(KvPolicy::from_file(p)?),
            None => Ok(KvPolicy {
                mode: self.kv_mode,
                sink: self.kv_sink,
                window: self.kv_window,
                dtype: self.kv_dtype,
                draft_window: self.draft_window,
                ..KvPolicy::new(self.kv_mode)
            }),
        }
    }

    /// The f_θ folder a restored mode uses: `--f-theta`, or the default model's.
    pub fn f_theta_dir(&self, default_pair: bool) -> Result<PathBuf> {
        f_theta_dir(self.f_theta.as_ref(), default_pair)
    }
}

/// `explicit`, or the default model's f_θ when the run uses the default model and drafter.
pub fn f_theta_dir(explicit: Option<&PathBuf>, default_pair: bool) -> Result<PathBuf> {
    if let Some(d) = explicit {
        return Ok(d.clone());
    }
    let d = PathBuf::from(DEFAULT_F_THETA);
    if default_pair && d.is_dir() {
        return Ok(d);
    }
    bail!(
        "the restored and residual KV modes need an f_θ: pass --f-theta DIR (one trained for this model and drafter by `kakeya train f-theta`)"
    )
}

/// Loads an exported f_θ for the pair (`model_path`, `drafter_dir`), refusing one trained for
/// another pair (content hashes), and folds it for restoration.
pub fn load_f_theta(
    dir: &Path,
    model_path: &Path,
    drafter_dir: &Path,
    model: &GemmaModel,
    drafter: &DFlashDrafter,
) -> Result<FThetaRestorer> {
    let ck = FThetaCheckpoint::read_dir(dir)
        .with_context(|| format!("loading f_θ {}", dir.display()))?;
    let vsha = sha256_path(model_path)?;
    let dsha = sha256_path(drafter_dir)?;
    ck.check_pair(dir, &vsha, &dsha)?;
    let f = FTheta::from_checkpoint(&ck, model.device())?;
    let own = model.config.own_kv_widths();
    if ck.config.layer_widths() != own {
        bail!(
            "{}: f_θ predicts layers of K/V widths {:?}, the model's layers with K/V of their own have {:?}",
            dir.display(),
            ck.config.layer_widths(),
            own
        );
    }
    FThetaRestorer::new(&f, drafter.num_layers(), drafter.context_width())
        .with_context(|| format!("{}", dir.display()))
}

/// What a run under a KV policy holds besides the model: the drafter filling the compact store
/// (when the mode restores and no speculative drafter does it) and the restorer.
pub struct KvRun {
    /// The policy.
    pub policy: KvPolicy,
    /// A drafter loaded only for the store.
    pub store_drafter: Option<DFlashDrafter>,
    /// f_θ, for the restored modes.
    pub restorer: Option<FThetaRestorer>,
}

impl KvRun {
    /// Resolves `kv` for `model` (from `model_args`): a restored mode loads the drafter of
    /// `drafter_dir` (or the default one) unless `spec_drafter` is already loaded from there,
    /// and the f_θ of the pair (refusing one made for another pair).
    pub fn prepare(
        kv: &KvArgs,
        model_args: &crate::common::ModelArgs,
        model: &GemmaModel,
        drafter_dir: Option<&Path>,
        spec_drafter: Option<&DFlashDrafter>,
    ) -> Result<Self> {
        let policy = kv.policy()?;
        let mut run = Self {
            policy,
            store_drafter: None,
            restorer: None,
        };
        if !policy.mode.restores() {
            return Ok(run);
        }
        let default_dir = PathBuf::from(crate::common::F_THETA_DRAFTER);
        let dir = drafter_dir.unwrap_or(&default_dir);
        if spec_drafter.is_none() {
            run.store_drafter = Some(crate::common::load_drafter(dir, model)?);
        }
        let d = spec_drafter
            .or(run.store_drafter.as_ref())
            .expect("loaded above");
        let f_dir = kv.f_theta_dir(model_args.uses_default_model() && drafter_dir.is_none())?;
        run.restorer = Some(load_f_theta(
            &f_dir,
            &model_args.model_path()?,
            dir,
            model,
            d,
        )?);
        Ok(run)
    }

    /// The session setup: the policy, the store drafter and the restorer (a speculative
    /// drafter is added by the caller).
    pub fn setup(&self) -> kakeya_runtime::KvSetup<'_> {
        let mut s = kakeya_runtime::KvSetup::new(self.policy);
        if let Some(d) = &self.store_drafter {
            s = s.drafter(d);
        }
        if let Some(r) = &self.restorer {
            s = s.restorer(r);
        }
        s
    }
}
