//! Recorded forwards on the wgpu device (built only with `--features wgpu`; run on Mesa's
//! lavapipe by `scripts/test_wgpu.sh`): decode steps, batched steps and drafts recorded once and
//! replayed give the tokens of the forwards issued kernel by kernel, and the probes that count
//! kernels per step (`scripts/kernel_count.sh`). Built with `--features cuda` instead and run
//! with `KAKEYA_TEST_DEVICE=cuda`, the same checks run on a CUDA GPU (scripts/device/).

#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use burn::tensor::Tensor;
use common::{gpu, host, tiny_prompt};
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, DraftContext, GemmaModel};
use kakeya_runtime::{
    DFlashProposer, KvSetup, Proposer, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};
use kakeya_weights::GemmaConfig;

fn tiny() -> GemmaConfig {
    tiny_config(8)
}

/// A count from the environment variable `name` (the kernel-count probes' step counts), else
/// `default`.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn recorded_decode_steps_equal_the_steps_issued_one_by_one() {
    let mut m = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    let p = tiny_prompt(2, 9);
    let n = 100;
    let cfg = kakeya_runtime::GenerationConfig::greedy(n, 512);
    m.record_decode = false;
    let issued = generate(&mut Session::new(&m, 0), &p, &cfg, &mut |_| {}).unwrap();
    assert_eq!(m.replay_stats(), Default::default(), "record_decode off");
    m.record_decode = true;
    let replayed = generate(&mut Session::new(&m, 0), &p, &cfg, &mut |_| {}).unwrap();
    let st = m.replay_stats();
    eprintln!("{st:?}");
    assert_eq!(replayed.tokens, issued.tokens, "replayed vs issued");
    // First sightings: the prompt's one chunk, the first step, and the first step after the
    // full caches doubled past 64 slots (new buffers: a new key), which the next records.
    assert_eq!(st.declined, 3, "{st:?}");
    assert_eq!(st.recorded, 2, "{st:?}");
    assert_eq!(st.recorded + st.replayed + st.declined, n, "{st:?}");
    // With the drafter's store kept, each step also returns the target layers' rows, which
    // wait in the session (up to 64 positions) before they become store rows: a replay must
    // hand out copies, not the recording's buffers that the next replay overwrites.
    let d = DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&m.config, 2, 4), 5), &m)
        .unwrap();
    let store_rows = |model: &GemmaModel| {
        let before = model.replay_stats().replayed;
        let mut s = Session::with_kv(model, KvSetup::full(0).drafter(&d)).unwrap();
        let g = generate(&mut s, &p, &cfg, &mut |_| {}).unwrap();
        let replays = model.replay_stats().replayed - before;
        let store = s.store_mut().unwrap().expect("the drafter's store");
        let (k, v) = store.read(0..store.len()).unwrap();
        (g.tokens, host(k), host(v), replays)
    };
    let with_store = store_rows(&m);
    m.record_decode = false;
    let issued_store = store_rows(&m);
    eprintln!("with the store: {} replays", with_store.3);
    assert!(
        with_store.3 > 0 && issued_store.3 == 0,
        "replays {}",
        with_store.3
    );
    assert_eq!(with_store.0, issued.tokens, "tokens with the store");
    assert!(
        with_store.1 == issued_store.1 && with_store.2 == issued_store.2,
        "store rows"
    );
}

/// Records the drafts a proposer makes.
struct Logged<'d> {
    inner: DFlashProposer<'d>,
    drafts: Vec<Vec<u32>>,
}

impl Proposer for Logged<'_> {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut kakeya_runtime::kv::CompactStore>,
    ) -> kakeya_runtime::Result<Vec<u32>> {
        let d = self.inner.propose(tokens, n, store)?;
        self.drafts.push(d.clone());
        Ok(d)
    }

    fn drafter(&self) -> Option<&DFlashDrafter> {
        self.inner.drafter()
    }
}

/// The drafter's drafts recorded once and replayed (attending over the store's whole buffers,
/// masked past the length each replay reads) are the drafts issued kernel by kernel, and the
/// store rows appended by recorded steps are the issued appends' bits: across
/// the store's doubling past 64 rows (new buffers: a new recording), blocks shortened by
/// the token budget, fixed and adaptive schedules. Speculative decoding commits plain
/// decoding's tokens either way.
#[test]
fn recorded_drafts_equal_the_drafts_issued_one_by_one() {
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    // Random weights draft the mask token (whose embedding the tied head scores highest)
    // whatever the context; sharper attention with larger outputs makes the drafts depend on
    // which context rows each query picks.
    let mut ck = random_drafter(&drafter_config(&v.config, 2, 8), 5);
    for (name, t) in ck.tensors.iter_mut() {
        let by = match name.rsplit('.').nth(1) {
            Some("o_proj") => 30.0,
            Some("q_norm") => 5.0,
            _ => 1.0,
        };
        t.data.iter_mut().for_each(|x| *x *= by);
    }
    let d = DFlashDrafter::from_checkpoint(ck, &v).unwrap();
    assert!(d.replays_drafts(), "a GPU drafter records");
    let mut issued_d = d.clone();
    issued_d.record_drafts = false;
    let p = tiny_prompt(3, 30);
    let cfg = kakeya_runtime::GenerationConfig::greedy(90, 16);
    let want = generate(&mut Session::new(&v, 0), &p, &cfg, &mut |_| {}).unwrap();
    // The random drafter's drafts are never accepted: the adaptive schedule soon stops
    // drafting, fixed ones draft at every block.
    for spec in [
        SpecConfig::fixed(8),
        SpecConfig::fixed(4),
        SpecConfig::adaptive(8),
    ] {
        let run = |drafter: &DFlashDrafter| {
            let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(drafter), 8).unwrap();
            let mut proposer = Logged {
                inner: DFlashProposer::new(drafter),
                drafts: Vec::new(),
            };
            let g =
                speculative_generate(&mut ver, &mut proposer, &p, &cfg, spec, &mut |_| {}).unwrap();
            let store = ver.store_mut().unwrap().expect("the drafter's store");
            let (k, v) = store.read(0..store.len()).unwrap();
            (g.tokens, proposer.drafts, host(k), host(v))
        };
        let before = d.replay_stats();
        let replayed = run(&d);
        let st = d.replay_stats();
        let issued = run(&issued_d);
        eprintln!(
            "{spec:?}: {} drafts; drafts so far {st:?}",
            replayed.1.len()
        );
        eprintln!("{:?}", &replayed.1[..6.min(replayed.1.len())]);
        assert_eq!(replayed.0, want.tokens, "{spec:?}: tokens");
        assert_eq!(issued.0, want.tokens, "{spec:?}: tokens, issued");
        assert_eq!(replayed.1, issued.1, "{spec:?}: drafts, replayed vs issued");
        // The store rows appended by recorded steps are the issued appends' bits.
        assert!(
            replayed.2 == issued.2 && replayed.3 == issued.3,
            "{spec:?}: store rows, replayed vs issued appends"
        );
        if spec.schedule == kakeya_runtime::Schedule::Fixed {
            assert!(
                st.replayed > before.replayed + replayed.1.len() / 2,
                "{spec:?}: most drafts replayed: {st:?}"
            );
        }
    }
    assert!(
        d.replay_stats().recorded >= 2,
        "a recording per store buffer"
    );
    assert_eq!(
        issued_d.replay_stats(),
        Default::default(),
        "record_drafts off"
    );
    let appends = d.append_replay_stats();
    eprintln!("store appends: {appends:?}");
    assert!(appends.replayed > 100, "appends replayed: {appends:?}");
    assert_eq!(issued_d.append_replay_stats(), Default::default());
}

/// `KAKEYA_DECODE_STEPS` greedy tokens from a prompt of 8 on the device: `scripts/kernel_count.sh`
/// runs it at two step counts with CubeCL's kernel log on and takes the difference, the kernels
/// one decode step launches (with and without Burn's fusion; `KAKEYA_DECODE_GRAPH=0`: every
/// step issued, none replayed). Prints the decode rate.
#[test]
#[ignore = "run by scripts/kernel_count.sh, with CubeCL's kernel log on"]
fn decode_steps_for_the_kernel_count() {
    let steps = env_count("KAKEYA_DECODE_STEPS", 4);
    let mut m = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    // KAKEYA_DECODE_GRAPH=0: every step issued kernel by kernel, not replayed.
    m.record_decode = std::env::var("KAKEYA_DECODE_GRAPH").as_deref() != Ok("0");
    let g = generate(
        &mut Session::new(&m, 0),
        &tiny_prompt(0, 8),
        &kakeya_runtime::GenerationConfig::greedy(steps, 512),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(g.tokens.len(), steps);
    eprintln!(
        "{steps} tokens, record_decode {}: decode {:.1} tok/s",
        m.record_decode, g.stats.decode_tok_s
    );
}

/// `KAKEYA_DECODE_STEPS` greedy tokens for each of `KAKEYA_DECODE_SEQS` prompts of 8, decoded
/// together in stacked forwards (`generate_batch`, the server's batched step), by a tiny model
/// with the 270M model's attention shape (one KV head, a window longer than the sequences):
/// `scripts/kernel_count.sh batch` counts one batched step's launches as above.
#[test]
#[ignore = "run by scripts/kernel_count.sh, with CubeCL's kernel log on"]
fn batched_decode_steps_for_the_kernel_count() {
    let (steps, seqs) = (
        env_count("KAKEYA_DECODE_STEPS", 4),
        env_count("KAKEYA_DECODE_SEQS", 8),
    );
    // The 270M model's attention shape: one KV head, a window no sequence here fills.
    let mut c = tiny_config(64);
    c.num_key_value_heads = 1;
    let mut m = GemmaModel::from_checkpoint(random_checkpoint(&c, 11), &gpu()).unwrap();
    // KAKEYA_DECODE_GRAPH=0: every step issued kernel by kernel, not replayed.
    m.record_decode = std::env::var("KAKEYA_DECODE_GRAPH").as_deref() != Ok("0");
    let prompts: Vec<Vec<u32>> = (0..seqs).map(|i| tiny_prompt(i, 8)).collect();
    let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut sessions: Vec<Session> = (0..seqs).map(|_| Session::new(&m, 0)).collect();
    let cfg = kakeya_runtime::GenerationConfig::greedy(steps, 512);
    let gens = kakeya_runtime::generate_batch(&mut sessions, &prompts, &cfg).unwrap();
    assert!(gens.iter().all(|g| g.tokens.len() == steps));
    eprintln!(
        "{seqs} sequences × {steps} tokens, record_decode {}: {:.1} tok/s in all",
        m.record_decode,
        gens.iter().map(|g| g.stats.decode_tok_s).sum::<f64>()
    );
}

/// `KAKEYA_DECODE_STEPS` drafts of a block of 8 over a store of 40 rows on the device:
/// `scripts/kernel_count.sh draft` runs it at two counts with CubeCL's kernel log on and takes
/// the difference, the kernels one draft launches (`KAKEYA_DECODE_GRAPH=0`: every draft
/// issued, none replayed).
#[test]
#[ignore = "run by scripts/kernel_count.sh, with CubeCL's kernel log on"]
fn drafts_for_the_kernel_count() {
    let steps = env_count("KAKEYA_DECODE_STEPS", 4);
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    let mut d =
        DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 8), 5), &v)
            .unwrap();
    d.record_drafts = std::env::var("KAKEYA_DECODE_GRAPH").as_deref() != Ok("0");
    let w = d.context_width();
    let mut store = kakeya_runtime::kv::CompactStore::new(w, None, &gpu());
    let rows = Tensor::<2>::ones([40, w], &gpu()).mul_scalar(0.1);
    store.append(rows.clone(), rows).unwrap();
    let mut block = vec![d.config.mask_token_id; 8];
    block[0] = 5;
    for _ in 0..steps {
        assert_eq!(d.draft(&block, &mut store).unwrap().len(), 7);
    }
    eprintln!("{steps} drafts: {:?}", d.replay_stats());
}

/// Speculative decoding of `KAKEYA_DECODE_STEPS` tokens (fixed blocks of 8 drafted by a random
/// drafter, whose drafts are rejected: one block a token): `scripts/kernel_count.sh spec` runs
/// it at two counts with CubeCL's kernel log on and takes the difference, the kernels one
/// block launches from the host — verify, draft, the store's new row and the session's
/// bookkeeping (`KAKEYA_DECODE_GRAPH=0`: the verifier and drafter issue every kernel;
/// `KAKEYA_DRAFT_GRAPH=0`: the drafter does).
#[test]
#[ignore = "run by scripts/kernel_count.sh, with CubeCL's kernel log on"]
fn speculative_blocks_for_the_kernel_count() {
    let steps = env_count("KAKEYA_DECODE_STEPS", 4);
    let graph = std::env::var("KAKEYA_DECODE_GRAPH").as_deref() != Ok("0");
    let mut v = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    v.record_decode = graph;
    let mut d =
        DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 8), 5), &v)
            .unwrap();
    // KAKEYA_DRAFT_GRAPH=0: the drafter issues its kernels while the verifier replays.
    d.record_drafts = graph && std::env::var("KAKEYA_DRAFT_GRAPH").as_deref() != Ok("0");
    let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), 8).unwrap();
    let cfg = kakeya_runtime::GenerationConfig::greedy(steps, 16);
    let g = speculative_generate(
        &mut ver,
        &mut DFlashProposer::new(&d),
        &tiny_prompt(1, 8),
        &cfg,
        SpecConfig::fixed(8),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(g.tokens.len(), steps);
    eprintln!(
        "{steps} tokens: verifier {:?}, drafts {:?}, appends {:?}",
        v.replay_stats(),
        d.replay_stats(),
        d.append_replay_stats()
    );
}
