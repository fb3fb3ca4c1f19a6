//! Every route of a layer's attention (`AttentionRoute`: the CPU row loops, the tiled route
//! over deferred K/V, the per-row and masked tensor routes) against the reference that reads
//! like the formula (`Attention::attend_reference`: plain loops, f64 sums), on a tiny Gemma's
//! sliding and global layers: one segment, segments with complementary reaches (a bounded
//! cache's degraded copy and exact recent window), 16-bit K/V, deferred K/V with and without
//! rotated values, chunks longer than the per-row route takes. Tolerance: 1e-5 relative to
//! max(|reference|, 1), the f32 rounding of the routes' sums (values in about [-2, 2]).

use burn::tensor::{DType, Device, Tensor};
use kakeya_models::gemma::attention::{Attention, AttentionRoute};
use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_models::{
    DeferredKv, GemmaModel, KvLayers, KvPart, KvSegment, LayerCache, Reach, Result, SegmentKv,
};

mod common;
use common::{host, max_rel, tensor, values};

const TOLERANCE: f32 = 1e-5;

/// One layer's K/V held whole, handed out as the deferred segment's tiles (with its values
/// rotated by an orthogonal matrix when `rotation` is set), and no host storage: what a cache
/// whose older positions are rebuilt looks like to attention.
struct Held {
    k: Tensor<3>,
    v: Tensor<3>,
    /// (rotation, its inverse), `[head_dim, head_dim]` each.
    rotation: Option<(Tensor<2>, Tensor<2>)>,
}

impl LayerCache for Held {
    fn update(&mut self, _: Tensor<3>, _: Tensor<3>, _: usize) -> Result<Vec<KvSegment>> {
        unreachable!("the tests hand attention their segments")
    }

    fn len(&self) -> usize {
        self.k.dims()[1]
    }

    fn truncate(&mut self, _: usize) -> Result<()> {
        Ok(())
    }

    fn nbytes(&self) -> usize {
        0
    }

    fn deferred(&mut self, at: std::ops::Range<usize>, part: KvPart) -> Result<DeferredKv> {
        let [kvh, _, d] = self.k.dims();
        let rows = |t: &Tensor<3>| t.clone().slice([0..kvh, at.clone(), 0..d]);
        Ok(match (part, &self.rotation) {
            (KvPart::K, _) => DeferredKv::Ready(rows(&self.k)),
            (KvPart::V, None) => DeferredKv::Ready(rows(&self.v)),
            (KvPart::V, Some((rot, undo))) => DeferredKv::Rotated {
                v: rows(&self.v).matmul(rot.clone().unsqueeze::<3>().repeat_dim(0, kvh)),
                undo: undo.clone(),
            },
        })
    }
}

/// A 16×16 Hadamard matrix over 4: orthogonal, its own inverse.
fn hadamard16() -> Tensor<2> {
    let h: Vec<f32> = (0..256u32)
        .map(|i| {
            let (r, c) = (i / 16, i % 16);
            if (r & c).count_ones() % 2 == 0 {
                0.25
            } else {
                -0.25
            }
        })
        .collect();
    tensor::<2>(h, [16, 16], &Device::flex())
}

/// `[kv_heads, n, head_dim]` values for positions `0..n`.
fn kv(a: &Attention, n: usize, seed: u32) -> Tensor<3> {
    let shape = [a.kv_heads, n, a.head_dim];
    tensor::<3>(values(shape.iter().product(), seed), shape, &Device::flex())
}

/// Positions `r` of `t` (`[kv_heads, n, head_dim]`).
fn at(t: &Tensor<3>, r: std::ops::Range<usize>) -> Tensor<3> {
    let [kvh, _, d] = t.dims();
    t.clone().slice([0..kvh, r, 0..d])
}

/// The exact recent positions 30..45 of `k` and `v`, read by queries fewer than 6 past them.
fn recent(k: &Tensor<3>, v: &Tensor<3>) -> KvSegment {
    KvSegment::ready(
        at(k, 30..45),
        at(v, 30..45),
        (30..45).collect(),
        Reach::Younger(6),
    )
}

/// Runs every route on a chunk of `t` queries at `start` over `segments`; checks that the
/// routes in `applies` run and match the reference, and that the others decline.
fn check(
    a: &Attention,
    (start, t): (usize, usize),
    segments: &[KvSegment],
    held: &mut dyn KvLayers,
    applies: &[AttentionRoute],
    what: &str,
) {
    let device = Device::flex();
    let shape = [a.heads, t, a.head_dim];
    let q = tensor::<3>(values(shape.iter().product(), 7), shape, &device);
    let want = host(
        a.attend_reference(&q, start, segments, (&mut *held, 0), &device)
            .unwrap(),
    );
    for route in AttentionRoute::ALL {
        let got = a
            .attend_by(route, &q, (start, None), segments, (&mut *held, 0), &device)
            .unwrap();
        match got {
            Some(out) => {
                assert!(applies.contains(&route), "{what}: {route:?} ran");
                let err = max_rel(&host(out), &want);
                assert!(
                    err <= TOLERANCE,
                    "{what}: {route:?} is {err} from the reference"
                );
            }
            None => assert!(!applies.contains(&route), "{what}: {route:?} declined"),
        }
    }
}

fn layers() -> Vec<Attention> {
    let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 3), &Device::flex())
        .unwrap();
    // Layer 0 slides over 8 positions; layer 5 is global.
    vec![m.layers[0].attn.clone(), m.layers[5].attn.clone()]
}

#[test]
fn every_route_matches_the_reference_over_ready_segments() {
    use AttentionRoute::{Host, Masked, Rows};
    for a in layers() {
        let kind = format!("{:?} layer", a.kind);
        let (k, v) = (kv(&a, 60, 1), kv(&a, 60, 2));
        let mut held: Vec<Held> = Vec::new();
        // One segment of every position; a chunk of 5 rows, then of 20 (no per-row route).
        for (start, t, applies) in [
            (35, 5, &[Host, Rows, Masked][..]),
            (40, 20, &[Host, Masked]),
        ] {
            let n = start + t;
            let one = [KvSegment::ready(
                at(&k, 0..n),
                at(&v, 0..n),
                (0..n).collect(),
                Reach::Always,
            )];
            check(
                &a,
                (start, t),
                &one,
                &mut held,
                applies,
                &format!("{kind}, {t} rows"),
            );
            // The same in 16 bits: each route reads the rounded values.
            let half = |x: Tensor<3>| x.cast(DType::F16);
            let f16 = [KvSegment::ready(
                half(at(&k, 0..n)),
                half(at(&v, 0..n)),
                (0..n).collect(),
                Reach::Always,
            )];
            check(
                &a,
                (start, t),
                &f16,
                &mut held,
                applies,
                &format!("{kind}, {t} rows, f16"),
            );
        }
        // A degraded copy of positions 0..40 read by queries at least 6 past them, and the
        // exact recent positions 30..45 read by the younger ones.
        let (k2, v2) = (kv(&a, 60, 3), kv(&a, 60, 4));
        let two = [
            KvSegment::ready(
                at(&k2, 0..40),
                at(&v2, 0..40),
                (0..40).collect(),
                Reach::AtLeast(6),
            ),
            recent(&k, &v),
        ];
        check(
            &a,
            (40, 5),
            &two,
            &mut held,
            &[Host, Rows, Masked],
            &format!("{kind}, reaches"),
        );
    }
}

#[test]
fn the_tiled_route_matches_the_reference_over_deferred_segments() {
    for a in layers() {
        for rotated in [false, true] {
            let what = format!("{:?} layer, rotated values {rotated}", a.kind);
            let (k, v) = (kv(&a, 60, 5), kv(&a, 60, 6));
            let h = hadamard16();
            let mut held = vec![Held {
                k: k.clone(),
                v: v.clone(),
                rotation: rotated.then(|| (h.clone(), h.clone())),
            }];
            // Positions 0..40 deferred (read by queries at least 6 past them), 30..45 exact.
            let deferred = KvSegment {
                kv: SegmentKv::Deferred,
                positions: (0..40).collect(),
                reach: Reach::AtLeast(6),
            };

            // No host storage for the deferred tier: the CPU loops decline, the tiled route runs.
            check(
                &a,
                (40, 5),
                &[deferred, recent(&k, &v)],
                &mut held,
                &[AttentionRoute::Tiled],
                &what,
            );
        }
    }
}
