//! Tests of [`super`]: growth by blocks, the ring's wrap and rollback, bytes held.

use burn::tensor::{Device, TensorData};

use super::*;

/// Positions `from..to` as K (value `p`) and V (value `−p`), one head of width 2.
fn rows(from: usize, to: usize) -> (Tensor<3>, Tensor<3>) {
    let device = Device::flex();
    let k: Vec<f32> = (from..to).flat_map(|p| [p as f32; 2]).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let n = to - from;
    (
        Tensor::from_data(TensorData::new(k, [1, n, 2]), &device),
        Tensor::from_data(TensorData::new(v, [1, n, 2]), &device),
    )
}

fn held_positions(r: &RingCache) -> Vec<usize> {
    let h = r.held().expect("holds positions");
    let k = h.k.into_data().try_to_vec::<f32>().unwrap();
    let v = h.v.into_data().try_to_vec::<f32>().unwrap();
    for (i, &p) in h.positions.iter().enumerate() {
        assert_eq!(
            (k[2 * i], v[2 * i]),
            (p as f32, -(p as f32)),
            "{:?}",
            h.positions
        );
    }
    h.positions
}

#[test]
fn a_ring_allocates_as_it_fills_and_keeps_its_window_through_rollbacks() {
    // Window 200, slack 2, from position 5: 201 slots.
    let mut r = RingCache::starting_at(5, 200, 2);
    let slot_bytes = 2 * 2 * 2; // K and V, width 2, f16
    let (mut len, mut first) = (5, 5);
    let mut sizes = Vec::new();
    for step in 0..400 {
        // Chunks of 1–9 positions; every fourth one is rolled back by 2.
        let t = 1 + step % 9;
        let (k, v) = rows(len, len + t);
        r.push(k, v, len).unwrap();
        len += t;
        // A write evicts what falls out of the ring; a rollback brings nothing back.
        first = first.max(len.saturating_sub(r.capacity()));
        if step % 4 == 3 {
            len -= 2;
            r.truncate(len).unwrap();
        }
        let held = held_positions(&r);
        let want: Vec<usize> = (first..len).collect();
        assert_eq!(held, want, "step {step}");
        let bytes = r.nbytes();
        assert!(bytes >= held.len().min(64) * slot_bytes, "step {step}");
        sizes.push(bytes / slot_bytes);
    }
    // Blocks of 64 slots as the ring fills, then the capacity; never more.
    let mut distinct = sizes.clone();
    distinct.dedup();
    assert_eq!(distinct, vec![64, 128, 192, 201], "{sizes:?}");
}
