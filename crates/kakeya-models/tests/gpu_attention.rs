//! The GPU attention kernels (`kakeya_models::gpu::attention_rows`, `span_attention`) against
//! grouped attention on the CPU. Built with a GPU feature and run on that device:
//! `KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-models --features wgpu --test gpu_attention`
//! (scripts/test_wgpu.sh, on Mesa's lavapipe), or `cuda` on a lent GPU. Tolerances are f32
//! rounding of the different summation orders.
#![cfg(feature = "cube")]

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::gpu;

mod common;
use common::{device, host, max_rel, tensor, values};

#[test]
fn attention_rows_matches_grouped_attention_row_by_row() {
    use kakeya_models::gpu::{KeyRuns, RowKeys};
    use kakeya_models::sdpa::grouped_attention;
    let d = device();
    let (heads, kv_heads, t, hd, keys) = (4, 2, 3, 16, 300);
    let (q, k, v) = (
        values(heads * t * hd, 11),
        values(kv_heads * keys * hd, 12),
        values(kv_heads * keys * hd, 13),
    );
    let scale = 0.25;
    // Row i sees keys 2 + i .. 290 + i (a causal run), as in a verify block.
    let runs = KeyRuns {
        lo: 2,
        dlo: 1,
        hi: 290,
        dhi: 1,
    };
    let on = |device: &Device| {
        (
            tensor::<3>(q.clone(), [heads, t, hd], device),
            tensor::<3>(k.clone(), [kv_heads, keys, hd], device),
            tensor::<3>(v.clone(), [kv_heads, keys, hd], device),
        )
    };
    let (qg, kg, vg) = on(&d);
    let got = host(gpu::attention_rows(&qg, &kg, &vg, scale, RowKeys::Runs(runs)).unwrap());
    let (qc, kc, vc) = on(&Device::flex());
    let mut want = Vec::new();
    for i in 0..t {
        let r = runs.lo + i..runs.hi + i;
        let qi = qc.clone().slice([0..heads, i..i + 1, 0..hd]);
        let ki = kc.clone().slice([0..kv_heads, r.clone(), 0..hd]);
        let vi = vc.clone().slice([0..kv_heads, r, 0..hd]);
        want.extend(host(grouped_attention(qi, ki, vi, scale, None)));
        // Alone, each row gives the same bits as within the block.
        let alone = KeyRuns {
            lo: runs.lo + i,
            dlo: 0,
            hi: runs.hi + i,
            dhi: 0,
        };
        let q1 = qg.clone().slice([0..heads, i..i + 1, 0..hd]);
        let one = host(gpu::attention_rows(&q1, &kg, &vg, scale, RowKeys::Runs(alone)).unwrap());
        assert_eq!(
            one[..],
            got[i * heads * hd..(i + 1) * heads * hd],
            "row {i}"
        );
    }
    let err = max_rel(&got, &want);
    assert!(err <= 2e-6, "max rel |Δ| {err:e}");
    // The same keys listed give the same bits as the runs.
    let lists: Vec<Vec<usize>> = (0..t)
        .map(|i| (runs.lo + i..runs.hi + i).collect())
        .collect();
    let listed = host(gpu::attention_rows(&qg, &kg, &vg, scale, RowKeys::Lists(&lists)).unwrap());
    assert_eq!(listed, got, "listed keys vs runs");
    // Keys that are no run (four sink keys, then a window), against gathered keys on the CPU.
    let lists: Vec<Vec<usize>> = (0..t)
        .map(|i| (0..4).chain(200 + i..260 + 2 * i).collect())
        .collect();
    let got = host(gpu::attention_rows(&qg, &kg, &vg, scale, RowKeys::Lists(&lists)).unwrap());
    let mut want = Vec::new();
    for (i, keys) in lists.iter().enumerate() {
        let ids = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(
                keys.iter().map(|&k| k as i64).collect::<Vec<_>>(),
                [keys.len()],
            ),
            &Device::flex(),
        );
        let qi = qc.clone().slice([0..heads, i..i + 1, 0..hd]);
        let (ki, vi) = (kc.clone().select(1, ids.clone()), vc.clone().select(1, ids));
        want.extend(host(grouped_attention(qi, ki, vi, scale, None)));
    }
    let err = max_rel(&got, &want);
    assert!(err <= 2e-6, "listed keys: max rel |Δ| {err:e}");
}

#[test]
fn key_runs_take_only_rows_moving_in_step() {
    use kakeya_models::gpu::KeyRuns;
    let runs = KeyRuns::from_ranges(&[0..5, 0..6, 0..7]).unwrap();
    assert_eq!(
        runs,
        KeyRuns {
            lo: 0,
            dlo: 0,
            hi: 5,
            dhi: 1
        }
    );
    assert_eq!(
        KeyRuns::from_ranges(std::slice::from_ref(&(3..9))),
        Some(KeyRuns {
            lo: 3,
            dlo: 0,
            hi: 9,
            dhi: 0
        })
    );
    assert_eq!(
        KeyRuns::from_ranges(&[0..5, 1..6, 2..7]).map(|r| r.dlo),
        Some(1)
    );
    assert_eq!(
        KeyRuns::from_ranges(&[0..5, 0..7]),
        None,
        "a jump of two keys"
    );
    assert_eq!(
        KeyRuns::from_ranges(&[0..5, 0..6, 0..6]),
        None,
        "steps differ"
    );
    assert_eq!(KeyRuns::from_ranges(&[]), None);
}

#[test]
fn span_attention_writes_each_chunk_and_equals_attention_rows() {
    use kakeya_models::gpu::{ChunkSlots, KeyRuns, RowKeys};
    let d = device();
    let (heads, kv_heads, hd) = (4, 2, 16);
    let scale = 0.3;
    // Two sequences stacked: a full cache (slot = position) with a chunk of 3 at 150, and a
    // ring of 40 slots (window 32) that has wrapped, with a chunk of 2 at 100.
    let chunks = [(0..3, 150, 0, 256, 0), (3..5, 100, 0, 40, 32)];
    let rows = 5;
    let q = values(heads * rows * hd, 21);
    let k_new = values(kv_heads * rows * hd, 22);
    let v_new = values(kv_heads * rows * hd, 23);
    let caches: Vec<(Vec<f32>, Vec<f32>)> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let n = kv_heads * c.3 * hd;
            (values(n, 30 + i as u32), values(n, 40 + i as u32))
        })
        .collect();
    let qg = tensor::<3>(q.clone(), [heads, rows, hd], &d);
    let (kg, vg) = (
        tensor::<3>(k_new.clone(), [kv_heads, rows, hd], &d),
        tensor::<3>(v_new.clone(), [kv_heads, rows, hd], &d),
    );
    // The stacked rows' positions on the device, where the kernel reads each chunk's start.
    let stacked: Vec<usize> = chunks.iter().flat_map(|c| c.1..c.1 + c.0.len()).collect();
    let inputs = gpu::StepInputs::upload(&vec![0; rows], &stacked, &d);
    let mut out = None;
    let mut after = Vec::new();
    for (c, (ck, cv)) in chunks.iter().zip(&caches) {
        let (r, start, origin, slots, window) = c.clone();
        let (bk, bv) = (
            gpu::unique_dense(tensor::<3>(ck.clone(), [kv_heads, slots, hd], &d)),
            gpu::unique_dense(tensor::<3>(cv.clone(), [kv_heads, slots, hd], &d)),
        );
        let at = ChunkSlots {
            row0: r.start,
            t: r.len(),
            start,
            origin,
            modulus: slots,
            window,
        };
        let cache = (&bk, &bv);
        out = Some(
            gpu::span_attention(
                &qg,
                &kg,
                &vg,
                cache,
                inputs.positions(),
                out.take(),
                scale,
                at,
            )
            .unwrap(),
        );
        after.push((host(bk), host(bv)));
    }
    let got = host(out.unwrap());
    let width = heads * hd;
    for (c, ((ck, cv), (ak, av))) in chunks.iter().zip(caches.iter().zip(&after)) {
        let (r, start, origin, slots, window) = c.clone();
        let slot = |p: usize| (p - origin) % slots;
        // Per KV head, the element range of a position's row in the cache or in the chunk.
        let at_cache =
            |h: usize, p: usize| (h * slots + slot(p)) * hd..(h * slots + slot(p) + 1) * hd;
        let at_new = |h: usize, row: usize| (h * rows + row) * hd..(h * rows + row + 1) * hd;
        // The cache now holds the chunk's rows at their slots, and nothing else changed.
        let mut want_k = ck.clone();
        let mut want_v = cv.clone();
        for (i, row) in r.clone().enumerate() {
            for h in 0..kv_heads {
                want_k[at_cache(h, start + i)].copy_from_slice(&k_new[at_new(h, row)]);
                want_v[at_cache(h, start + i)].copy_from_slice(&v_new[at_new(h, row)]);
            }
        }
        assert_eq!(*ak, want_k, "keys written at chunk {start}");
        assert_eq!(*av, want_v, "values written at chunk {start}");
        // Each row, bit for bit, the attention_rows kernel over its keys in position order.
        for (i, row) in r.clone().enumerate() {
            let p = start + i;
            let lo = if window > 0 && p + 1 > window {
                p + 1 - window
            } else {
                0
            };
            let n = p + 1 - lo;
            let (mut keys, mut vals) = (Vec::new(), Vec::new());
            for h in 0..kv_heads {
                for s in lo..=p {
                    let (kr, vr) = if s >= start {
                        let e = at_new(h, r.start + s - start);
                        (&k_new[e.clone()], &v_new[e])
                    } else {
                        (&ck[at_cache(h, s)], &cv[at_cache(h, s)])
                    };
                    keys.extend_from_slice(kr);
                    vals.extend_from_slice(vr);
                }
            }
            let q1 = qg.clone().slice([0..heads, row..row + 1, 0..hd]);
            let k1 = tensor::<3>(keys, [kv_heads, n, hd], &d);
            let v1 = tensor::<3>(vals, [kv_heads, n, hd], &d);
            let runs = KeyRuns {
                lo: 0,
                dlo: 0,
                hi: n,
                dhi: 0,
            };
            let one = host(gpu::attention_rows(&q1, &k1, &v1, scale, RowKeys::Runs(runs)).unwrap());
            assert_eq!(
                one[..],
                got[row * width..(row + 1) * width],
                "row {row} (position {p})"
            );
        }
    }
}
