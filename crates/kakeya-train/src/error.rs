//! Errors of the trainers: each names the file (config, dataset, checkpoint) it is about.

use std::path::{Path, PathBuf};

/// A trainer error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A config, dataset or state file is malformed or does not fit.
    #[error("{path}: {msg}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Reading the capture dataset failed.
    #[error(transparent)]
    Capture(#[from] kakeya_capture::CaptureError),
    /// Reading or writing weights failed.
    #[error(transparent)]
    Weights(#[from] kakeya_weights::WeightsError),
    /// A model rejected its input.
    #[error(transparent)]
    Model(#[from] kakeya_models::ModelError),
    /// The loss became NaN or infinite; nothing after the last checkpoint was saved.
    #[error(
        "the loss is {value} at step {step}: training stopped; the last good checkpoint ({kept}) is kept in {dir}"
    )]
    NonFinite {
        /// 1-based step whose loss was not finite.
        step: usize,
        /// The loss value.
        value: f64,
        /// Which checkpoint is kept.
        kept: String,
        /// The state folder.
        dir: PathBuf,
    },
    /// The compute device failed to run a step (out of its memory, a buffer larger than it
    /// allocates, a lost device); the state of the last checkpoint is kept.
    #[error(
        "the compute device failed: {0}; training stopped (out of device memory? a smaller step or model fits); the last checkpoint is kept"
    )]
    Device(String),
    /// Training was interrupted (the state of the last checkpoint is kept).
    #[error("interrupted at step {0}")]
    Interrupted(usize),
}

impl TrainError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn invalid(path: &Path, msg: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}

/// Result with [`TrainError`].
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
