//! Attention over the quantised tiers of the bounded modes, against the reference that reads
//! like the formula (`Attention::attend_reference`, which reads a tier through
//! `KvLayers::deferred`, dequantised, rotated values mapped back): the CPU row loops reading
//! the packed codes in place (`AttentionRoute::Host`) and the tiled route over dequantised
//! tiles (`AttentionRoute::Tiled`), on a tiny Gemma's global layer, for decode steps, verify
//! blocks and prompt chunks (1, 5 and 20 rows) after 300 positions. Tolerance: 1e-5 relative to
//! max(|reference|, 1), the f32 rounding of the routes' sums.

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::gemma::attention::AttentionRoute;
use kakeya_models::testing::{random_checkpoint, tiny_config, values};
use kakeya_models::{GemmaModel, KvLayers, SegmentKv};
use kakeya_runtime::kv::{KvPolicy, SequenceKv};

mod common;
use common::host;

const TOLERANCE: f32 = 1e-5;

/// `shape` values in [-2, 2) from `seed`.
fn tensor3(shape: [usize; 3], seed: u64) -> Tensor<3> {
    let n = shape.iter().product();
    let v = values(n, &mut { seed }, 2.0);
    Tensor::from_data(TensorData::new(v, shape), &Device::flex())
}

#[test]
fn host_loops_and_tiles_over_quantised_tiers_match_the_reference() {
    let device = Device::flex();
    let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 3), &device).unwrap();
    let c = &m.config;
    let layer = 5;
    let a = &m.layers[layer].attn;
    let widths: Vec<usize> = (0..c.num_hidden_layers).map(|i| c.kv_width_of(i)).collect();
    let dims: Vec<usize> = (0..c.num_hidden_layers).map(|i| c.head_dim_of(i)).collect();
    let (kvh, d) = (a.kv_heads, a.head_dim);
    for mode in [
        "bounded-k8v4",
        "bounded-k4v3",
        "bounded-k2v2-mixed",
        "quant4",
        "quant4-all",
    ] {
        for t in [1, 5, 20] {
            let what = format!("{mode}, {t} rows");
            let policy = KvPolicy::new(mode.parse().unwrap());
            let mut kv =
                SequenceKv::new(&m.cache_specs(), (&widths, &dims), &policy, 0, None, None);
            let start = 300;
            let mut at = 0;
            while at < start {
                let n = 64.min(start - at);
                let seed = at as u64;
                kv.update(
                    layer,
                    tensor3([kvh, n, d], seed),
                    tensor3([kvh, n, d], seed + 1),
                    at,
                )
                .unwrap();
                at += n;
            }
            let (k, v) = (tensor3([kvh, t, d], 7), tensor3([kvh, t, d], 8));
            let segments = kv.update(layer, k, v, start).unwrap();
            assert!(
                segments.iter().any(|s| matches!(s.kv, SegmentKv::Deferred)),
                "{what}: a quantised tier"
            );
            let q = tensor3([a.heads, t, d], 9);
            let caches = (&mut kv as &mut dyn KvLayers, layer);
            let want = host(
                a.attend_reference(&q, start, &segments, caches, &device)
                    .unwrap(),
            );
            for route in [AttentionRoute::Host, AttentionRoute::Tiled] {
                let caches = (&mut kv as &mut dyn KvLayers, layer);
                let got = a
                    .attend_by(route, &q, (start, None), &segments, caches, &device)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{what}: {route:?} declined"));
                let err = host(got)
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
                    .fold(0.0f32, f32::max);
                assert!(
                    err <= TOLERANCE,
                    "{what}: {route:?} is {err} from the reference"
                );
            }
        }
    }
}
