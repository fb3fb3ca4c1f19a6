//! Errors of model construction and forward passes.

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// What can go wrong building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Checkpoint problems (missing tensors, bad shapes).
    #[error(transparent)]
    Weights(#[from] kakeya_weights::WeightsError),
    /// The input does not fit the model (empty chunk, token id out of range, too long).
    #[error("invalid input: {0}")]
    Input(String),
    /// A drafter (or other companion checkpoint) built for a different verifier.
    #[error("{path}: does not fit the verifier: {msg}")]
    Mismatch {
        /// The companion checkpoint.
        path: std::path::PathBuf,
        /// What differs.
        msg: String,
    },
    /// A cache was asked for something it cannot do (e.g. roll back past its slack).
    #[error("cache: {0}")]
    Cache(String),
}
