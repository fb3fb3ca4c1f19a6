use super::*;
use burn::tensor::{Device, TensorData};

/// Keys of the one source 0.
fn sourced(rows: &[usize]) -> Vec<SourcedKey> {
    rows.iter()
        .map(|&row| SourcedKey { source: 0, row })
        .collect()
}

fn tensor(dims: [usize; 3], seed: u32) -> Tensor<3> {
    let mut z = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
    let vals: Vec<f32> = (0..dims.iter().product::<usize>())
        .map(|_| {
            z = z.wrapping_mul(1_103_515_245).wrapping_add(12345);
            ((z >> 8) & 0xffff) as f32 / 32768.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(vals, dims), &Device::flex())
}

/// Burn's tensor ops over the same keys: query row `[heads, 1, dim]` against rows `keys` of
/// `k`/`v`, as `[heads · dim]`.
fn reference(
    q: Tensor<3>,
    (k, v): (&Tensor<3>, &Tensor<3>),
    keys: &[usize],
    scale: f32,
) -> Vec<f32> {
    let ids: Vec<i64> = keys.iter().map(|&j| j as i64).collect();
    let ids = Tensor::<1, burn::tensor::Int>::from_data(
        TensorData::new(ids, [keys.len()]),
        &Device::flex(),
    );
    let want = crate::sdpa::grouped_attention(
        q,
        k.clone().select(1, ids.clone()),
        v.clone().select(1, ids),
        f64::from(scale),
        None,
    );
    want.into_data().try_to_vec().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

#[test]
fn a_row_matches_the_tensor_ops_reference() {
    // Four query heads over one key/value head (Gemma 3 270M's grouping), odd sizes.
    let (heads, kvh, s, d) = (4, 1, 37, 72);
    let q = tensor([heads, 3, d], 1);
    // Keys as a view into a larger cache (offset and stride), as the caches hand them out.
    let k_all = tensor([kvh, s + 9, d], 2);
    let v_all = tensor([kvh, s + 9, d], 3);
    let k = k_all.slice([0..kvh, 4..4 + s, 0..d]);
    let v = v_all.slice([0..kvh, 4..4 + s, 0..d]);
    let (qv, kv, vv) = (
        HostView::of(&q).unwrap(),
        HostView::of(&k).unwrap(),
        HostView::of(&v).unwrap(),
    );
    let keys: Vec<usize> = (0..s).filter(|j| j % 5 != 2).collect();
    let scale = 0.125f32;
    let mut out = vec![0.0f32; heads * d];
    attend_row(
        &qv,
        (1, kvh),
        &[RowSource::View { k: kv, v: vv }],
        &sourced(&keys),
        scale,
        &mut out,
    )
    .unwrap();
    let want = reference(q.slice([0..heads, 1..2, 0..d]), (&k, &v), &keys, scale);
    let worst = max_abs_diff(&out, &want);
    assert!(worst < 1e-5, "max |Δ| {worst}");
}

#[test]
fn f16_keys_and_values_take_the_f32_arithmetic_of_their_rounded_values() {
    // More keys than one tile, a gathered (non-run) key list, and a run.
    let (heads, kvh, s, d) = (4, 1, 150, 72);
    let q = tensor([heads, 2, d], 4);
    let (k, v) = (tensor([kvh, s, d], 5), tensor([kvh, s, d], 6));
    let (k16, v16) = (
        k.clone().cast(burn::tensor::DType::F16),
        v.clone().cast(burn::tensor::DType::F16),
    );
    // The rounded values, held as f32.
    let (kr, vr) = (
        k16.clone().cast(burn::tensor::DType::F32),
        v16.clone().cast(burn::tensor::DType::F32),
    );
    let qv = HostView::of(&q).unwrap();
    let scale = 0.1f32;
    for keys in [
        (0..s).collect::<Vec<_>>(),
        (0..s).filter(|j| j % 3 != 1).collect(),
    ] {
        let run = |k: &Tensor<3>, v: &Tensor<3>| {
            let mut out = vec![0.0f32; heads * d];
            let (k, v) = (HostView::of(k).unwrap(), HostView::of(v).unwrap());
            let keys = sourced(&keys);
            attend_row(
                &qv,
                (1, kvh),
                &[RowSource::View { k, v }],
                &keys,
                scale,
                &mut out,
            )
            .unwrap();
            out
        };
        let (half, rounded, exact) = (run(&k16, &v16), run(&kr, &vr), run(&k, &v));
        assert_eq!(
            half, rounded,
            "the same bits as f32 rows of the rounded values"
        );
        let worst = max_abs_diff(&half, &exact);
        // Inputs in [-1, 1] rounded to f16 (relative error ≤ 2^-11): a few 1e-3 at most.
        assert!(worst < 5e-3, "max |Δ| against unrounded f32 {worst}");
    }
}

#[test]
fn a_long_row_splits_into_spans_whose_bits_do_not_depend_on_the_threads() {
    // 2.5 spans of keys, some skipped: the spans' merge against the tensor ops, and the
    // same bits on one thread as on several.
    let (heads, kvh, s, d) = (4, 1, KEY_SPAN * 5 / 2 + 7, 40);
    let q = tensor([heads, 1, d], 11);
    let (k, v) = (tensor([kvh, s, d], 12), tensor([kvh, s, d], 13));
    let keys: Vec<usize> = (0..s).filter(|j| j % 7 != 3).collect();
    let run = || {
        let mut out = vec![0.0f32; heads * d];
        let src = [RowSource::View {
            k: HostView::of(&k).unwrap(),
            v: HostView::of(&v).unwrap(),
        }];
        let qv = HostView::of(&q).unwrap();
        attend_row(&qv, (0, kvh), &src, &sourced(&keys), 0.3, &mut out).unwrap();
        out
    };
    let many = run();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(run);
    assert_eq!(many, one, "one thread or several");
    let worst = max_abs_diff(&many, &reference(q.clone(), (&k, &v), &keys, 0.3));
    assert!(worst < 1e-5, "max |Δ| {worst}");
}

/// Rows held by position from `first` (one KV head), values optionally held as
/// `−reverse(v)` (an orthogonal map whose inverse changes no bit).
struct Tier {
    k: Vec<f32>,
    v: Vec<f32>,
    first: usize,
    dim: usize,
    rotated: bool,
}

impl HostTier for Tier {
    fn read_head(
        &self,
        part: KvPart,
        _head: usize,
        positions: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let d = self.dim;
        let src = if part == KvPart::K { &self.k } else { &self.v };
        let rows = &src[(positions.start - self.first) * d..(positions.end - self.first) * d];
        out.copy_from_slice(rows);
        if part == KvPart::V && self.rotated {
            for r in out.chunks_exact_mut(d) {
                r.reverse();
                r.iter_mut().for_each(|x| *x = -*x);
            }
        }
        Ok(())
    }

    fn values_rotated(&self) -> bool {
        self.rotated
    }

    fn undo_values(&self, row: &mut [f32]) {
        row.reverse();
        row.iter_mut().for_each(|x| *x = -*x);
    }
}

#[test]
fn keys_split_over_views_and_a_tier_give_the_bits_of_one_view() {
    // 150 keys: rows 0..40 and 100..150 from views, 40..100 from a tier (a tile boundary
    // falls inside it), rotated or not.
    let (heads, s, d) = (4, 150, 72);
    let q = tensor([heads, 2, d], 7);
    let (k, v) = (tensor([1, s, d], 8), tensor([1, s, d], 9));
    let qv = HostView::of(&q).unwrap();
    let whole: Vec<f32> = {
        let mut out = vec![0.0f32; heads * d];
        let src = [RowSource::View {
            k: HostView::of(&k).unwrap(),
            v: HostView::of(&v).unwrap(),
        }];
        let keys: Vec<usize> = (0..s).collect();
        attend_row(&qv, (1, 1), &src, &sourced(&keys), 0.1, &mut out).unwrap();
        out
    };
    let host = |t: &Tensor<3>, r: std::ops::Range<usize>| -> Vec<f32> {
        t.clone()
            .slice([0..1, r, 0..d])
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    for rotated in [false, true] {
        let tier = Tier {
            k: host(&k, 40..100),
            v: host(&v, 40..100),
            first: 40,
            dim: d,
            rotated,
        };
        let view = |r: std::ops::Range<usize>| RowSource::View {
            k: HostView::of(&k.clone().slice([0..1, r.clone(), 0..d])).unwrap(),
            v: HostView::of(&v.clone().slice([0..1, r, 0..d])).unwrap(),
        };
        let src = [view(0..40), RowSource::Tier(&tier), view(100..s)];
        let keys: Vec<SourcedKey> = (0..40)
            .map(|row| SourcedKey { source: 0, row })
            .chain((40..100).map(|row| SourcedKey { source: 1, row }))
            .chain((0..50).map(|row| SourcedKey { source: 2, row }))
            .collect();
        let mut out = vec![0.0f32; heads * d];
        attend_row(&qv, (1, 1), &src, &keys, 0.1, &mut out).unwrap();
        if rotated {
            // The rotated values' sum is added to the others' once at the end.
            let worst = max_abs_diff(&out, &whole);
            assert!(worst < 1e-5, "rotated tier: max |Δ| {worst}");
        } else {
            assert_eq!(out, whole, "split over sources");
        }
    }
}

#[test]
fn rows_run_together_give_each_row_its_bits_alone() {
    // Keys over 2.3 spans from an f16 view, a rotated tier and an f32 view; rows ending at
    // tile and span boundaries and between them, two KV heads.
    let (heads, kvh, d) = (4, 2, 40);
    let s = KEY_SPAN * 2 + 300;
    let lens = [
        1,
        63,
        64,
        65,
        700,
        KEY_SPAN,
        KEY_SPAN + 1,
        2 * KEY_SPAN + 5,
        s,
    ];
    let q = tensor([heads, lens.len() + 2, d], 21);
    let (k, v) = (tensor([kvh, s, d], 22), tensor([kvh, s, d], 23));
    let host = |t: &Tensor<3>, h: usize, r: std::ops::Range<usize>| -> Vec<f32> {
        t.clone()
            .slice([h..h + 1, r, 0..d])
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    // The test tier ignores the head: both KV heads read head 0's rows there.
    let tier = Tier {
        k: host(&k, 0, 900..1500),
        v: host(&v, 0, 900..1500),
        first: 900,
        dim: d,
        rotated: true,
    };
    let half = |t: Tensor<3>| t.cast(burn::tensor::DType::F16);
    let src = [
        RowSource::View {
            k: HostView::of(&half(k.clone().slice([0..kvh, 0..900, 0..d]))).unwrap(),
            v: HostView::of(&half(v.clone().slice([0..kvh, 0..900, 0..d]))).unwrap(),
        },
        RowSource::Tier(&tier),
        RowSource::View {
            k: HostView::of(&k.clone().slice([0..kvh, 1500..s, 0..d])).unwrap(),
            v: HostView::of(&v.clone().slice([0..kvh, 1500..s, 0..d])).unwrap(),
        },
    ];
    let keys: Vec<SourcedKey> = (0..900)
        .map(|row| SourcedKey { source: 0, row })
        .chain((900..1500).map(|row| SourcedKey { source: 1, row }))
        .chain((0..s - 1500).map(|row| SourcedKey { source: 2, row }))
        .collect();
    let qv = HostView::of(&q).unwrap();
    let width = heads * d;
    let mut together = vec![0.0f32; lens.len() * width];
    attend_rows(&qv, (2, kvh), &src, (&keys, &lens), 0.2, &mut together).unwrap();
    for (r, &n) in lens.iter().enumerate() {
        let mut alone = vec![0.0f32; width];
        attend_row(&qv, (2 + r, kvh), &src, &keys[..n], 0.2, &mut alone).unwrap();
        assert_eq!(
            &together[r * width..(r + 1) * width],
            &alone[..],
            "row {r} over {n} keys"
        );
    }
}
