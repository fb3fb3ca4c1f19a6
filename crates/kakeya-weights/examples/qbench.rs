#![allow(clippy::print_stdout)]
//! Times `QuantMatrix::matmul` (one row of input) on every quantised tensor kind of a GGUF.
//! Usage: cargo run --release -p kakeya-weights --example qbench -- model.gguf
use std::time::Instant;

use kakeya_weights::checkpoint::gguf_to_hf;
use kakeya_weights::{GgufFile, QuantMatrix};

fn main() {
    let path = std::env::args().nth(1).expect("usage: qbench model.gguf");
    let f = GgufFile::open(&path).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for t in &f.tensors {
        let shape = t.torch_shape();
        if shape.len() != 2
            || gguf_to_hf(&t.name).is_none()
            || !seen.insert(format!("{:?}{:?}", t.ty, shape))
        {
            continue;
        }
        let Some(q) = QuantMatrix::new(t.ty, shape[0], shape[1], f.raw(t).unwrap()) else {
            continue;
        };
        let x = vec![0.5f32; shape[1]];
        let _ = q.matmul(&x, 1);
        let n = 20;
        let t0 = Instant::now();
        for _ in 0..n {
            std::hint::black_box(q.matmul(&x, 1));
        }
        let s = t0.elapsed().as_secs_f64() / n as f64;
        println!(
            "{:>24} {:?} {:?}: {:.3} ms, {:.2} GB/s",
            t.name,
            t.ty,
            shape,
            s * 1e3,
            q.nbytes() as f64 / s / 1e9
        );
    }
}
