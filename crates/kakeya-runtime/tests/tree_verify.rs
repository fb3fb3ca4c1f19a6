//! Tree verification on tiny random models: each row of a tree forward is bit for bit the
//! last row of a plain forward of the path to it (dense and quantised weights, windows that
//! wrap inside the tree); keeping a path leaves every cache as plain decoding of that path
//! would (the same logits from then on), in every KV mode but those that rebuild K/V with
//! f_θ, which refuse trees.

mod common;

use burn::tensor::{Device, Tensor};
use common::{random_f_theta_restorer, tiny_prompt};
use kakeya_models::testing::{
    drafter_config, random_checkpoint, random_drafter, random_quantized_checkpoint, tiny_config,
};
use kakeya_models::{DFlashDrafter, GemmaModel, Logits, TreeRows};
use kakeya_runtime::kv::{KvMode, KvPolicy};
use kakeya_runtime::{KvSetup, Session};

/// A seeded xorshift.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A random tree of `rows` rows (parents before children) and its tokens (below 90), the
/// root's token `root`.
fn random_tree(rng: &mut Rng, rows: usize, root: u32) -> (Vec<usize>, Vec<u32>) {
    let parents: Vec<usize> = (0..rows)
        .map(|i| if i == 0 { 0 } else { rng.below(i) })
        .collect();
    let tokens: Vec<u32> = (0..rows)
        .map(|i| if i == 0 { root } else { rng.below(90) as u32 })
        .collect();
    (parents, tokens)
}

fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [n, v] = t.dims();
    let flat = t.into_data().try_into_vec::<f32>().unwrap();
    (0..n).map(|i| flat[i * v..(i + 1) * v].to_vec()).collect()
}

fn models(window: usize) -> [(GemmaModel, &'static str); 2] {
    let config = tiny_config(window);
    let device = Device::flex();
    [
        (
            GemmaModel::from_checkpoint(random_checkpoint(&config, 11), &device).unwrap(),
            "dense",
        ),
        (
            GemmaModel::from_checkpoint(random_quantized_checkpoint(&config, 3), &device).unwrap(),
            "quantised",
        ),
    ]
}

#[test]
fn a_trees_rows_are_bit_for_bit_forwards_of_their_paths() {
    let mut rng = Rng(0x9e37_79b9);
    for window in [4, 64] {
        for (m, what) in models(window) {
            for (case, prompt_len) in [9usize, 40].into_iter().enumerate() {
                let p = tiny_prompt(case, prompt_len);
                let n = 2 + rng.below(15);
                let (parents, tokens) = random_tree(&mut rng, n, 7);
                let tree = TreeRows::new(&parents).unwrap();
                let mut s = Session::new(&m, 16);
                s.run(&p, 16).unwrap();
                let out = s.forward_tree(&tokens, &tree, Logits::All, None).unwrap();
                let got = rows(out.logits.unwrap());
                for (i, row) in got.iter().enumerate() {
                    let path: Vec<u32> = tree.path_to(i).iter().map(|&j| tokens[j]).collect();
                    let mut plain = Session::new(&m, 16);
                    plain.run(&p, 16).unwrap();
                    let want = rows(
                        plain
                            .forward(&path, Logits::All, None, &[])
                            .unwrap()
                            .logits
                            .unwrap(),
                    );
                    assert!(
                        row == want.last().unwrap(),
                        "{what}, window {window}, prompt {prompt_len}: row {i} of {parents:?}"
                    );
                }
            }
        }
    }
}

fn drafter(v: &GemmaModel) -> DFlashDrafter {
    let c = drafter_config(&v.config, 2, 8);
    DFlashDrafter::from_checkpoint(random_drafter(&c, 5), v).unwrap()
}

/// Verifies random trees and keeps a random path of each, beside a session that decodes the
/// same paths step by step: the kept rows' logits are those steps', and after the last tree
/// both sessions compute the same logits (their capacities may differ: a tree's rows reserve
/// room as a chain block's do). Returns the error of the first refused tree.
fn trees_against_steps(
    m: &GemmaModel,
    setup: KvSetup<'_>,
    rng: &mut Rng,
    what: &str,
) -> Result<(), String> {
    let mut tree_side = Session::with_kv(m, setup).unwrap();
    let mut step_side = Session::with_kv(m, setup).unwrap();
    let p = tiny_prompt(rng.below(50), 20 + rng.below(30));
    tree_side.run(&p, 16).unwrap();
    step_side.run(&p, 16).unwrap();
    let mut last = 5u32;
    for round in 0..12 {
        let n = 1 + rng.below(16);
        let (parents, tokens) = random_tree(rng, n, last);
        let tree = TreeRows::new(&parents).unwrap();
        let out = tree_side
            .forward_tree(&tokens, &tree, Logits::All, None)
            .map_err(|e| e.to_string())?;
        let got = rows(out.logits.unwrap());
        let leaf = rng.below(n);
        let path = tree.path_to(leaf);
        tree_side.keep_path(&path).unwrap();
        for &j in &path {
            let want = step_side.run(&[tokens[j]], 1).unwrap();
            assert!(
                got[j] == want,
                "{what}, round {round}: row {j} on the path {path:?} of {parents:?}"
            );
        }
        assert_eq!(tree_side.len(), step_side.len(), "{what}, round {round}");
        last = rng.below(90) as u32;
    }
    for t in [last, 3, 50] {
        let (a, b) = (
            tree_side.run(&[t], 1).unwrap(),
            step_side.run(&[t], 1).unwrap(),
        );
        assert!(a == b, "{what}: a step after the trees");
    }
    Ok(())
}

#[test]
fn keeping_a_path_leaves_the_caches_as_plain_decoding_would() {
    let mut rng = Rng(0x51f1_5eed);
    for window in [4, 64] {
        for (m, what) in models(window) {
            trees_against_steps(&m, KvSetup::full(16), &mut rng, what).unwrap();
        }
    }
}

#[test]
fn every_mode_but_f_thetas_keeps_paths_as_plain_decoding_would() {
    let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(24), 11), &Device::flex())
        .unwrap();
    let d = drafter(&m);
    let r = random_f_theta_restorer(&m, &d);
    let mut rng = Rng(0xdead_beef);
    for mode in KvMode::all() {
        let policy = KvPolicy {
            sink: 2,
            window: 16,
            ..KvPolicy::new(mode)
        };
        let setup = KvSetup {
            slack: 16,
            ..KvSetup::new(policy).drafter(&d).restorer(&r)
        };
        let what = format!("{mode}");
        match trees_against_steps(&m, setup, &mut rng, &what) {
            Ok(()) => assert!(!mode.restores(), "{mode} ran a tree"),
            Err(e) => {
                assert!(mode.restores(), "{mode}: {e}");
                assert!(e.contains("verify chains, not trees"), "{mode}: {e}");
            }
        }
    }
}

#[test]
fn a_forward_before_the_path_is_kept_is_refused() {
    let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 11), &Device::flex())
        .unwrap();
    let mut s = Session::new(&m, 16);
    s.run(&tiny_prompt(0, 10), 16).unwrap();
    let tree = TreeRows::new(&[0, 0, 0, 1]).unwrap();
    s.forward_tree(&[1, 2, 3, 4], &tree, Logits::Last, None)
        .unwrap();
    let e = s.run(&[5], 1).unwrap_err().to_string();
    assert!(e.contains("must be kept"), "{e}");
    let e = s.truncate(12).unwrap_err().to_string();
    assert!(e.contains("inside a verified tree"), "{e}");
    let e = s.keep_path(&[0, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("not a path"), "{e}");
    // A refused path leaves the tree to keep.
    s.keep_path(&[0, 1, 3]).unwrap();
    assert_eq!(s.len(), 13);
    // Dropping the whole tree is a truncate to its start.
    s.forward_tree(&[1, 2, 3, 4], &tree, Logits::Last, None)
        .unwrap();
    s.truncate(13).unwrap();
    assert_eq!(s.len(), 13);
    s.run(&[5], 1).unwrap();
}
