#![allow(clippy::print_stdout)]
//! Times `QuantMatrix::matmul` and `matmul_int8` (1, 8 and 16 input rows) on every quantised tensor kind of a GGUF
//! (best of 10; small matrices stay in cache, the 262k-row head does not), and the certified
//! argmax where it applies.
//! Usage: cargo run --release -p kakeya-weights --example qbench -- model.gguf [name-filter] [rows...]
use std::time::Instant;

use kakeya_kernels::QuantMatrix;
use kakeya_weights::GgufFile;
use kakeya_weights::checkpoint::gguf_to_hf;

fn main() {
    let path = std::env::args().nth(1).expect("usage: qbench model.gguf");
    let filter = std::env::args().nth(2).unwrap_or_default();
    let counts: Vec<usize> = std::env::args()
        .skip(3)
        .map(|a| a.parse().expect("row counts are integers"))
        .collect();
    let counts = if counts.is_empty() {
        vec![1, 8, 16]
    } else {
        counts
    };
    let f = GgufFile::open(&path).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for t in &f.tensors {
        let shape = t.torch_shape();
        if shape.len() != 2
            || gguf_to_hf(&t.name).is_none()
            || !t.name.contains(&filter)
            || !seen.insert(format!("{:?}{:?}", t.ty, shape))
        {
            continue;
        }
        let Some(q) = QuantMatrix::new(t.ty, shape[0], shape[1], f.raw(t).unwrap()) else {
            continue;
        };
        for &t_rows in &counts {
            let x: Vec<f32> = (0..shape[1] * t_rows)
                .map(|i| ((i * 37) % 23) as f32 * 0.07 - 0.7)
                .collect();
            let mut best = f64::MAX;
            for _ in 0..10 {
                let t0 = Instant::now();
                std::hint::black_box(q.matmul(&x, t_rows));
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let macs = (shape[0] * shape[1] * t_rows) as f64;
            println!(
                "{:>24} {:?} {:?} t={t_rows:>2}: {:.3} ms ({:.1} GMAC/s)",
                t.name,
                t.ty,
                shape,
                best * 1e3,
                macs / best / 1e9,
            );
            // The int8 kernel (its panels made before timing).
            std::hint::black_box(q.matmul_int8(&x, t_rows));
            let mut best = f64::MAX;
            for _ in 0..10 {
                let t0 = Instant::now();
                std::hint::black_box(q.matmul_int8(&x, t_rows));
                best = best.min(t0.elapsed().as_secs_f64());
            }
            println!(
                "{:>24} int8 kernel t={t_rows:>2}: {:.3} ms ({:.1} GMAC/s)",
                "",
                best * 1e3,
                macs / best / 1e9,
            );
            // The certified argmax, where it applies (interleaved with nothing: best of 10).
            if q.argmax(&x, t_rows).is_some() {
                let mut best = f64::MAX;
                let mut cands = Vec::new();
                for _ in 0..10 {
                    let t0 = Instant::now();
                    let a = std::hint::black_box(q.argmax(&x, t_rows)).unwrap();
                    best = best.min(t0.elapsed().as_secs_f64());
                    cands = a.candidates;
                }
                println!(
                    "{:>24} certified argmax t={t_rows:>2}: {:.3} ms (exact products for {cands:?} rows)",
                    "",
                    best * 1e3,
                );
            }
        }
    }
}
