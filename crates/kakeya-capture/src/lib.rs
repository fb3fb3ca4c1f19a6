//! `kakeya capture`: runs the verifier (and optionally the drafter) over a prompt corpus and
//! writes per-layer Q/K/V/O, aux hidden states and drafter context K/V to sharded, resumable
//! Parquet with a manifest; and reads it back as a stream for the trainers.

pub mod capture;
pub mod config;
pub mod error;
pub mod job;
pub mod prompts;
pub mod reader;
pub mod reuse;
pub mod schema;

pub use config::CaptureConfig;
pub use error::{CaptureError, Result};
pub use job::{Models, Progress, RunOptions, Summary, merge, run};
pub use reader::{Dataset, Query, SequenceBatch, held_out};
pub use schema::Manifest;
