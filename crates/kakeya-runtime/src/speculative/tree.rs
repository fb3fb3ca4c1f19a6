//! Trees of drafted continuations: several candidates per position from every source, merged
//! where they share a prefix, each node scored by the estimated chance that greedy
//! verification accepts the path to it, and cut to a row budget best-first. The expected
//! number of accepted drafts of a tree is the sum of its nodes' path scores, so the `n` nodes
//! with the highest path scores are the best tree of `n` nodes (a parent never scores below
//! its child, so they form a tree). [SpecInfer; Sequoia; EAGLE-2's dynamic trees; DDTree
//! builds trees from a DFlash drafter's per-position distributions]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use kakeya_models::TreeRows;

use super::adaptive::DraftSource;
use super::ngram::NgramProposer;
use crate::error::Result;

/// Where an edge of a tree came from; each source's chances are calibrated apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EdgeSource {
    /// The chain the engine drafts without a tree (its usual proposer's choice), by where that
    /// chain came from (lookups by matched tail length, the table, or the drafter).
    Chain(DraftSource),
    /// Earlier occurrences of the sequence's tail (prompt lookup, every occurrence counted).
    Lookup,
    /// The static n-gram table.
    Table,
    /// The DFlash drafter's per-position distributions.
    Drafter,
}

/// Sources calibrated apart: the chain by where it came from (lookup tails of 1, 2, 3+
/// tokens; table; drafter), then lookups, table and drafter.
const SOURCES: usize = 8;

impl EdgeSource {
    fn index(self) -> usize {
        match self {
            EdgeSource::Chain(DraftSource::Lookup(n)) => n.clamp(1, 3) - 1,
            EdgeSource::Chain(DraftSource::Table(_)) => 3,
            EdgeSource::Chain(DraftSource::Model | DraftSource::Nothing) => 4,
            EdgeSource::Lookup => 5,
            EdgeSource::Table => 6,
            EdgeSource::Drafter => 7,
        }
    }
}

/// Deepest depth whose calibration is kept apart (deeper nodes share the last one's).
const CALIBRATED_DEPTHS: usize = 16;

/// How often each source's edges were right, per depth: a source's raw chance (a drafter's
/// probability, a lookup's share of the occurrences) is scaled by what it earned so far
/// (accepted / sum of raw chances over the edges whose parent the verifier reached), so a
/// source that overstates itself is trusted less. With no evidence the raw chance stands.
#[derive(Debug, Clone, Default)]
pub struct EdgeCalibration {
    /// Sum of raw chances of the edges seen, per source and depth.
    raw: [[f64; CALIBRATED_DEPTHS]; SOURCES],
    /// Edges seen that the verifier took, per source and depth.
    hits: [[f64; CALIBRATED_DEPTHS]; SOURCES],
}

impl EdgeCalibration {
    /// The calibrated chance of an edge at `depth` (1 = the first draft) whose raw chance from
    /// `source` is `raw`, in `[0, 1]`.
    pub fn chance(&self, source: EdgeSource, depth: usize, raw: f32) -> f32 {
        self.chance_at(source.index(), depth, raw)
    }

    fn chance_at(&self, s: usize, depth: usize, raw: f32) -> f32 {
        let d = depth.clamp(1, CALIBRATED_DEPTHS) - 1;
        // One pseudo-edge at the raw chance keeps the first blocks from swinging.
        let scale = (self.hits[s][d] + 1.0) / (self.raw[s][d] + 1.0);
        (raw as f64 * scale).clamp(0.0, 1.0) as f32
    }

    /// Learns from a verified tree: `truth[i]` is the verifier's token at depth `i + 1`
    /// (`truth[..accepted]` its accepted drafts, `truth[accepted]` its own next token, when
    /// known). Every node whose parent the verifier reached counts for each source that
    /// proposed it.
    pub fn observe(&mut self, tree: &DraftTree, truth: &[u32]) {
        let on_path = tree.path_of(truth);
        for (i, n) in tree.nodes.iter().enumerate().skip(1) {
            if !on_path[n.parent] || n.depth > truth.len() {
                continue;
            }
            let d = n.depth.clamp(1, CALIBRATED_DEPTHS) - 1;
            for (s, &raw) in n.raw.iter().enumerate() {
                if raw > 0.0 {
                    self.raw[s][d] += raw as f64;
                    self.hits[s][d] += on_path[i] as u8 as f64;
                }
            }
        }
    }
}

/// One node of a [`DraftTree`].
#[derive(Debug, Clone, PartialEq)]
pub struct TreeNode {
    /// The token (the root's: the newest committed token, not a draft).
    pub token: u32,
    /// Index of the parent (the root's is 0, itself).
    pub parent: usize,
    /// Drafts from the root (root 0).
    pub depth: usize,
    /// Chance that the verifier takes this token after its parent: the largest calibrated
    /// chance among the sources that proposed it (sources agree because they read the same
    /// text, so their votes are not counted as independent).
    pub edge: f32,
    /// Each source's raw chance for this edge (0: not proposed by it), by source (the
    /// calibration's order).
    pub raw: [f32; SOURCES],
}

/// A tree of drafts: node 0 is the root, every other node's parent comes before it.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftTree {
    nodes: Vec<TreeNode>,
}

impl DraftTree {
    /// A tree holding only `root`, the newest committed token.
    pub fn new(root: u32) -> Self {
        Self {
            nodes: vec![TreeNode {
                token: root,
                parent: 0,
                depth: 0,
                edge: 1.0,
                raw: [0.0; SOURCES],
            }],
        }
    }

    /// Its nodes, root first, parents before children.
    pub fn nodes(&self) -> &[TreeNode] {
        &self.nodes
    }

    /// Nodes, root included: the rows a verify of this tree takes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether it holds only its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// The child of `parent` holding `token`, if any.
    pub fn child(&self, parent: usize, token: u32) -> Option<usize> {
        (parent + 1..self.nodes.len())
            .find(|&i| self.nodes[i].parent == parent && self.nodes[i].token == token)
    }

    /// Adds `token` under `parent` as proposed by `source` with raw chance `raw`; a child
    /// already there keeps its index and takes the larger raw chance for that source. Returns
    /// the child's index.
    pub fn add(
        &mut self,
        parent: usize,
        token: u32,
        source: EdgeSource,
        raw: f32,
        calib: &EdgeCalibration,
    ) -> usize {
        let i = match self.child(parent, token) {
            Some(i) => i,
            None => {
                let depth = self.nodes[parent].depth + 1;
                self.nodes.push(TreeNode {
                    token,
                    parent,
                    depth,
                    edge: 0.0,
                    raw: [0.0; SOURCES],
                });
                self.nodes.len() - 1
            }
        };
        let n = &mut self.nodes[i];
        n.raw[source.index()] = n.raw[source.index()].max(raw.clamp(0.0, 1.0));
        n.edge = (0..SOURCES)
            .filter(|&s| n.raw[s] > 0.0)
            .map(|s| calib.chance_at(s, n.depth, n.raw[s]))
            .fold(0.0, f32::max);
        i
    }

    /// Adds `tokens` as a path from the root, each edge with the same raw chance.
    pub fn add_path(
        &mut self,
        tokens: &[u32],
        source: EdgeSource,
        raw: f32,
        calib: &EdgeCalibration,
    ) {
        let mut at = 0;
        for &t in tokens {
            at = self.add(at, t, source, raw, calib);
        }
    }

    /// Each node's path score: the product of the edges from the root (root 1).
    pub fn scores(&self) -> Vec<f32> {
        let mut s = vec![1.0f32; self.nodes.len()];
        for i in 1..self.nodes.len() {
            s[i] = s[self.nodes[i].parent] * self.nodes[i].edge;
        }
        s
    }

    /// Expected drafts accepted: the sum of the path scores below the root.
    pub fn expected_accepted(&self) -> f32 {
        self.scores().iter().skip(1).sum()
    }

    /// The root and at most `rows − 1` nodes with the highest path scores (ties: shallower,
    /// then earlier), nodes of score 0 left out; numbered parents first, in this tree's order.
    pub fn best_first(&self, rows: usize) -> DraftTree {
        let scores = self.scores();
        let mut order: Vec<usize> = (1..self.nodes.len()).filter(|&i| scores[i] > 0.0).collect();
        order.sort_by(|&a, &b| {
            scores[b]
                .total_cmp(&scores[a])
                .then(self.nodes[a].depth.cmp(&self.nodes[b].depth))
                .then(a.cmp(&b))
        });
        order.truncate(rows.saturating_sub(1));
        order.sort_unstable();
        let mut new_index = vec![usize::MAX; self.nodes.len()];
        new_index[0] = 0;
        let mut nodes = vec![self.nodes[0].clone()];
        for i in order {
            let mut n = self.nodes[i].clone();
            n.parent = new_index[n.parent];
            debug_assert_ne!(n.parent, usize::MAX, "a parent scores at least its child");
            new_index[i] = nodes.len();
            nodes.push(n);
        }
        DraftTree { nodes }
    }

    /// Which nodes lie on the path `truth` spells from the root (`truth[i]` at depth `i + 1`).
    pub fn path_of(&self, truth: &[u32]) -> Vec<bool> {
        let mut on = vec![false; self.nodes.len()];
        on[0] = true;
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            on[i] = on[n.parent] && truth.get(n.depth - 1) == Some(&n.token);
        }
        on
    }

    /// Drafts greedy verification accepts when the verifier's tokens are `truth` (`truth[i]`
    /// at depth `i + 1`): the depth of the deepest node on its path.
    pub fn accepted(&self, truth: &[u32]) -> usize {
        let on = self.path_of(truth);
        self.nodes
            .iter()
            .zip(&on)
            .filter(|(_, on)| **on)
            .map(|(n, _)| n.depth)
            .max()
            .unwrap_or(0)
    }

    /// Its shape as the rows of one forward ([`TreeRows`]).
    pub fn rows(&self) -> Result<TreeRows> {
        let parents: Vec<usize> = self.nodes.iter().map(|n| n.parent).collect();
        Ok(TreeRows::new(&parents)?)
    }

    /// The nodes greedy verification keeps when the verifier's token after node `i` is
    /// `choices[i]`: from the root, the child holding the verifier's token while there is
    /// one. The block commits their tokens after the root, then the verifier's token after
    /// the last of them.
    pub fn accepted_path(&self, choices: &[u32]) -> Vec<usize> {
        let mut path = vec![0];
        while let Some(next) = choices
            .get(path[path.len() - 1])
            .and_then(|&t| self.child(path[path.len() - 1], t))
        {
            path.push(next);
        }
        path
    }

    /// Grows the tree from per-depth candidates (`per_depth[d]`: tokens and raw chances for
    /// depth `d + 1`, as a DFlash drafter predicts each position of a block at once): paths
    /// are expanded best-first by path score, every candidate of the next depth under each
    /// expanded node, until `max_new` nodes were added or nothing is left.
    pub fn grow(
        &mut self,
        per_depth: &[Vec<(u32, f32)>],
        source: EdgeSource,
        max_new: usize,
        calib: &EdgeCalibration,
    ) {
        let start = self.nodes.len();
        // (score bits: a non-negative f32's bits order as the float does, earlier first)
        let mut heap = BinaryHeap::from([(1.0f32.to_bits(), Reverse(0usize))]);
        let mut expanded = HashSet::new();
        while let Some((bits, Reverse(at))) = heap.pop() {
            let depth = self.nodes[at].depth;
            if depth >= per_depth.len() || !expanded.insert(at) {
                continue;
            }
            for &(token, raw) in &per_depth[depth] {
                if self.nodes.len() - start >= max_new && self.child(at, token).is_none() {
                    return;
                }
                let child = self.add(at, token, source, raw, calib);
                let score = f32::from_bits(bits) * self.nodes[child].edge;
                heap.push((score.max(0.0).to_bits(), Reverse(child)));
            }
        }
    }

    /// Adds what follows earlier occurrences of the sequence's tail, up to `depth` tokens
    /// each, as a trie: `nexts` are where the tokens after each occurrence start (as
    /// [`NgramProposer::all_matches`] gives them, latest [`LOOKUP_OCCURRENCES`]); an edge's raw
    /// chance is the share of the occurrences through its parent that continue with it.
    pub fn add_lookups(
        &mut self,
        tokens: &[u32],
        nexts: &[usize],
        depth: usize,
        calib: &EdgeCalibration,
    ) {
        let paths: Vec<Vec<u32>> = nexts
            .iter()
            .map(|&next| NgramProposer::following_from(tokens, next, depth))
            .collect();
        // Occurrences through each prefix (the empty one: all of them).
        let mut through: HashMap<&[u32], usize> = HashMap::new();
        for p in &paths {
            for k in 0..=p.len() {
                *through.entry(&p[..k]).or_default() += 1;
            }
        }
        let mut added = HashSet::new();
        for p in &paths {
            let mut at = 0;
            for k in 0..p.len() {
                at = if added.insert(&p[..=k]) {
                    let share = through[&p[..=k]] as f32 / through[&p[..k]] as f32;
                    self.add(at, p[k], EdgeSource::Lookup, share, calib)
                } else {
                    self.child(at, p[k])
                        .expect("an added prefix is in the tree")
                };
            }
        }
    }
}

/// Earlier occurrences of a tail a tree takes lookups from, latest first.
pub const LOOKUP_OCCURRENCES: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(tokens: &[u32], raw: f32) -> DraftTree {
        let mut t = DraftTree::new(0);
        t.add_path(
            tokens,
            EdgeSource::Drafter,
            raw,
            &EdgeCalibration::default(),
        );
        t
    }

    #[test]
    fn a_chain_is_a_tree_with_one_branch_and_accepts_its_matching_prefix() {
        let t = chain(&[5, 6, 7], 0.5);
        assert_eq!(t.len(), 4);
        assert_eq!(t.accepted(&[5, 6, 9]), 2);
        assert_eq!(t.accepted(&[4]), 0);
        assert_eq!(t.accepted(&[5, 6, 7, 8]), 3);
        assert!((t.expected_accepted() - (0.5 + 0.25 + 0.125)).abs() < 1e-6);
    }

    #[test]
    fn identical_prefixes_merge_and_the_verifier_follows_the_branch_it_chooses() {
        let c = EdgeCalibration::default();
        let mut t = DraftTree::new(1);
        t.add_path(&[2, 3, 4], EdgeSource::Drafter, 0.5, &c);
        t.add_path(&[2, 3, 9], EdgeSource::Lookup, 0.5, &c);
        t.add_path(&[7], EdgeSource::Table, 0.2, &c);
        assert_eq!(t.len(), 6, "2 and 3 shared");
        // The shared edges are proposed by two sources: the larger chance.
        t.add_path(&[2], EdgeSource::Table, 0.7, &c);
        assert!((t.nodes()[1].edge - 0.7).abs() < 1e-6);
        assert!((t.nodes()[2].edge - 0.5).abs() < 1e-6);
        assert_eq!(t.accepted(&[2, 3, 9, 1]), 3);
        assert_eq!(t.accepted(&[2, 3, 4]), 3);
        assert_eq!(t.accepted(&[7, 7]), 1);
        assert_eq!(t.accepted(&[2, 8]), 1);
    }

    #[test]
    fn best_first_keeps_the_highest_scoring_nodes_as_a_tree_parents_first() {
        let c = EdgeCalibration::default();
        let mut t = DraftTree::new(0);
        let a = t.add(0, 10, EdgeSource::Drafter, 0.9, &c);
        let b = t.add(0, 20, EdgeSource::Drafter, 0.3, &c);
        let a1 = t.add(a, 11, EdgeSource::Drafter, 0.8, &c); // 0.72
        t.add(b, 21, EdgeSource::Drafter, 0.9, &c); // 0.27
        t.add(a1, 12, EdgeSource::Drafter, 0.5, &c); // 0.36
        let s = t.best_first(4);
        let tokens: Vec<u32> = s.nodes().iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![0, 10, 11, 12]);
        let s = t.best_first(5);
        let tokens: Vec<u32> = s.nodes().iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![0, 10, 20, 11, 12]);
        for (i, n) in s.nodes().iter().enumerate().skip(1) {
            assert!(n.parent < i);
            assert_eq!(n.depth, s.nodes()[n.parent].depth + 1);
        }
        // Any budget: a subtree of the whole, and never less expected than a smaller one.
        let mut last = 0.0;
        for rows in 1..=7 {
            let s = t.best_first(rows);
            assert!(s.len() <= rows.max(1));
            let e = s.expected_accepted();
            assert!(e >= last);
            last = e;
        }
        assert_eq!(t.best_first(100).len(), t.len());
    }

    #[test]
    fn growing_from_per_depth_candidates_expands_the_likeliest_paths_first() {
        let c = EdgeCalibration::default();
        let per_depth = vec![
            vec![(1, 0.6), (2, 0.3)],
            vec![(3, 0.5), (4, 0.4)],
            vec![(5, 0.9)],
        ];
        let mut t = DraftTree::new(0);
        t.grow(&per_depth, EdgeSource::Drafter, 100, &c);
        // 2 + 2·2 + 4·1 nodes: every path of the product.
        assert_eq!(t.len(), 1 + 2 + 4 + 4);
        let mut small = DraftTree::new(0);
        small.grow(&per_depth, EdgeSource::Drafter, 4, &c);
        assert_eq!(small.len(), 5);
        // The first expansion is the root, then the likeliest node (1, score 0.6).
        let tokens: Vec<(u32, usize)> = small.nodes().iter().map(|n| (n.token, n.parent)).collect();
        assert_eq!(tokens, vec![(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]);
        assert_eq!(small.accepted(&[1, 4, 5]), 2);
    }

    #[test]
    fn lookups_add_every_occurrence_with_its_share() {
        let c = EdgeCalibration::default();
        let p = NgramProposer::default();
        // Tail [7]: followed by 8 twice and by 9 once.
        let seq = [7, 8, 1, 7, 9, 2, 7, 8, 3, 7];
        let mut t = DraftTree::new(7);
        let (_, nexts) = p.all_matches(&seq, LOOKUP_OCCURRENCES).unwrap();
        t.add_lookups(&seq, &nexts, 2, &c);
        let first: Vec<(u32, f32)> = t
            .nodes()
            .iter()
            .filter(|n| n.depth == 1)
            .map(|n| (n.token, n.edge))
            .collect();
        assert_eq!(first.len(), 2);
        for (tok, edge) in first {
            let want = if tok == 8 { 2.0 / 3.0 } else { 1.0 / 3.0 };
            assert!((edge - want).abs() < 1e-6, "{tok}: {edge}");
        }
        assert_eq!(t.accepted(&[8, 3]), 2);
        assert_eq!(t.accepted(&[8, 1]), 2);
        assert_eq!(t.accepted(&[9, 2]), 2);
    }

    #[test]
    fn calibration_scales_a_source_by_what_it_earned() {
        let mut c = EdgeCalibration::default();
        assert_eq!(c.chance(EdgeSource::Drafter, 1, 0.8), 0.8);
        // A drafter that says 0.8 at depth 1 and is wrong every time is trusted less.
        for _ in 0..20 {
            let t = chain(&[5], 0.8);
            c.observe(&t, &[6]);
        }
        assert!(c.chance(EdgeSource::Drafter, 1, 0.8) < 0.1);
        // Other sources and depths keep their raw chance.
        assert_eq!(c.chance(EdgeSource::Lookup, 1, 0.8), 0.8);
        assert_eq!(c.chance(EdgeSource::Drafter, 2, 0.8), 0.8);
        // Nodes below a rejected parent teach nothing.
        let before = c.clone();
        c.observe(&chain(&[5, 6], 0.5), &[4, 6]);
        assert_eq!(
            c.chance(EdgeSource::Drafter, 2, 0.5),
            before.chance(EdgeSource::Drafter, 2, 0.5)
        );
    }
}
