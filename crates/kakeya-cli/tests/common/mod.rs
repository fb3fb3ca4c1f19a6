//! Helpers shared by the `kakeya` binary's integration tests: running the binary, expecting
//! success, or expecting a clean failure (a non-zero exit with a message, never a panic).
#![allow(dead_code)] // each test binary uses its own subset

pub mod http;
pub mod server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kakeya_models::testing::{random_checkpoint, tiny_config, word_level_tokenizer_json};

/// The binary under test.
pub fn kakeya() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kakeya"))
}

/// Exit code of a Rust program that panicked (the default panic handler's).
const PANIC_EXIT: i32 = 101;

/// Asserts `out` is a clean failure: non-zero exit, not the panic exit code, no panic message.
/// Returns stderr.
pub fn assert_clean_failure(out: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected failure for {what}; stderr: {err}"
    );
    assert!(
        out.status.code() != Some(PANIC_EXIT) && !err.contains("panicked"),
        "{what} panicked instead of failing cleanly: {err}"
    );
    err
}

/// Runs kakeya with `args`; asserts a clean failure; returns stderr.
pub fn fails(args: &[&str]) -> String {
    let out = kakeya().args(args).output().unwrap();
    assert_clean_failure(&out, &format!("{args:?}"))
}

/// Runs kakeya with `args`; asserts success; returns stdout.
pub fn run_ok(args: &[&str]) -> String {
    let out = kakeya().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "kakeya {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A tiny random Gemma 3 (sliding window `window`, weights from `seed`) as an HF folder
/// `dir/name`, with a word-level tokenizer of its 97 tokens.
pub fn tiny_model_dir(dir: &Path, name: &str, window: usize, seed: u64) -> PathBuf {
    let m = dir.join(name);
    random_checkpoint(&tiny_config(window), seed)
        .write_hf_dir(&m)
        .unwrap();
    std::fs::write(m.join("tokenizer.json"), word_level_tokenizer_json(97)).unwrap();
    m
}
