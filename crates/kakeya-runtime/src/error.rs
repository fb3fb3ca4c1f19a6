//! Runtime errors.

/// Result alias of this crate.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// What can go wrong while generating.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// From the model or a cache.
    #[error(transparent)]
    Model(#[from] kakeya_models::ModelError),
    /// From the tokenizer.
    #[error(transparent)]
    Weights(#[from] kakeya_weights::WeightsError),
    /// Input that cannot be run (empty or too long prompt, ...).
    #[error("{0}")]
    Input(String),
}
