//! The interface between a model's attention and the caller-owned KV caches.
//!
//! A model declares one [`CacheSpec`] per layer; the caller builds caches from it (see
//! `kakeya-runtime`) and passes them to every forward. Keys are stored as attention uses them
//! (after k_norm and RoPE at their absolute positions).

use burn::tensor::Tensor;

use crate::error::Result;

/// What one layer's cache must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSpec {
    /// Every position (full-attention layer).
    Full,
    /// The last `window` positions suffice (sliding layer: query `q` sees keys `k > q - window`).
    Sliding {
        /// Attention window.
        window: usize,
    },
}

/// Keys and values attention must see for a chunk of queries, with their absolute positions.
#[derive(Debug, Clone)]
pub struct CachedKv {
    /// Keys, `[kv_heads, S, head_dim]`.
    pub k: Tensor<3>,
    /// Values, `[kv_heads, S, head_dim]`.
    pub v: Tensor<3>,
    /// Absolute position of each of the `S` keys.
    pub positions: Vec<usize>,
}

/// One layer's KV store, owned by the caller.
pub trait LayerCache {
    /// Records the K/V of positions `start..start + T` and returns everything attention over
    /// those queries needs: earlier cached positions followed by the new ones, in order.
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]`
    fn update(&mut self, k: Tensor<3>, v: Tensor<3>, start: usize) -> Result<CachedKv>;

    /// Positions recorded so far (the next position to write).
    fn len(&self) -> usize;

    /// True when nothing has been recorded.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
