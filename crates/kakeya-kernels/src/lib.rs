//! Kakeya's CPU kernels: the products every decode step runs on the host, each written so that
//! an output's bits never depend on how many rows run beside it (the property lossless
//! speculative decoding rests on).
//!
//! - [`quant`]: [`QuantMatrix`], GGUF-quantised weights repacked for row-order products, and
//!   [`dequant`], the GGML block formats back to f32 (the same f32 operations).
//! - [`dense`]: [`DenseMatrix`], f32/bf16 weights through the same canonical order.
//! - `int8`: the optional integer kernel (`--kernel int8`); [`argmax`]: the certified greedy
//!   argmax over the LM head.
//! - [`rowops`] (attention's small products over cached rows) and [`codes`] (packed 2–8-bit KV
//!   codes back to values); [`activation`] (the gated GELU over host rows).
//!
//! Every `unsafe` site in this crate is a SIMD routine called after a run-time CPU-feature
//! check, a pointer read inside bounds checked by its caller, or parallel tasks' disjoint
//! writes into one output; each carries a `SAFETY:` comment saying which (enforced by `clippy::undocumented_unsafe_blocks`). The other crates
//! deny `unsafe` for their CPU code.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod activation;
pub mod argmax;
pub mod codes;
pub mod dense;
pub mod dequant;
mod int8;
pub mod quant;
pub mod rowops;
mod tiles;

pub use argmax::Argmax;
pub use dense::DenseMatrix;
pub use quant::QuantMatrix;
