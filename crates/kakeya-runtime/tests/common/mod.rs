//! Shared by this crate's integration tests: paths and loaders for the fetched default model
//! (`python3 scripts/fetch_default_model.py`), and speculative decoding with a drafter.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use burn::tensor::Device;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    CompactStore, DFlashProposer, Generation, GenerationConfig, KvSetup, Proposer, ReplayProposer,
    Result, SpecConfig, Verifier, speculative_generate,
};
use kakeya_weights::{Checkpoint, DraftCheckpoint, Tokenizer};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where the fetch script puts Gemma 3 270M and its tokenizer.
pub fn model_dir() -> PathBuf {
    root().join("models/gemma-3-270m")
}

/// The default model (GGUF Q4_K_M) on the test device (the CPU unless `KAKEYA_TEST_DEVICE`
/// names another this binary was built for), and its tokenizer.
pub fn load() -> (GemmaModel, Tokenizer) {
    let ck = Checkpoint::load(model_dir().join("gemma-3-270m-q4_k_m.gguf")).expect("fetched model");
    let tok = Tokenizer::load(&model_dir().join("tokenizer.json"), ck.config.vocab_size).unwrap();
    (
        GemmaModel::from_checkpoint(ck, &kakeya_models::testing::test_device()).unwrap(),
        tok,
    )
}

/// The first drafter trained for the default model (`configs/train/drafter-270m.toml`): the
/// one the committed f_θ reads, so the restored KV modes use it.
pub fn trained_drafter_dir() -> PathBuf {
    root().join("checkpoints/drafter-gemma3-270m")
}

/// [`trained_drafter_dir`]'s drafter, loaded for `verifier`.
pub fn trained_drafter(verifier: &GemmaModel) -> DFlashDrafter {
    let ck = DraftCheckpoint::load(&trained_drafter_dir()).expect("trained drafter");
    DFlashDrafter::from_checkpoint(ck, verifier).unwrap()
}

/// The default model's default drafter (v2 fine-tuned on free-form prompts:
/// `configs/train/drafter-270m-sampled.toml`),
/// loaded for `verifier`.
pub fn default_drafter(verifier: &GemmaModel) -> DFlashDrafter {
    let dir = root().join("checkpoints/drafter-gemma3-270m-v3");
    let ck = DraftCheckpoint::load(&dir).expect("default drafter");
    DFlashDrafter::from_checkpoint(ck, verifier).unwrap()
}

/// The default model's static n-gram table (`checkpoints/ngram-gemma3-270m.bin`).
pub fn default_table() -> std::sync::Arc<kakeya_runtime::NgramTable> {
    let path = root().join("checkpoints/ngram-gemma3-270m.bin");
    std::sync::Arc::new(kakeya_runtime::NgramTable::load(&path).expect("default n-gram table"))
}

/// Speculative greedy decoding of `prompt` with `drafter` at its own block size.
pub fn speculative(
    verifier: &GemmaModel,
    drafter: &DFlashDrafter,
    prompt: &[u32],
    cfg: &GenerationConfig,
) -> Generation {
    let block = drafter.block_size();
    let setup = KvSetup::full(0).drafter(drafter);
    let mut ver = Verifier::new(verifier, setup, block).unwrap();
    let mut prop = DFlashProposer::new(drafter);
    speculative_generate(
        &mut ver,
        &mut prop,
        prompt,
        cfg,
        SpecConfig::fixed(block),
        &mut |_| {},
    )
    .unwrap()
}

/// A tiny random Gemma 4 of `tests/fixtures/gemma4` (`dense`, `dense-kv`, `moe`; written by
/// its `make_gemma4.py` with transformers) from its HF folder, on the CPU.
pub fn gemma4(name: &str) -> GemmaModel {
    let ck = Checkpoint::load(root().join("tests/fixtures/gemma4").join(name)).unwrap();
    GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap()
}

/// Logits of the prompt's last position (prefilled in chunks of `chunk`) and of every step
/// feeding `tokens`, under `setup`.
pub fn trace(
    v: &GemmaModel,
    setup: KvSetup<'_>,
    chunk: usize,
    p: &[u32],
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let mut session = kakeya_runtime::Session::with_kv(v, setup).unwrap();
    let mut out = vec![session.run(p, chunk).unwrap()];
    for &t in tokens {
        out.push(session.run(&[t], 1).unwrap());
    }
    out
}

/// Largest absolute difference between two traces.
pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// Checks that a verify block's rows are bit for bit the logits of single decode steps over
/// the same tokens (blocks of 2, 4, 8 and 16 after a 9-token prompt), the property lossless
/// speculation rests on; `what` names the model in messages. Token ids are below 90.
pub fn assert_blocks_equal_steps(m: &GemmaModel, what: &str) {
    assert_blocks_equal_steps_after(m, what, 9, 4);
}

/// [`assert_blocks_equal_steps`] after a prompt of `len` positions prefilled in chunks of
/// `chunk`.
pub fn assert_blocks_equal_steps_after(m: &GemmaModel, what: &str, len: u32, chunk: usize) {
    let prompt: Vec<u32> = (0..len).map(|j| (j * 37 + 5) % 90).collect();
    let block: Vec<u32> = (0..16u32).map(|j| (j * 29 + 11) % 90).collect();
    let mut steps = kakeya_runtime::Session::new(m, 0);
    steps.run(&prompt, chunk).unwrap();
    let single: Vec<Vec<f32>> = block.iter().map(|&t| steps.run(&[t], 1).unwrap()).collect();
    for t in [2, 4, 8, 16] {
        let mut s = kakeya_runtime::Session::new(m, 0);
        s.run(&prompt, chunk).unwrap();
        let out = s
            .forward(&block[..t], kakeya_models::Logits::All, None, &[])
            .unwrap();
        let flat = out
            .logits
            .unwrap()
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        for (i, want) in single.iter().take(t).enumerate() {
            let got = &flat[i * want.len()..(i + 1) * want.len()];
            let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "{what}: row {i} of a {t}-row block: {differ} logits differ from its step"
            );
        }
    }
}

/// Prompt `i` of the tiny models: `len` ids below 97.
pub fn tiny_prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((j * 13 + i * 29 + 5) % 97) as u32)
        .collect()
}

/// Replays a known continuation as drafts, corrupting each draft with probability `noise`
/// (seeded xorshift): speculation with random accept counts.
pub struct NoisyReplay {
    replay: ReplayProposer,
    noise: f64,
    rng: u64,
}

impl NoisyReplay {
    /// Drafts `continuation` after `prompt`.
    pub fn new(prompt: &[u32], continuation: &[u32], noise: f64, seed: u64) -> Self {
        Self {
            replay: ReplayProposer::new(prompt, continuation),
            noise,
            rng: seed,
        }
    }

    fn coin(&mut self) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 10_000) as f64 / 10_000.0
    }
}

impl Proposer for NoisyReplay {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let mut out = self.replay.propose(tokens, n, store)?;
        for d in &mut out {
            if self.coin() < self.noise {
                *d = (*d + 1) % 97;
            }
        }
        Ok(out)
    }
}

/// The verifier's own raw K/V of every position of `seq`, per layer, as a restorer (restoration
/// without f_θ's error; a Gemma 4 sharing layer's entry is its source's, and the restorer is
/// only asked for layers with K/V of their own).
pub fn oracle_restorer(v: &GemmaModel, seq: &[u32]) -> kakeya_runtime::kv::OracleRestorer {
    let mut req = kakeya_models::ForwardRequest::new(seq, 0, kakeya_models::Logits::None);
    req.capture_attention = true;
    // f32 caches: the exact K/V of a reference forward.
    let mut caches =
        kakeya_runtime::KvCache::for_specs(&v.cache_specs(), 0, kakeya_runtime::KvDtype::F32);
    let out = v.forward(&req, &mut caches).unwrap();
    kakeya_runtime::kv::OracleRestorer {
        layers: out
            .attention
            .into_iter()
            .map(|c| (c.k_raw, c.v_raw))
            .collect(),
    }
}

/// A random f_θ (rank 16, seed 3) for `v` and `d` as a restorer: one decoder per layer with K/V
/// of its own, each at that layer's width.
pub fn random_f_theta_restorer(
    v: &GemmaModel,
    d: &DFlashDrafter,
) -> kakeya_runtime::kv::FThetaRestorer {
    let widths = v.config.own_kv_widths();
    let cfg = kakeya_models::testing::f_theta_config(
        d.num_layers(),
        d.context_width() / d.num_layers(),
        kakeya_weights::ftheta::FThetaInputs::Own,
        16,
        widths.len(),
        widths[0],
    )
    .with_layer_widths(&widths);
    let ck = kakeya_models::testing::random_f_theta(&cfg, 3);
    let f = kakeya_models::FTheta::from_checkpoint(&ck, v.device()).unwrap();
    kakeya_runtime::kv::FThetaRestorer::new(&f, d.num_layers(), d.context_width()).unwrap()
}

/// `p` with f32 exact tiers (equivalences against exact f32 K/V).
pub fn f32_kv(p: kakeya_runtime::KvPolicy) -> kakeya_runtime::KvPolicy {
    kakeya_runtime::KvPolicy {
        dtype: kakeya_runtime::KvDtype::F32,
        ..p
    }
}

/// The device under test: wgpu, or CUDA with `KAKEYA_TEST_DEVICE=cuda`.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn gpu() -> Device {
    #[cfg(feature = "cuda")]
    if std::env::var("KAKEYA_TEST_DEVICE").as_deref() == Ok("cuda") {
        return Device::cuda(0);
    }
    #[cfg(not(feature = "wgpu"))]
    panic!("built with --features cuda only: run with KAKEYA_TEST_DEVICE=cuda");
    #[cfg(feature = "wgpu")]
    {
        let d = Device::wgpu(Default::default());
        assert_ne!(d, Device::flex(), "the wgpu device, not the CPU");
        d
    }
}

/// A 2-D tensor's values, row-major, on the host.
pub fn host(t: burn::tensor::Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}
