#![allow(clippy::print_stdout)]
//! Mutation fuzzing of the checkpoint loaders on stable Rust: GGUF files (`Checkpoint::load`
//! of a `.gguf`: header, metadata, tensor infos, the Gemma config, dequantisation and
//! repacking) and Hugging Face folders (`config.json` — Gemma 3 and Gemma 4 — and
//! `model.safetensors` through `Checkpoint::from_hf_dir`).
//!
//! Seeds come from real headers: the default model's GGUF metadata (arrays cut to 8 entries)
//! and tensor infos (dims shrunk, random data); llama.cpp's GGUF conversions of the tiny
//! Gemma 4 fixtures (whole loadable files; 7 in 8 mutations hit their headers); and
//! transformers' Gemma 4 fixtures (its configs; its safetensors header names, dtypes and
//! layout on small shapes). Each input gets
//! 1–4 mutations (bit flips, random or boundary integers, inserted, deleted or repeated
//! runs, truncation) and is loaded once. A run fails on a panic, on a load slower than 2 s,
//! or on a single allocation above 16 × the input's size + 1 MiB (dequantising to f32 grows
//! data up to ~14×; anything more is a size taken from a header and not checked against the
//! file). Failing inputs are written to `runs/fuzz/`; the summary goes to
//! `runs/fuzz/report.json`.
//!
//! Usage: cargo run --release -p kakeya-weights --example fuzz_loaders -- [inputs] [seed]
//! (or `-- FILE.gguf` to load one saved input)
//! (from the workspace root, after `python3 scripts/fetch_default_model.py`).
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kakeya_weights::gguf::GgufValue;
use kakeya_weights::{Checkpoint, GgufFile};

/// Tracks the largest single allocation since the last reset (the one place this harness
/// needs `unsafe`: a global allocator forwarding to the system one).
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers to the system allocator; only records sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Applies 1–4 random mutations, 7 in 8 of them within the first `hot` bytes (a file's
/// header, where a mutation reaches more code than in tensor data).
fn mutate(seed: &[u8], hot: usize, r: &mut Rng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + r.below(4) {
        let at = if r.below(8) < 7 {
            r.below(hot.min(b.len()))
        } else {
            r.below(b.len())
        };
        match r.below(7) {
            0 if !b.is_empty() => b[at] ^= 1 << r.below(8),
            1 if !b.is_empty() => b[at] = r.next() as u8,
            2 => {
                // A boundary integer over 1, 2, 4 or 8 bytes (sizes, counts, offsets).
                let v: u64 = [
                    0,
                    1,
                    2,
                    0x7f,
                    0xff,
                    0xffff,
                    0xffff_ffff,
                    u64::MAX,
                    1 << 31,
                    1 << 40,
                ][r.below(10)];
                let w = [1, 2, 4, 8][r.below(4)];
                for (k, byte) in v.to_le_bytes().iter().take(w).enumerate() {
                    if let Some(x) = b.get_mut(at + k) {
                        *x = *byte;
                    }
                }
            }
            3 => {
                let n = 1 + r.below(16);
                let ins: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
                b.splice(at..at, ins);
            }
            4 if !b.is_empty() => {
                let end = (at + 1 + r.below(32)).min(b.len());
                b.drain(at..end);
            }
            5 => {
                let end = (at + 1 + r.below(64)).min(b.len());
                let run = b[at..end].to_vec();
                b.splice(at..at, run);
            }
            _ => b.truncate(at),
        }
    }
    b
}

/// A GGUF writer for the seeds (types: u32/u64, i32, f32, bool, string, arrays of those).
fn put_value(b: &mut Vec<u8>, v: &GgufValue) {
    let (ty, body): (u32, Vec<u8>) = match v {
        GgufValue::UInt(x) if *x <= u32::MAX as u64 => (4, (*x as u32).to_le_bytes().to_vec()),
        GgufValue::UInt(x) => (10, x.to_le_bytes().to_vec()),
        GgufValue::Int(x) => (5, (*x as i32).to_le_bytes().to_vec()),
        GgufValue::Float(x) => (6, (*x as f32).to_le_bytes().to_vec()),
        GgufValue::Bool(x) => (7, vec![u8::from(*x)]),
        GgufValue::String(s) => {
            let mut o = (s.len() as u64).to_le_bytes().to_vec();
            o.extend_from_slice(s.as_bytes());
            (8, o)
        }
        // A long array: 8 empty strings in its place (the seed keeps short arrays).
        GgufValue::Skipped { .. } => {
            let mut o = 8u32.to_le_bytes().to_vec();
            o.extend_from_slice(&8u64.to_le_bytes());
            o.extend(std::iter::repeat_n(0u8, 8 * 8));
            (9, o)
        }
        GgufValue::Array(items) => {
            let items = &items[..items.len().min(8)];
            let mut o = Vec::new();
            let mut inner_ty = 4u32;
            for it in items {
                let mut one = Vec::new();
                put_value(&mut one, it);
                inner_ty = u32::from_le_bytes([one[0], one[1], one[2], one[3]]);
                o.extend_from_slice(&one[4..]);
            }
            let mut head = inner_ty.to_le_bytes().to_vec();
            head.extend_from_slice(&(items.len() as u64).to_le_bytes());
            head.extend_from_slice(&o);
            (9, head)
        }
    };
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&body);
}

/// The default model's header with arrays cut short and three of its tensors on small shapes
/// (Q8_0, Q4_K, F32), with random data.
fn gguf_seed(model: &Path, r: &mut Rng) -> Vec<u8> {
    let f = GgufFile::open(model).expect("the default model (scripts/fetch_default_model.py)");
    let pick = |prefix: &str| {
        f.tensors
            .iter()
            .find(|t| t.name.starts_with(prefix))
            .unwrap()
    };
    let chosen = [
        (pick("token_embd"), vec![32u64, 4]),
        (pick("blk.0.attn_output"), vec![256, 1]),
        (pick("blk.0.attn_norm"), vec![8]),
    ];
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(chosen.len() as u64).to_le_bytes());
    b.extend_from_slice(&(f.metadata.len() as u64).to_le_bytes());
    for (k, v) in &f.metadata {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        put_value(&mut b, v);
    }
    let mut data = Vec::new();
    for (t, dims) in &chosen {
        b.extend_from_slice(&(t.name.len() as u64).to_le_bytes());
        b.extend_from_slice(t.name.as_bytes());
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&t.ty.id().to_le_bytes());
        b.extend_from_slice(&(data.len() as u64).to_le_bytes());
        let n =
            t.ty.bytes_for(dims.iter().product::<u64>() as usize)
                .unwrap();
        data.extend((0..n).map(|_| (r.next() >> 56) as u8 & 0x3f));
        while !data.len().is_multiple_of(32) {
            data.push(0);
        }
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend_from_slice(&data);
    b
}

/// A small safetensors file with the Gemma 4 fixture's tensor names and dtypes (f32 and, for
/// some, bf16/f16), on shapes cut to a few values.
fn safetensors_seed(fixture: &Path) -> Vec<u8> {
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut meta = serde_json::Map::new();
    let mut data = Vec::new();
    for (i, name) in header
        .keys()
        .filter(|k| *k != "__metadata__")
        .take(24)
        .enumerate()
    {
        let (dtype, width) = [("F32", 4), ("BF16", 2), ("F16", 2)][i % 3];
        let len = 4 * width;
        meta.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": [2, 2], "data_offsets": [data.len(), data.len() + len]}),
        );
        data.extend((0..len).map(|k| (k * 37 + i) as u8));
    }
    let head = serde_json::Value::Object(meta).to_string();
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(&data);
    out
}

#[derive(Default, serde::Serialize)]
struct Tally {
    inputs: usize,
    loaded_ok: usize,
    refused: usize,
    panics: usize,
    slow: usize,
    over_allocating: usize,
    slowest_ms: f64,
    largest_alloc_over_input: f64,
}

/// Loads one input with `load`, checking for panics, time and allocations.
fn check(t: &mut Tally, input: &[u8], load: impl FnOnce() -> bool, failures: &Path, kind: &str) {
    t.inputs += 1;
    LARGEST.store(0, Ordering::Relaxed);
    let t0 = Instant::now();
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(load));
    let dt = t0.elapsed();
    let largest = LARGEST.load(Ordering::Relaxed);
    t.slowest_ms = t.slowest_ms.max(dt.as_secs_f64() * 1e3);
    t.largest_alloc_over_input = t
        .largest_alloc_over_input
        .max(largest as f64 / input.len().max(1) as f64);
    let mut bad = None;
    match res {
        Err(_) => {
            t.panics += 1;
            bad = Some("panic");
        }
        Ok(true) => t.loaded_ok += 1,
        Ok(false) => t.refused += 1,
    }
    if dt > Duration::from_secs(2) {
        t.slow += 1;
        bad = Some("slow");
    }
    if largest > 16 * input.len() + (1 << 20) {
        t.over_allocating += 1;
        bad = Some("alloc");
    }
    if let Some(why) = bad {
        let p = failures.join(format!("{kind}-{why}-{}.bin", t.inputs));
        std::fs::write(&p, input).unwrap();
        println!(
            "{kind}: {why} on input {} (saved to {})",
            t.inputs,
            p.display()
        );
    }
}

fn main() {
    // `fuzz_loaders FILE.gguf`: load one saved input (to see where it fails).
    if let Some(p) = std::env::args().nth(1).filter(|a| a.ends_with(".gguf")) {
        LARGEST.store(0, Ordering::Relaxed);
        let res = Checkpoint::load(&p).map(|_| ());
        let largest = LARGEST.load(Ordering::Relaxed);
        println!("{res:?}; largest allocation {largest} bytes");
        return;
    }
    let total: usize = std::env::args()
        .nth(1)
        .map_or(1_000_000, |a| a.parse().unwrap());
    let mut r = Rng(std::env::args()
        .nth(2)
        .map_or(0x9e37_79b9, |a| a.parse().unwrap()));
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = root.join("runs/fuzz");
    std::fs::create_dir_all(&out).unwrap();
    std::panic::set_hook(Box::new(|_| {}));
    let scratch = std::env::temp_dir().join(format!("kakeya-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let fixtures = root.join("tests/fixtures/gemma4");
    // GGUF seeds: the default model's header on small tensors, and llama.cpp's conversions of
    // the tiny Gemma 4 fixtures (loadable: mutations reach dequantisation and the model checks).
    let mut ggufs: Vec<(Vec<u8>, usize)> = ["dense", "moe"]
        .iter()
        .map(|n| {
            let p = fixtures.join(n).join("model-f32.gguf");
            let header = GgufFile::open(&p).unwrap().data_start();
            (std::fs::read(&p).unwrap(), header)
        })
        .collect();
    let g3 = gguf_seed(
        &root.join("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"),
        &mut r,
    );
    let g3_len = g3.len();
    ggufs.push((g3, g3_len));
    let configs: Vec<Vec<u8>> = ["dense", "dense-kv", "moe"]
        .iter()
        .map(|n| std::fs::read(fixtures.join(n).join("config.json")).unwrap())
        .collect();
    // Both safetensors seeds: transformers' own file (loads with its config) and a small one
    // with its names and all three dtypes.
    let sts = [
        std::fs::read(fixtures.join("dense/model.safetensors")).unwrap(),
        safetensors_seed(&fixtures.join("dense")),
    ];
    let (mut tg, mut th) = (Tally::default(), Tally::default());
    let t0 = Instant::now();
    let gguf_path = scratch.join("m.gguf");
    let dir = scratch.join("hf");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..total {
        if i % 2 == 0 {
            let (seed, hot) = &ggufs[r.below(ggufs.len())];
            let input = mutate(seed, *hot, &mut r);
            std::fs::write(&gguf_path, &input).unwrap();
            check(
                &mut tg,
                &input,
                || Checkpoint::load(&gguf_path).is_ok(),
                &out,
                "gguf",
            );
        } else {
            // Mutate the config or the safetensors file, the other one intact.
            let cfg = &configs[r.below(configs.len())];
            let st = &sts[r.below(2)];
            let (c, s) = match r.below(3) {
                0 => (mutate(cfg, cfg.len(), &mut r), st.clone()),
                1 => (cfg.clone(), mutate(st, st.len(), &mut r)),
                _ => (configs[0].clone(), mutate(&sts[0], sts[0].len(), &mut r)),
            };
            std::fs::write(dir.join("config.json"), &c).unwrap();
            std::fs::write(dir.join("model.safetensors"), &s).unwrap();
            let input = [c, s].concat();
            check(
                &mut th,
                &input,
                || Checkpoint::from_hf_dir(&dir).is_ok(),
                &out,
                "hf",
            );
        }
        if (i + 1) % 100_000 == 0 {
            println!("{} inputs, {:.0} s", i + 1, t0.elapsed().as_secs_f64());
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let report = serde_json::json!({
        "inputs": total,
        "seconds": t0.elapsed().as_secs_f64(),
        "gguf": tg,
        "hf_folder": th,
        "pass": tg.panics + tg.slow + tg.over_allocating + th.panics + th.slow + th.over_allocating == 0,
    });
    let text = serde_json::to_string_pretty(&report).unwrap();
    std::fs::write(out.join("report.json"), &text).unwrap();
    println!("{text}");
}
