//! Capture errors. Every variant that is about a file names it.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = CaptureError> = std::result::Result<T, E>;

/// What can go wrong capturing or reading a capture dataset.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A config that cannot be run.
    #[error("{path}: {msg}")]
    Config {
        /// The config (or the file it names).
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A bad line in a prompt file.
    #[error("{path}:{line}: {msg}")]
    Prompt {
        /// The prompt file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// A Parquet/Arrow problem (writing or reading a shard).
    #[error("{path}: {msg}")]
    Parquet {
        /// The shard.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A dataset that does not match what was asked (missing columns, other models).
    #[error("{path}: {msg}")]
    Dataset {
        /// The dataset folder or manifest.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// From model loading.
    #[error(transparent)]
    Weights(#[from] kakeya_weights::WeightsError),
    /// From a model forward.
    #[error(transparent)]
    Model(#[from] kakeya_models::ModelError),
    /// From generation.
    #[error(transparent)]
    Runtime(#[from] kakeya_runtime::RuntimeError),
}

impl CaptureError {
    /// An I/O error about `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// A config error about `path`.
    pub fn config(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// A Parquet error about `path`.
    pub fn parquet(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Self::Parquet {
            path: path.into(),
            msg: msg.to_string(),
        }
    }

    /// A dataset error about `path`.
    pub fn dataset(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Self::Dataset {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
