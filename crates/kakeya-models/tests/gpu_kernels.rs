//! The GPU decode kernels (`kakeya_models::gpu`) against Burn's composed ops on the CPU.
//! Built with a GPU feature and run on that device: `KAKEYA_TEST_DEVICE=wgpu cargo test -p
//! kakeya-models --features wgpu --test gpu_kernels` (scripts/test_wgpu.sh, on Mesa's lavapipe),
//! or `cuda` on a lent GPU. Tolerances are f32 rounding of the different summation orders.
#![cfg(feature = "cube")]

use burn::tensor::{Device, Tensor};
use kakeya_models::activation::gelu_tanh;
use kakeya_models::gpu::{self, GPU_ROWS_MAX};
use kakeya_models::norm::RmsNorm;
use kakeya_models::rope::Rope;

mod common;
use common::{device, host, max_rel, tensor, values};

#[test]
fn rms_norm_matches_the_composed_ops() {
    let d = device();
    // Widths below, at and above the kernel's 128 units, rows over several cubes.
    for (rows, dim) in [(1, 16), (7, 300), (3, 128), (2, 1152), (40, 256)] {
        let x = values(rows * dim, dim as u32);
        let scale: Vec<f32> = values(dim, 7).iter().map(|v| 1.0 + 0.25 * v).collect();
        let norm = |device: &Device| RmsNorm {
            scale: tensor(scale.clone(), [dim], device),
            eps: 1e-6,
        };
        let cpu =
            host(norm(&Device::flex()).forward(tensor(x.clone(), [rows, dim], &Device::flex())));
        let gpu = host(norm(&d).forward(tensor(x.clone(), [rows, dim], &d)));
        let err = max_rel(&gpu, &cpu);
        assert!(err <= 2e-6, "[{rows}, {dim}]: max rel |Δ| {err:e}");
    }
}

#[test]
fn rms_norm_of_a_strided_view_matches() {
    // q/k norms see `[heads, T, head_dim]` views after a dimension swap.
    let d = device();
    let x = values(3 * 5 * 32, 3);
    let scale = values(32, 9);
    let norm = |device: &Device| RmsNorm {
        scale: tensor(scale.clone(), [32], device),
        eps: 1e-6,
    };
    let run = |device: &Device| {
        let t = tensor::<3>(x.clone(), [5, 3, 32], device).swap_dims(0, 1);
        host(norm(device).forward(t))
    };
    let err = max_rel(&run(&d), &run(&Device::flex()));
    assert!(err <= 2e-6, "max rel |Δ| {err:e}");
}

#[test]
fn rope_matches_the_composed_ops() {
    let d = device();
    let (heads, t, hd) = (3, 5, 16);
    let x = values(heads * t * hd, 4);
    let rope = Rope::new(hd, 10_000.0, 1.0);
    let positions = [0, 3, 7, 100, 2047];
    let run = |device: &Device| {
        let (cos, sin) = rope.tables(&positions, device);
        // A strided view, as the model's heads-first tensors are.
        let x = tensor::<3>(x.clone(), [t, heads, hd], device).swap_dims(0, 1);
        host(Rope::apply(x, &cos, &sin))
    };
    let err = max_rel(&run(&d), &run(&Device::flex()));
    assert!(err <= 1e-6, "max rel |Δ| {err:e}");
}

#[test]
fn gelu_mul_halves_matches_the_composed_ops() {
    let d = device();
    let (rows, inner) = (3, 1000 + 17);
    let (g, u) = (values(rows * inner, 1), values(rows * inner, 2));
    let cpu = host(
        gelu_tanh(tensor(g.clone(), [rows, inner], &Device::flex()))
            * tensor(u.clone(), [rows, inner], &Device::flex()),
    );
    // Gate columns, then up's, per row.
    let gu: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let (g, u) = (
                &g[r * inner..(r + 1) * inner],
                &u[r * inner..(r + 1) * inner],
            );
            g.iter().chain(u).copied().collect::<Vec<_>>()
        })
        .collect();
    let gpu = host(gpu::gelu_mul_halves(&tensor(gu, [rows, 2 * inner], &d)).unwrap());
    let err = max_rel(&gpu, &cpu);
    assert!(err <= 1e-6, "max rel |Δ| {err:e}");
}

#[test]
fn rms_norm_add_and_rms_norm_rope_match_the_composed_ops() {
    let d = device();
    let (heads, t, hd) = (3, 5, 64);
    let x = values(heads * t * hd, 21);
    let r = values(heads * t * hd, 22);
    let scale: Vec<f32> = values(hd, 23).iter().map(|v| 1.0 + 0.25 * v).collect();
    let rope = Rope::new(hd, 10_000.0, 1.0);
    let run = |device: &Device| {
        let norm = RmsNorm {
            scale: tensor(scale.clone(), [hd], device),
            eps: 1e-6,
        };
        // Strided views, as the model's heads-first tensors are.
        let xs = tensor::<3>(x.clone(), [t, heads, hd], device).swap_dims(0, 1);
        let rs = tensor::<3>(r.clone(), [heads, t, hd], device);
        let (cos, sin) = rope.tables(&[0, 1, 9, 400, 4095], device);
        (
            host(norm.forward_add(xs.clone(), rs)),
            host(norm.forward_rope(xs, &cos, &sin)),
        )
    };
    let ((add_g, rope_g), (add_c, rope_c)) = (run(&d), run(&Device::flex()));
    let err = max_rel(&add_g, &add_c);
    assert!(err <= 2e-6, "norm + residual: max rel |Δ| {err:e}");
    let err = max_rel(&rope_g, &rope_c);
    assert!(err <= 2e-6, "norm + RoPE: max rel |Δ| {err:e}");
}

#[test]
fn linear_rows_matches_the_matmul_and_ignores_the_row_count() {
    let d = device();
    for (k, n) in [(70, 37), (640, 300), (32, 8)] {
        let w = values(n * k, (k * n) as u32);
        let x = values(GPU_ROWS_MAX * k, k as u32);
        let wd = tensor(w.clone(), [n, k], &d);
        let full =
            host(gpu::linear_rows(&tensor(x.clone(), [GPU_ROWS_MAX, k], &d), &[&wd]).unwrap());
        // Against an f64 reference, relative to Σ|x·w| (the scale of a dot product's rounding):
        // a fixed-order f32 sum of k/32 terms per lane, then a 5-level tree.
        let mut worst = 0.0f64;
        for r in 0..GPU_ROWS_MAX {
            for o in 0..n {
                let (xr, wo) = (&x[r * k..(r + 1) * k], &w[o * k..(o + 1) * k]);
                let exact: f64 = xr
                    .iter()
                    .zip(wo)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let scale: f64 = xr.iter().zip(wo).map(|(a, b)| f64::from(a * b).abs()).sum();
                worst = worst.max((f64::from(full[r * n + o]) - exact).abs() / scale);
            }
        }
        assert!(worst <= 1e-6, "k {k}, n {n}: max |Δ| / Σ|x·w| {worst:e}");
        // Every row count gives each row the same bits as all sixteen together.
        for rows in 1..=GPU_ROWS_MAX {
            let part = host(
                gpu::linear_rows(&tensor(x[..rows * k].to_vec(), [rows, k], &d), &[&wd]).unwrap(),
            );
            assert_eq!(part[..], full[..rows * n], "k {k}, n {n}: {rows} rows");
        }
    }
    // Past GPU_ROWS_MAX rows the caller keeps Burn's matmul.
    let x = tensor(values((GPU_ROWS_MAX + 1) * 8, 1), [GPU_ROWS_MAX + 1, 8], &d);
    assert!(gpu::linear_rows(&x, &[&tensor(values(64, 2), [8, 8], &d)]).is_none());
}

#[test]
fn argmax_rows_takes_the_first_largest() {
    let d = device();
    let cols = 262_144 + 37;
    let mut x = values(3 * cols, 5);
    // Row 0: a unique maximum far out; row 1: a tie, the first must win; row 2: all equal.
    x[200_001] = 9.0;
    x[cols + 70_000] = 9.0;
    x[cols + 150_000] = 9.0;
    x[2 * cols..].iter_mut().for_each(|v| *v = -1.5);
    let got = gpu::argmax_rows(&tensor(x, [3, cols], &d)).unwrap();
    assert_eq!(got, vec![200_001, 70_000, 0]);
    // Fewer columns than the kernel's units, infinities included.
    let inf = f32::INFINITY;
    let x = vec![-inf, -inf, 1.0, 1.0, -inf, -inf, -inf, -inf, -inf, -inf];
    assert_eq!(
        gpu::argmax_rows(&tensor(x, [2, 5], &d)).unwrap(),
        vec![2, 0]
    );
}

#[test]
fn linear_rows_of_several_weights_equals_each_alone() {
    let d = device();
    let (t, k) = (4, 96);
    let x = tensor(values(t * k, 31), [t, k], &d);
    let ws: Vec<Tensor<2>> = [40, 9, 23]
        .iter()
        .enumerate()
        .map(|(i, &n)| tensor(values(n * k, 40 + i as u32), [n, k], &d))
        .collect();
    for parts in 1..=3 {
        let refs: Vec<&Tensor<2>> = ws.iter().take(parts).collect();
        let both = gpu::linear_rows(&x, &refs).unwrap();
        let want: Vec<Tensor<2>> = refs
            .iter()
            .map(|w| gpu::linear_rows(&x, &[w]).unwrap())
            .collect();
        assert_eq!(host(both), host(Tensor::cat(want, 1)), "{parts} weights");
    }
}

/// A weight held in row blocks (larger than one buffer on the device: `Linear::within`)
/// multiplies as the whole weight does: the same bits for a few rows (one launch per three
/// blocks), and for prefill's rows through the matmul; its whole weight moves to the host.
#[test]
fn a_weight_in_row_blocks_multiplies_as_the_whole_weight() {
    use kakeya_models::linear::Linear;
    let d = device();
    let (out, k) = (103, 48);
    let whole = Linear::host(values(out * k, 61), [out, k], &d);
    assert!(
        whole.row_blocks().is_empty(),
        "a small weight is held whole"
    );
    // 20 rows a block at most: six blocks of 18, 17, … rows (even split of 103).
    let blocked = whole.clone().within(20 * k as u64 * 4);
    assert_eq!(blocked.row_blocks().len(), 6);
    assert!(blocked.row_blocks().iter().all(|b| b.dims()[0] <= 20));
    assert_eq!(
        blocked
            .row_blocks()
            .iter()
            .map(|b| b.dims()[0])
            .sum::<usize>(),
        out
    );
    assert_eq!(
        blocked.dense_weight().device(),
        Device::flex(),
        "the whole weight on the host"
    );
    assert_eq!(blocked.device(), d);
    assert_eq!(host(blocked.dense_weight()), host(whole.dense_weight()));
    for t in [1, 5, GPU_ROWS_MAX, 40] {
        let x = tensor(values(t * k, 62 + t as u32), [t, k], &d);
        let (got, want) = (host(blocked.forward(x.clone())), host(whole.forward(x)));
        if t <= GPU_ROWS_MAX {
            assert_eq!(got, want, "{t} rows");
        } else {
            assert!(max_rel(&got, &want) < 1e-5, "{t} rows");
        }
    }
    // A weight that fits is left as it is.
    assert!(
        whole
            .clone()
            .within(out as u64 * k as u64 * 4)
            .row_blocks()
            .is_empty()
    );
}

/// `gpu::matmul` sums f32 products of f32 operands: against an f64 reference its error is
/// f32 rounding (≈ 1e-5 here), where TF32 staging (10-bit mantissas, Burn's CUDA default)
/// would be ≈ 1e-2.
#[test]
fn matmul_keeps_f32_operands() {
    let d = device();
    let reference = |a: &[f32], b: &[f32], [batch, m, k, n]: [usize; 4], b_t: bool| {
        let mut out = vec![0f32; batch * m * n];
        for z in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let s: f64 = (0..k)
                        .map(|p| {
                            let bv = if b_t {
                                b[z * n * k + j * k + p]
                            } else {
                                b[z * k * n + p * n + j]
                            };
                            f64::from(a[z * m * k + i * k + p]) * f64::from(bv)
                        })
                        .sum();
                    out[z * m * n + i * n + j] = s as f32;
                }
            }
        }
        out
    };
    let max_abs = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    // A prefill projection: `[T, in] · Wᵀ` with `W` stored `[out, in]`.
    let (m, k, n) = (40, 640, 300);
    let (a, w) = (values(m * k, 1), values(n * k, 2));
    let y = host(gpu::matmul(
        tensor(a.clone(), [m, k], &d),
        tensor(w.clone(), [n, k], &d).transpose(),
    ));
    let err = max_abs(&y, &reference(&a, &w, [1, m, k, n], true));
    assert!(err <= 5e-4, "[{m}, {k}]·[{n}, {k}]ᵀ: max |Δ| {err:e}");
    // Chunked attention's batched products.
    let (batch, m, k, n) = (4, 48, 256, 70);
    let (a, b) = (values(batch * m * k, 3), values(batch * k * n, 4));
    let y = host(gpu::matmul(
        tensor(a.clone(), [batch, m, k], &d),
        tensor(b.clone(), [batch, k, n], &d),
    ));
    let err = max_abs(&y, &reference(&a, &b, [batch, m, k, n], false));
    assert!(
        err <= 5e-4,
        "[{batch}, {m}, {k}]·[{batch}, {k}, {n}]: max |Δ| {err:e}"
    );
}

/// One AdamW update in one kernel against the update computed here on the host, in f32 and in
/// the composed update's order (`kakeya_train::optim::AdamW::update`); with and without decay,
/// with the gradient as it is (scale 1) and scaled by a clip factor read from the device.
#[test]
fn adamw_matches_the_update_step_by_step() {
    let d = device();
    let (r, c) = (37, 70);
    let n = r * c;
    let p = values(n, 11);
    let g: Vec<f32> = values(n, 12).iter().map(|x| 0.1 * x).collect();
    let m: Vec<f32> = values(n, 13).iter().map(|x| 0.01 * x).collect();
    let v: Vec<f32> = values(n, 14).iter().map(|x| 1e-4 * x * x).collect();
    for (lr_decay, scale) in [(0.0, 1.0f32), (1e-3 * 0.01, 0.37)] {
        let h = gpu::AdamwStep {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            lr: 1e-3,
            bias1: 1.0 - 0.9f64.powi(7),
            bias2: 1.0 - 0.95f64.powi(7),
            lr_decay,
        };
        let t = |x: &[f32]| tensor(x.to_vec(), [r, c], &d);
        let s = tensor(vec![scale], [1], &d);
        let (p2, m2, v2) = gpu::adamw(&t(&p), &t(&g), &s, &t(&m), &t(&v), &h).expect("on a GPU");
        let (p2, m2, v2) = (host(p2), host(m2), host(v2));
        let f = |x: f64| x as f32;
        let (mut wp, mut wm, mut wv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        for i in 0..n {
            let gi = g[i] * scale;
            wm[i] = m[i] * f(h.beta1) + gi * f(1.0 - h.beta1);
            wv[i] = v[i] * f(h.beta2) + gi * gi * f(1.0 - h.beta2);
            let step = (wm[i] / f(h.bias1)) / ((wv[i] / f(h.bias2)).sqrt() + f(h.eps));
            wp[i] = (p[i] - p[i] * f(h.lr_decay)) - step * f(h.lr);
        }
        for (what, got, want) in [("p", &p2, &wp), ("m", &m2, &wm), ("v", &v2, &wv)] {
            let err = max_rel(got, want);
            assert!(
                err <= 1e-6,
                "lr·decay {lr_decay}: {what} max rel |Δ| {err:e}"
            );
        }
        // The parameter moved by about lr against the gradient's sign.
        let moved = p2.iter().zip(&p).filter(|(a, b)| a != b).count();
        assert!(moved > n * 9 / 10, "only {moved} of {n} entries moved");
        // In place, the step's scalars from a buffer (a replayed step's update): the same bits
        // in the parameter's and moments' own buffers, also while another tensor holds them.
        let (pi, mi, vi) = (t(&p), t(&m), t(&v));
        let held = pi.clone();
        let wd = 0.01;
        let hyper = [h.lr, h.bias1, h.bias2, h.lr * wd]
            .map(|x| x as f32)
            .to_vec();
        let hyper = tensor(hyper, [4], &d);
        let mut hd = h;
        hd.lr_decay = 12.5; // not read in place: the decay comes from `hyper` and the flag
        gpu::adamw_in_place(&pi, &t(&g), &s, (&mi, &vi), &hyper, &hd, lr_decay > 0.0)
            .expect("on a GPU");
        // With decay, the buffer's `lr · wd` is the out-of-place update's `lr_decay`.
        assert!(lr_decay == 0.0 || (h.lr * wd) as f32 == lr_decay as f32);
        assert_eq!(host(held), p2, "lr·decay {lr_decay}: p in place");
        assert_eq!(host(mi), m2, "m in place");
        assert_eq!(host(vi), v2, "v in place");
    }
}

/// `copy_into` writes the source into the destination's own buffer, whoever else holds it.
#[test]
fn copy_into_writes_the_destinations_buffer() {
    let d = device();
    let dst = tensor(values(300, 21), [10, 30], &d);
    let held = dst.clone();
    let src = tensor(values(300, 22), [300], &d);
    gpu::copy_into(&dst, &src).expect("on a GPU");
    assert_eq!(host(held), host(src));
}

#[test]
fn rms_norm_add_norm_equals_the_two_kernels() {
    let d = device();
    // Rows over several cubes, widths below, at and above the kernel's 128 units.
    for (rows, dim) in [(1, 16), (9, 640), (3, 128), (2, 1152)] {
        let scale: Vec<f32> = values(dim, 3).iter().map(|v| 1.0 + 0.25 * v).collect();
        let next: Vec<f32> = values(dim, 4).iter().map(|v| 1.0 + 0.25 * v).collect();
        let norm = |m: &[f32], eps| RmsNorm {
            scale: tensor(m.to_vec(), [dim], &d),
            eps,
        };
        let (first, second) = (norm(&scale, 1e-6), norm(&next, 1e-5));
        let x = tensor::<2>(values(rows * dim, dim as u32), [rows, dim], &d);
        let residual = tensor::<2>(values(rows * dim, 5), [rows, dim], &d);
        let (h, m) = first.forward_add_norm(x.clone(), residual.clone(), &second);
        let h_two = first.forward_add(x, residual);
        let m_two = second.forward(h_two.clone());
        assert_eq!(host(h), host(h_two), "h at {rows}×{dim}");
        assert_eq!(host(m), host(m_two), "norm of h at {rows}×{dim}");
    }
}

#[test]
fn qk_norm_rope_reads_the_joint_projection_in_place_and_equals_each_alone() {
    let d = device();
    let (heads, kv_heads, hd) = (4, 2, 16);
    for t in [1, 5] {
        // The joint q/k/v product's rows, `[t, (heads + 2·kv_heads)·hd]`, and the heads-first
        // views of its query and key columns (strided: read in place, not copied).
        let width = (heads + 2 * kv_heads) * hd;
        let joint = tensor::<2>(values(t * width, 50 + t as u32), [t, width], &d);
        let view = |from: usize, n: usize| {
            joint
                .clone()
                .slice([0..t, from * hd..(from + n) * hd])
                .reshape([t, n, hd])
                .swap_dims(0, 1)
        };
        let (q, k) = (view(0, heads), view(heads, kv_heads));
        let norm = |seed: u32, eps| RmsNorm {
            scale: tensor(
                values(hd, seed).iter().map(|v| 1.0 + 0.25 * v).collect(),
                [hd],
                &d,
            ),
            eps,
        };
        let (q_norm, k_norm) = (norm(1, 1e-6), norm(2, 1e-5));
        let rope = Rope::new(hd, 10_000.0, 1.0);
        let (cos, sin) = rope.tables(&(7..7 + t).collect::<Vec<_>>(), &d);
        let (qg, kg) = q_norm.forward_rope_qk(q.clone(), (&k_norm, k.clone()), &cos, &sin);
        assert_eq!(
            host(qg),
            host(q_norm.forward_rope(q, &cos, &sin)),
            "queries, {t} rows"
        );
        assert_eq!(
            host(kg),
            host(k_norm.forward_rope(k, &cos, &sin)),
            "keys, {t} rows"
        );
    }
}

/// The forward's inputs read on the device: embeddings and RoPE rows gathered by the ids and
/// positions of one buffer equal `select · scale` and the host-built tables, bit for bit.
#[test]
fn step_inputs_gather_the_embeddings_and_rope_rows_of_the_host_path() {
    use kakeya_models::rope::Rope;
    let d = device();
    let (vocab, hidden) = (50, 24);
    let table = tensor::<2>(values(vocab * hidden, 51), [vocab, hidden], &d);
    let (ids, positions) = ([7u32, 0, 49, 7, 13], [300usize, 0, 1, 1023, 64]);
    let inputs = gpu::StepInputs::upload(&ids, &positions, &d);
    let scale = (hidden as f32).sqrt();
    let got = inputs
        .embed(std::slice::from_ref(&table), scale)
        .expect("on a GPU");
    let idx: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let idx = burn::tensor::Tensor::<1, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(idx, [ids.len()]),
        &d,
    );
    let want = table.clone().select(0, idx.clone()).mul_scalar(scale);
    assert_eq!(host(got), host(want.clone()), "embeddings");
    // The table in row blocks of its own buffers (a table larger than one buffer): each row
    // from its block, the same bits.
    let all = host(table.clone());
    let blocks: Vec<_> = [0..17, 17..34, 34..50]
        .into_iter()
        .map(|r| {
            tensor::<2>(
                all[r.start * hidden..r.end * hidden].to_vec(),
                [r.len(), hidden],
                &d,
            )
        })
        .collect();
    let got = inputs.embed(&blocks, scale).expect("on a GPU");
    assert_eq!(host(got), host(want), "embeddings from row blocks");
    // A strided view (the tied embedding as a view of a transposed weight) is read in place.
    let view = tensor::<2>(values(vocab * hidden, 52), [hidden, vocab], &d).transpose();
    let got = inputs
        .embed(std::slice::from_ref(&view), scale)
        .expect("on a GPU");
    let want = view.select(0, idx).mul_scalar(scale);
    assert_eq!(host(got), host(want), "embeddings of a strided view");
    for rope in [
        Rope::new(16, 10_000.0, 1.0),
        Rope::proportional(16, 1e6, 0.25),
    ] {
        let (cos, sin) = inputs.rope(&rope.device_table(1024, &d)).expect("on a GPU");
        let (hc, hs) = rope.host_tables(&positions);
        assert_eq!(host(cos), hc, "cos");
        assert_eq!(host(sin), hs, "sin");
    }
}
