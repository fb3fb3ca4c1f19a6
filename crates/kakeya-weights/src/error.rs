//! Errors of checkpoint and tokenizer I/O. Every variant names the file it is about.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = WeightsError> = std::result::Result<T, E>;

/// What can go wrong reading or writing model files.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file's content is not what its format requires.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, in words.
        msg: String,
    },
    /// A GGUF tensor uses a quantisation type this crate cannot dequantise.
    #[error("{path}: tensor `{tensor}` has unsupported GGML type {type_id} ({type_name})")]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The raw GGML type id.
        type_id: u32,
        /// Its name, when known.
        type_name: String,
    },
    /// A configuration value the model needs is absent.
    #[error("{path}: missing required field `{field}`")]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field's name.
        field: String,
    },
    /// A tensor the model needs is absent.
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The file or folder.
        path: PathBuf,
        /// The tensor's name (checkpoint naming).
        tensor: String,
    },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The file or folder.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// The tokenizer does not fit the model.
    #[error("{path}: {msg}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
}

impl WeightsError {
    /// A format error for `path`.
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }

    /// An I/O error for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
