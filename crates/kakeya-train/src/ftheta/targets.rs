//! The true side of f_θ's loss for a pass (DESIGN §7): where each row and query comes from
//! ([`Rows`]), the per-sequence constants ([`TargetScales`]), and a group's targets, prepared on
//! the host ahead of the step ([`HostTargets`]: the queries as attention reads them, each head
//! vector's constants, the masks and key RoPE tables) and uploaded in one go
//! ([`GroupTargets`]).

use burn::tensor::{Device, Tensor, TensorData};

use super::frozen::{AttentionInputs, GroupFrozen, GroupShape, HostAttention, TargetHeads};
use super::loss::{Lambdas, LayerTargets, LossKind, LossWeights, NORM_EPS};
use super::pass::push_flat;

/// The targets' constants that normalise the terms, per member layer (host values, computed
/// from host data: no device round trip).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetScales {
    /// `mean(K²)` of each layer.
    pub k_sq: Vec<f64>,
    /// `mean(V²)`.
    pub v_sq: Vec<f64>,
    /// `mean(|K_h|²)` over head vectors (`|x|² = Σx² + 1e-12`).
    pub k_hsq: Vec<f64>,
    /// `mean(|V_h|²)`.
    pub v_hsq: Vec<f64>,
    /// `mean(O_tgt²)` at the query positions (0 without attention).
    pub o_sq: Vec<f64>,
}

impl TargetScales {
    /// Adds one layer's constants from its raw K, V (head width `head_dim`) and, with
    /// attention, its target outputs.
    pub fn push(&mut self, k: &[f32], v: &[f32], o: Option<&[f32]>, head_dim: usize) {
        let mean_sq = |x: &[f32]| {
            x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>() / x.len().max(1) as f64
        };
        let head_sq = |x: &[f32]| mean_sq(x) * head_dim as f64 + NORM_EPS;
        self.k_sq.push(mean_sq(k));
        self.v_sq.push(mean_sq(v));
        self.k_hsq.push(head_sq(k));
        self.v_hsq.push(head_sq(v));
        self.o_sq.push(o.map_or(0.0, mean_sq));
    }
}

/// The sequence index of padding rows and queries ([`Rows::pad`]).
pub const PAD: usize = usize::MAX;

/// Where the rows of a batch of sequences come from: each key row's sequence and position,
/// each query's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    /// Sequence (index in the batch) of each key row.
    pub k_seq: Vec<usize>,
    /// Position of each key row in its sequence.
    pub k_pos: Vec<usize>,
    /// Sequence of each query.
    pub q_seq: Vec<usize>,
    /// Position of each query in its sequence.
    pub q_pos: Vec<usize>,
}

impl Rows {
    /// One sequence of `n` positions with queries at `q_pos`.
    pub fn one(n: usize, q_pos: &[usize]) -> Self {
        Self {
            k_seq: vec![0; n],
            k_pos: (0..n).collect(),
            q_seq: vec![0; q_pos.len()],
            q_pos: q_pos.to_vec(),
        }
    }

    /// Appends a sequence of `n` positions with queries at `q_pos`.
    pub fn push(&mut self, n: usize, q_pos: &[usize]) {
        let s = self.sequences();
        self.k_seq.extend(std::iter::repeat_n(s, n));
        self.k_pos.extend(0..n);
        self.q_seq.extend(std::iter::repeat_n(s, q_pos.len()));
        self.q_pos.extend_from_slice(q_pos);
    }

    /// Pads the key rows and the queries with [`PAD`] entries up to multiples of `multiple`
    /// (so that a GPU meets few distinct shapes); returns how many of each were added. Padding
    /// weighs nothing in any term, and no query of a sequence sees a padding key.
    pub fn pad(&mut self, multiple: usize) -> (usize, usize) {
        let up = |n: usize| n.div_ceil(multiple.max(1)) * multiple.max(1) - n;
        let (rows, queries) = (up(self.k_seq.len()), up(self.q_seq.len()));
        self.k_seq.extend(std::iter::repeat_n(PAD, rows));
        self.k_pos.extend(std::iter::repeat_n(0, rows));
        self.q_seq.extend(std::iter::repeat_n(PAD, queries));
        self.q_pos.extend(std::iter::repeat_n(0, queries));
        (rows, queries)
    }

    fn sequences(&self) -> usize {
        self.k_seq
            .iter()
            .rev()
            .find(|&&s| s != PAD)
            .map_or(0, |&s| s + 1)
    }
}

/// Which target constant a weighted mean is relative to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Relative {
    /// None: a plain mean.
    No,
    /// `mean(|K_h|²)`.
    KeyHeads,
    /// `mean(|V_h|²)`.
    ValueHeads,
    /// `mean(O_tgt²)`.
    Outputs,
}

/// The true tensors of a group's layers for a batch of sequences (their rows one after the
/// other), stacked by layer, with what the loss needs of them prepared ahead.
#[derive(Debug, Clone)]
pub struct GroupTargets {
    /// The queries as attention reads them (q_norm, RoPE at their positions, the score scale;
    /// [`GroupShape::queries`]), `[L · heads, Q, head_dim]` (attention losses only).
    pub q: Option<Tensor<3>>,
    /// Raw keys and values, `[L, R, kv_heads · head_dim]` each (`None` for a training step's
    /// loss, which reads only the prepared sides: [`HostTargets::new`]'s `raw`).
    pub kv: Option<(Tensor<3>, Tensor<3>)>,
    /// `|K_h|`, `|V_h|`, `|K_h ⊙ m_k|`, `|V_h ⊙ m_v|` of each head vector ([`TargetHeads`]),
    /// each `[L, R, kv_heads, 1]`.
    pub k_norms: Tensor<4>,
    /// See `k_norms`.
    pub v_norms: Tensor<4>,
    /// See `k_norms`.
    pub k_dir_norms: Tensor<4>,
    /// See `k_norms`.
    pub v_dir_norms: Tensor<4>,
    /// `[K ⊙ m_k²; V ⊙ m_v²]` ([`GroupShape::target_heads`]), `[2L, R · kv_heads, head_dim]`.
    pub dir: Tensor<3>,
    /// The per-head norms on the host (the trainer's loss weighs with them; no directions).
    pub heads: TargetHeads,
    /// Attention outputs at the queries, `[L, Q, hidden]` (attention losses only).
    pub o: Option<Tensor<3>>,
    /// Which sequence and position each row and query is.
    pub rows: Rows,
    /// Host constants of each sequence's targets.
    pub scales: Vec<TargetScales>,
    /// The rows' masks and key RoPE tables (attention losses only).
    pub attention: Option<AttentionInputs>,
}

impl GroupTargets {
    /// Every device tensor, flattened (views), in a fixed order, with its shape, onto `all`
    /// ([`super::pass::PassInputs::tensors`]).
    pub fn tensors(&self, all: &mut Vec<(Vec<usize>, Tensor<1>)>) {
        if let Some(q) = &self.q {
            push_flat(all, q);
        }
        if let Some((k, v)) = &self.kv {
            push_flat(all, k);
            push_flat(all, v);
        }
        for t in [
            &self.k_norms,
            &self.v_norms,
            &self.k_dir_norms,
            &self.v_dir_norms,
        ] {
            push_flat(all, t);
        }
        push_flat(all, &self.dir);
        if let Some(o) = &self.o {
            push_flat(all, o);
        }
        if let Some(a) = &self.attention {
            a.tensors(all);
        }
    }

    /// The targets of `members` (one [`LayerTargets`] per member layer of `group`, in order,
    /// all of one sequence), prepared as the trainer prepares a step's (reads them back).
    pub fn from_layers(group: &GroupFrozen, members: &[LayerTargets]) -> Self {
        let host = |t: &Tensor<2>| {
            t.clone()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32 targets")
        };
        let first = &members[0];
        let attention = first.q_raw.is_some() && first.o.is_some();
        let rows = Rows::one(first.k.dims()[0], &first.q_pos);
        let mut h = HostTargets::new(group.shape(), members.len(), rows, 1, attention, true);
        for tg in members {
            let q = tg.q_raw.as_ref().filter(|_| attention).map(host);
            let o = tg.o.as_ref().filter(|_| attention).map(host);
            h.push(
                group.shape(),
                &host(&tg.k),
                &host(&tg.v),
                q.as_deref(),
                o.as_deref(),
            );
            h.end_member(group.shape());
        }
        h.upload(&first.k.device())
    }

    /// Per row (`of`: each row's sequence), `1 / (rows of its sequence · c)` with `c` the
    /// sequence's constant of layer `l` that `relative` names (or 1): `[L, R]` weights that make a weighted
    /// sum over rows the sum over sequences of per-sequence means (of relative values), each
    /// times `times`.
    pub(super) fn weights(&self, of: &[usize], c: Relative, times: f64) -> Tensor<2> {
        let w = self.host_weights(of, c, times);
        Tensor::from_data(
            TensorData::new(w, [self.layers(), of.len()]),
            &self.dir.device(),
        )
    }

    /// Member layers.
    fn layers(&self) -> usize {
        self.dir.dims()[0] / 2
    }

    /// [`Self::weights`] on the host, `[L, R]` row-major.
    fn host_weights(&self, of: &[usize], c: Relative, times: f64) -> Vec<f32> {
        let layers = self.layers();
        let mut count = vec![0usize; self.rows.sequences()];
        for &s in of.iter().filter(|&&s| s != PAD) {
            count[s] += 1;
        }
        let count = &count;
        (0..layers)
            .flat_map(|l| {
                of.iter().map(move |&s| {
                    if s == PAD {
                        return 0.0;
                    }
                    let sc = &self.scales[s];
                    let k = match c {
                        Relative::No => 1.0,
                        Relative::KeyHeads => sc.k_hsq[l],
                        Relative::ValueHeads => sc.v_hsq[l],
                        Relative::Outputs => sc.o_sq[l],
                    }
                    .max(1e-30);
                    (times / (count[s] as f64 * k)) as f32
                })
            })
            .collect()
    }

    /// What [`super::loss::group_loss`] weighs with for `kind` on `device`: the attention
    /// error per query (`1/(queries · hidden)` of its sequence, relative to its `mean(O²)`
    /// with `normalize_attention`) and, for the hybrid loss, [`Self::head_weights`].
    pub fn loss_weights(
        &self,
        kind: LossKind,
        lambdas: &Lambdas,
        normalize_attention: bool,
        device: &Device,
    ) -> LossWeights {
        if !kind.needs_attention() || self.o.is_none() {
            return LossWeights::default();
        }
        let o = self.o.as_ref().expect("attention targets");
        let [l, nq, hidden] = o.dims();
        let rel = if normalize_attention {
            Relative::Outputs
        } else {
            Relative::No
        };
        let w = self.host_weights(&self.rows.q_seq, rel, 1.0 / hidden as f64);
        let outputs = Tensor::from_data(TensorData::new(w, [l, nq, 1]), device);
        let l4 = [lambdas.kdir, lambdas.vdir, lambdas.kmag, lambdas.vmag];
        LossWeights {
            outputs: Some(outputs),
            heads: (kind == LossKind::AttnDistillHybrid).then(|| self.head_weights(l4, device)),
        }
    }

    /// What the trainer's loss weighs `[K̂; V̂]`'s head vectors with ([`super::loss::group_loss`]),
    /// each `[2L, R · kv_heads, 2]` (column 0: the magnitude terms, column 1: the directions):
    /// the target norms subtracted from the predictions' (`|K_h|`, `|V_h|`; 0 in column 1),
    /// the magnitude terms' weights (`λ_kmag / (heads · rows · mean|K_h|²)` per row of a
    /// sequence, the values' alike; 0 in column 1) and the direction terms' (`λ_kdir / (heads ·
    /// rows · |K_h ⊙ m_k|)`, the values' alike; 0 in column 0).
    pub fn head_weights(&self, lambdas: [f64; 4], device: &Device) -> [Tensor<3>; 3] {
        let [kdir, vdir, kmag, vmag] = lambdas;
        let h = &self.heads;
        let l = self.layers();
        let kvh = h.k_norms.len() / (l * self.rows.k_seq.len()).max(1);
        let per_head = 1.0 / kvh.max(1) as f64;
        let of = &self.rows.k_seq;
        let (mut norms, mut mag, mut dir) = (Vec::new(), Vec::new(), Vec::new());
        let sides = [
            (&h.k_norms, &h.k_dir_norms, Relative::KeyHeads, kmag, kdir),
            (&h.v_norms, &h.v_dir_norms, Relative::ValueHeads, vmag, vdir),
        ];
        for (n, dn, relative, lm, ld) in sides {
            let wm = self.host_weights(of, relative, lm * per_head);
            let wd = self.host_weights(of, Relative::No, ld * per_head);
            for (i, (&a, &b)) in n.iter().zip(dn).enumerate() {
                let row = i / kvh.max(1);
                norms.extend([a, 0.0]);
                mag.extend([wm[row], 0.0]);
                dir.extend([0.0, wd[row] / b]);
            }
        }
        let shape = [2 * l, norms.len() / (4 * l).max(1), 2];
        [norms, mag, dir].map(|v| Tensor::from_data(TensorData::new(v, shape), device))
    }
}

/// One group's targets for a pass, gathered and prepared on the host (on the reader's threads
/// in training), member by member and within a member sequence by sequence
/// ([`Self::push`], [`Self::end_member`]); each buffer one upload ([`Self::upload`]).
#[derive(Debug, Clone)]
pub struct HostTargets {
    layers: usize,
    head_dim: usize,
    /// Width of an attention output row (known from the first pushed one).
    hidden: usize,
    q: Option<Vec<f32>>,
    /// Raw keys and values (with `raw`).
    kv: Option<(Vec<f32>, Vec<f32>)>,
    heads: TargetHeads,
    /// `[K ⊙ m_k²; V ⊙ m_v²]`, `[2L, R, kv_heads · d]` ([`GroupShape::target_heads`]).
    dir: Vec<f32>,
    o: Option<Vec<f32>>,
    rows: Rows,
    scales: Vec<TargetScales>,
    attention: Option<HostAttention>,
    /// Where the next [`Self::push`] goes: member, sequence, first query, key rows filled.
    member: usize,
    seq: usize,
    query: usize,
    filled: usize,
}

impl HostTargets {
    /// An empty set for `layers` members over `rows` (padded, [`Rows::pad`]) of `sequences`
    /// sequences; with `attention`, the queries, outputs, masks and key tables too; with `raw`,
    /// the raw keys and values (the terms read them: evaluation; a training step's loss does
    /// not).
    pub fn new(
        shape: &GroupShape,
        layers: usize,
        rows: Rows,
        sequences: usize,
        attention: bool,
        raw: bool,
    ) -> Self {
        let (nq, n) = (rows.q_pos.len(), rows.k_pos.len());
        Self {
            layers,
            head_dim: shape.head_dim,
            hidden: 0,
            q: attention.then(|| vec![0.0; layers * shape.heads * nq * shape.head_dim]),
            kv: raw.then(|| (Vec::new(), Vec::new())),
            heads: TargetHeads::default(),
            dir: vec![0.0; 2 * layers * n * shape.kv_heads * shape.head_dim],
            o: attention.then(Vec::new),
            attention: attention.then(|| shape.host(&rows)),
            rows,
            scales: vec![TargetScales::default(); sequences],
            member: 0,
            seq: 0,
            query: 0,
            filled: 0,
        }
    }

    /// The current member's next sequence: raw keys and values at every position (`[n,
    /// kv_heads · d]`), with attention its raw queries and outputs at its query positions
    /// (`[nq, heads · d]`, `[nq, hidden]`).
    pub fn push(
        &mut self,
        shape: &GroupShape,
        k: &[f32],
        v: &[f32],
        q: Option<&[f32]>,
        o: Option<&[f32]>,
    ) {
        let d = shape.head_dim;
        let (m, nq_all) = (self.member, self.rows.q_pos.len());
        if let Some((rk, rv)) = &mut self.kv {
            rk.extend_from_slice(k);
            rv.extend_from_slice(v);
        }
        // This member's rows from the first unfilled one, in the keys' half of the directions
        // and in the values' half.
        let width = shape.kv_heads * d;
        let (n, l) = (self.rows.k_pos.len(), self.layers);
        let at = (m * n + self.filled) * width;
        let (keys, values) = self.dir.split_at_mut(l * n * width);
        shape.target_heads(
            m,
            (k, v),
            &mut self.heads,
            (&mut keys[at..at + k.len()], &mut values[at..at + v.len()]),
        );
        self.filled += k.len() / width.max(1);
        self.scales[self.seq].push(k, v, o, d);
        if let (Some(all), Some(q), Some(out), Some(o)) = (&mut self.q, q, &mut self.o, o) {
            let nq = q.len() / (shape.heads * d).max(1);
            let positions = &self.rows.q_pos[self.query..self.query + nq];
            let slab = shape.heads * nq_all * d;
            let member = &mut all[m * slab..(m + 1) * slab];
            shape.queries(m, q, positions, member, nq_all, self.query);
            out.extend_from_slice(o);
            self.hidden = o.len() / nq.max(1);
            self.query += nq;
        }
        self.seq += 1;
    }

    /// Ends the current member: its padding rows and queries (zeros) appended.
    pub fn end_member(&mut self, shape: &GroupShape) {
        let width = shape.kv_heads * shape.head_dim;
        let pad = self.rows.k_pos.len() - self.filled;
        let zeros = vec![0.0; pad * width];
        if let Some((rk, rv)) = &mut self.kv {
            rk.extend_from_slice(&zeros);
            rv.extend_from_slice(&zeros);
        }
        // Padding rows' norms; their directions stay the zeros the buffer was made with (the
        // ones written to this scratch are zeros too).
        let (mut dk, mut dv) = (zeros.clone(), zeros.clone());
        shape.target_heads(
            self.member,
            (&zeros, &zeros),
            &mut self.heads,
            (&mut dk, &mut dv),
        );
        if let Some(o) = &mut self.o {
            let nq = self.rows.q_pos.len();
            o.extend(std::iter::repeat_n(0.0, (nq - self.query) * self.hidden));
        }
        self.member += 1;
        self.seq = 0;
        self.query = 0;
        self.filled = 0;
    }

    /// The tensors on `device` ([`Self::into_data`], then [`TargetData::upload`]).
    pub fn upload(self, device: &Device) -> GroupTargets {
        self.into_data().upload(device)
    }

    /// The host vectors as shaped data for upload (no copy).
    pub fn into_data(self) -> TargetData {
        let (l, r) = (self.layers, self.rows.k_pos.len());
        let nq = self.rows.q_pos.len();
        let stacked = |data: Vec<f32>, rows: usize| {
            let cols = data.len() / (l * rows).max(1);
            TensorData::new(data, [l, rows, cols])
        };
        let heads = |data: Vec<f32>| {
            let kvh = data.len() / (l * r).max(1);
            TensorData::new(data, [l, r, kvh, 1])
        };
        let h = self.heads;
        let d = self.head_dim;
        let head_rows = h.k_norms.len() / l.max(1);
        TargetData {
            q: self.q.map(|q| {
                let heads = q.len() / (nq * d).max(1);
                TensorData::new(q, [heads, nq, d])
            }),
            kv: self.kv.map(|(k, v)| (stacked(k, r), stacked(v, r))),
            norms: [
                heads(h.k_norms.clone()),
                heads(h.v_norms.clone()),
                heads(h.k_dir_norms.clone()),
                heads(h.v_dir_norms.clone()),
            ],
            dir: TensorData::new(self.dir, [2 * l, head_rows, d]),
            heads: h,
            o: self.o.map(|o| stacked(o, nq)),
            rows: self.rows,
            scales: self.scales,
            attention: self.attention.map(HostAttention::into_data),
        }
    }
}

/// A group's targets as shaped host data ([`HostTargets::into_data`]), which the f_θ reader
/// stages ([`Prepared::stage`](super::step::Prepared::stage)) before the step uploads them
/// ([`Self::upload`]).
#[derive(Debug, Clone)]
pub struct TargetData {
    q: Option<TensorData>,
    kv: Option<(TensorData, TensorData)>,
    /// `|K_h|`, `|V_h|`, `|K_h ⊙ m_k|`, `|V_h ⊙ m_v|`.
    norms: [TensorData; 4],
    dir: TensorData,
    heads: TargetHeads,
    o: Option<TensorData>,
    rows: Rows,
    scales: Vec<TargetScales>,
    /// The key tables and masks ([`HostAttention::into_data`]).
    attention: Option<[TensorData; 2]>,
}

impl TargetData {
    /// Every buffer bound for the device (what [`Prepared::stage`](super::step::Prepared::stage)
    /// moves into the device's transfer memory).
    pub fn buffers(&mut self) -> impl Iterator<Item = &mut TensorData> {
        let (k, v) = match &mut self.kv {
            Some((k, v)) => (Some(k), Some(v)),
            None => (None, None),
        };
        self.q
            .iter_mut()
            .chain(k)
            .chain(v)
            .chain(self.norms.iter_mut())
            .chain(std::iter::once(&mut self.dir))
            .chain(self.o.iter_mut())
            .chain(self.attention.iter_mut().flatten())
    }

    /// The tensors on `device`.
    pub fn upload(self, device: &Device) -> GroupTargets {
        let tensor = |data: TensorData| Tensor::<3>::from_data(data, device);
        let [k_norms, v_norms, k_dir_norms, v_dir_norms] =
            self.norms.map(|n| Tensor::<4>::from_data(n, device));
        GroupTargets {
            q: self.q.map(tensor),
            kv: self.kv.map(|(k, v)| (tensor(k), tensor(v))),
            k_norms,
            v_norms,
            k_dir_norms,
            v_dir_norms,
            dir: tensor(self.dir),
            heads: self.heads,
            o: self.o.map(tensor),
            rows: self.rows,
            scales: self.scales,
            attention: self
                .attention
                .map(|a| AttentionInputs::from_data(a, device)),
        }
    }
}
