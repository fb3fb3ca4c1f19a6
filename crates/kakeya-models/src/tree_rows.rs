//! The rows of one forward arranged as a tree of continuations (a draft tree verified in one
//! pass): row 0 is the root, every other row's parent is an earlier row. A row sits at the
//! position of its depth (RoPE, the sliding window) and sees the cached keys and its own
//! ancestors, never its siblings or cousins — so each row computes what a plain forward of the
//! path to it would. [SpecInfer's tree attention; Medusa; EAGLE]

use crate::error::{ModelError, Result};

/// Most rows a tree of one forward holds (its ancestry is one 64-bit set per row).
pub const TREE_MAX_ROWS: usize = 64;

/// A forward's rows as a tree: each row's depth and the set of rows it sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeRows {
    /// Per row: drafts between it and the root (root 0).
    depth: Vec<usize>,
    /// Per row: bit `j` set when row `j` is the row itself or one of its ancestors.
    ancestry: Vec<u64>,
}

impl TreeRows {
    /// The tree whose row `i` has parent `parents[i]` (the root, row 0, names itself); refuses
    /// no rows, more than [`TREE_MAX_ROWS`], a root with another parent, or a parent that does
    /// not come before its child.
    pub fn new(parents: &[usize]) -> Result<Self> {
        if parents.is_empty() || parents.len() > TREE_MAX_ROWS {
            return Err(ModelError::Input(format!(
                "a tree of {} rows: between 1 and {TREE_MAX_ROWS} rows run as a tree",
                parents.len()
            )));
        }
        if parents[0] != 0 {
            return Err(ModelError::Input(format!(
                "the root of a tree is row 0 and its own parent, not row {}",
                parents[0]
            )));
        }
        let mut depth = vec![0usize; parents.len()];
        let mut ancestry = vec![1u64; parents.len()];
        for (i, &p) in parents.iter().enumerate().skip(1) {
            if p >= i {
                return Err(ModelError::Input(format!(
                    "row {i} of a tree has parent {p}: a parent must come before its child"
                )));
            }
            depth[i] = depth[p] + 1;
            ancestry[i] = ancestry[p] | (1u64 << i);
        }
        Ok(Self { depth, ancestry })
    }

    /// A chain of `rows` rows (what a plain block is).
    pub fn chain(rows: usize) -> Result<Self> {
        let parents: Vec<usize> = (0..rows).map(|i| i.saturating_sub(1)).collect();
        Self::new(&parents)
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.depth.len()
    }

    /// Never true: a tree has its root.
    pub fn is_empty(&self) -> bool {
        self.depth.is_empty()
    }

    /// Row `i`'s depth: it sits at the forward's first position plus this.
    pub fn depth(&self, i: usize) -> usize {
        self.depth[i]
    }

    /// The rows' depths, in row order.
    pub fn depths(&self) -> &[usize] {
        &self.depth
    }

    /// Does row `i` see row `j` (`j` is `i` or one of its ancestors)?
    pub fn sees(&self, i: usize, j: usize) -> bool {
        j < TREE_MAX_ROWS && self.ancestry[i] >> j & 1 == 1
    }

    /// The rows from the root to row `i`, root first.
    pub fn path_to(&self, i: usize) -> Vec<usize> {
        (0..=i).filter(|&j| self.sees(i, j)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_see_themselves_and_their_ancestors_only() {
        // 0 ─ 1 ─ 3
        //   └ 2 ─ 4 ─ 5
        let t = TreeRows::new(&[0, 0, 0, 1, 2, 4]).unwrap();
        assert_eq!(t.depths(), &[0, 1, 1, 2, 2, 3]);
        assert_eq!(t.path_to(5), vec![0, 2, 4, 5]);
        assert_eq!(t.path_to(3), vec![0, 1, 3]);
        assert!(t.sees(5, 2) && t.sees(5, 5) && !t.sees(5, 1) && !t.sees(5, 3));
        assert!(!t.sees(1, 2) && !t.sees(2, 1) && !t.sees(0, 1));
        let chain = TreeRows::chain(4).unwrap();
        assert_eq!(chain.depths(), &[0, 1, 2, 3]);
        assert!((0..4).all(|i| (0..4).all(|j| chain.sees(i, j) == (j <= i))));
    }

    #[test]
    fn malformed_trees_are_refused() {
        for (parents, why) in [
            (vec![], "between 1 and"),
            (vec![1, 0], "its own parent"),
            (vec![0, 1], "must come before"),
            (vec![0, 0, 3, 0], "must come before"),
            (vec![0; TREE_MAX_ROWS + 1], "between 1 and"),
        ] {
            let err = TreeRows::new(&parents).unwrap_err().to_string();
            assert!(err.contains(why), "{parents:?}: {err}");
        }
    }
}
