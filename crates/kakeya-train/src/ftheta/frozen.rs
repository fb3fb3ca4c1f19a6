//! The verifier's frozen attention pieces that f_θ's attention loss runs through: one layer's
//! ([`LayerFrozen`]) and those of layers of one shape stacked along a leading layer axis
//! ([`GroupFrozen`]), whose attention serves every member layer and every sequence of a batch
//! in one pass.

use burn::tensor::{Device, Int, Tensor, TensorData};
use kakeya_models::gemma::attention::Attention;
use kakeya_models::norm::RmsNorm;
use kakeya_models::rope::Rope;
use kakeya_models::sdpa::grouped_attention;
use kakeya_weights::AttentionKind;

use super::loss::Rows;

/// Masked-out score (large and finite, so that gradients through softmax stay finite).
const MASKED: f32 = -1e9;

/// The verifier's frozen pieces of one layer's attention.
#[derive(Debug, Clone)]
pub struct LayerFrozen {
    /// Per-head query RMSNorm (Gemma's `1 + w` multiplier).
    pub q_norm: RmsNorm,
    /// Per-head key RMSNorm.
    pub k_norm: RmsNorm,
    /// Gemma 4's weightless per-head value RMSNorm (`None`: Gemma 3, values as projected).
    pub v_norm: Option<RmsNorm>,
    /// `o_proj` weight, `[hidden, heads · head_dim]`.
    pub o_proj: Tensor<2>,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f64,
    /// Sliding window (`None`: global, causal only).
    pub window: Option<usize>,
    /// This layer's RoPE.
    pub rope: Rope,
}

impl LayerFrozen {
    /// Copies a verifier layer's attention weights onto `device` (its autodiff twin when
    /// training; they never require gradients).
    pub fn from_attention(a: &Attention, device: &Device) -> Self {
        let to1 = |t: &Tensor<1>| Tensor::<1>::from_data(t.to_data(), device);
        let copy = |n: &RmsNorm| RmsNorm {
            scale: to1(&n.scale),
            eps: n.eps,
        };
        Self {
            q_norm: copy(&a.q_norm),
            k_norm: copy(&a.k_norm),
            v_norm: a.v_norm.as_ref().map(copy),
            o_proj: Tensor::from_data(a.o_proj.dense_weight().to_data(), device),
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            scale: a.scale,
            window: (a.kind == AttentionKind::Sliding).then_some(a.window),
            rope: a.rope.clone(),
        }
    }

    /// Whether this is a global (full-attention) layer.
    pub fn is_global(&self) -> bool {
        self.window.is_none()
    }
}

/// Whether a query at position `q` sees the key at `k` under a causal mask with this sliding
/// `window` (`None`: global).
fn visible(window: Option<usize>, q: usize, k: usize) -> bool {
    k <= q && window.is_none_or(|w| q - k < w)
}

/// The frozen attention pieces of layers of one shape (heads, head width, score scale),
/// stacked along a leading layer axis so that one launch serves them all.
#[derive(Debug, Clone)]
pub struct GroupFrozen {
    /// The members' verifier layer indices.
    pub ids: Vec<usize>,
    /// The members, in order.
    pub layers: Vec<LayerFrozen>,
    /// Key/value norm multipliers, `[L, 1, 1, head_dim]` (values: `None` without a v_norm;
    /// queries are normed on the host, [`GroupShape::queries`]).
    pub(super) k_scale: Tensor<4>,
    pub(super) v_scale: Option<Tensor<4>>,
    /// [`GroupShape::square_multipliers`] on the device, `[2L, head_dim, 2]`.
    pub(super) square_mult: Tensor<3>,
    /// `o_projᵀ` of each member, `[L, heads · head_dim, hidden]`.
    o_proj_t: Tensor<3>,
    /// The host side: what the queries, target constants, masks and tables are prepared with.
    shape: GroupShape,
    /// Each member's index into the distinct windows and RoPEs (once on the device:
    /// `window_of` per KV head, `[L · kv_heads]`; `rope_of`, `[L]`).
    window_of: Tensor<1, Int>,
    rope_of: Tensor<1, Int>,
}

/// The host side of a group: its attention shape and its members' norm multipliers, windows
/// and RoPEs (plain data, for the f_θ reader's threads), from which a step's target-side inputs
/// are prepared ahead of the step: the queries as attention reads them ([`Self::queries`]), the
/// targets' per-head constants ([`Self::target_heads`]), the masks and key RoPE tables
/// ([`Self::host`]).
#[derive(Debug, Clone)]
pub struct GroupShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale.
    scale: f32,
    /// Each member's q_norm multiplier and the norm's epsilon.
    q_mult: Vec<Vec<f32>>,
    q_eps: f32,
    /// Each member's k_norm multiplier (key directions are compared after it).
    k_mult: Vec<Vec<f32>>,
    /// Each member's v_norm multiplier (`None`: no v_norm).
    v_mult: Option<Vec<Vec<f32>>>,
    windows: Vec<Option<usize>>,
    ropes: Vec<Rope>,
    rope_of: Vec<usize>,
}

/// A group's target-side constants per head vector ([`GroupShape::target_heads`]), member
/// after member, each member's rows in order.
#[derive(Debug, Clone, Default)]
pub struct TargetHeads {
    /// `|K_h|` of each row's head vectors, `[L, R, kv_heads]`.
    pub k_norms: Vec<f32>,
    /// `|V_h|`.
    pub v_norms: Vec<f32>,
    /// `|K_h ⊙ m_k|` (m_k: the k_norm multiplier; a key's direction after k_norm is that of
    /// `K ⊙ m_k`, the norm's own divisor being one positive number per vector).
    pub k_dir_norms: Vec<f32>,
    /// `|V_h ⊙ m_v|` (`|V_h|` without a v_norm).
    pub v_dir_norms: Vec<f32>,
}

/// `sqrt(Σx² + 1e-12)` of each `d`-wide head vector of `x`, appended to `out`.
fn head_norms(x: &[f32], d: usize, out: &mut Vec<f32>) {
    out.extend(x.chunks_exact(d).map(|h| {
        let ss: f64 = h.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
        (ss + super::loss::NORM_EPS).sqrt() as f32
    }));
}

/// `x ⊙ m` with `m` repeated over each `m.len()`-wide head vector, appended to `out`.
fn times(x: &[f32], m: &[f32], out: &mut Vec<f32>) {
    out.extend(
        x.chunks_exact(m.len())
            .flat_map(|h| h.iter().zip(m).map(|(a, b)| a * b)),
    );
}

/// A set of rows' masks and key RoPE tables on the host ([`GroupShape::host`]), one upload
/// each ([`HostAttention::into_data`], [`AttentionInputs::from_data`]).
#[derive(Debug, Clone)]
pub struct HostAttention {
    /// Every distinct RoPE's cosines then sines at the keys, `[ropes, 2, R, d/2]`.
    k_tables: Vec<f32>,
    /// Every distinct window's additive mask, `[windows, G · Q, R]`.
    mask: Vec<f32>,
    /// `[ropes, windows, G, Q, R]`.
    dims: [usize; 5],
}

/// [`HostAttention`] on the device: the distinct RoPEs' key tables and windows' masks, which
/// [`GroupFrozen::attention`] picks per member.
#[derive(Debug, Clone)]
pub struct AttentionInputs {
    k_tables: Tensor<4>,
    mask: Tensor<3>,
}

impl HostAttention {
    /// The key tables `[ropes, 2, R, d/2]` and the masks `[windows, G · Q, R]` as shaped data
    /// (no copy).
    pub fn into_data(self) -> [TensorData; 2] {
        let [ropes, windows, g, nq, n] = self.dims;
        let half = self.k_tables.len() / (2 * ropes * n).max(1);
        [
            TensorData::new(self.k_tables, [ropes, 2, n, half]),
            TensorData::new(self.mask, [windows, g * nq, n]),
        ]
    }
}

impl AttentionInputs {
    /// The key tables and masks, flattened (views), with their shapes, onto `all`.
    pub fn tensors(&self, all: &mut Vec<(Vec<usize>, Tensor<1>)>) {
        super::pass::push_flat(all, &self.k_tables);
        super::pass::push_flat(all, &self.mask);
    }

    /// The key tables and masks of [`HostAttention::into_data`] on `device`.
    pub fn from_data([k_tables, mask]: [TensorData; 2], device: &Device) -> Self {
        Self {
            k_tables: Tensor::from_data(k_tables, device),
            mask: Tensor::from_data(mask, device),
        }
    }
}

impl GroupShape {
    /// The masks and key tables of `rows` (a query sees the keys of its own sequence its
    /// layer's mask lets through).
    pub fn host(&self, rows: &Rows) -> HostAttention {
        let mut k_tables = Vec::new();
        for r in &self.ropes {
            let (cos, sin) = r.host_tables(&rows.k_pos);
            k_tables.extend(cos);
            k_tables.extend(sin);
        }
        let (nq, n) = (rows.q_pos.len(), rows.k_pos.len());
        let groups = self.heads / self.kv_heads;
        let mut mask = Vec::with_capacity(self.windows.len() * groups * nq * n);
        for &w in &self.windows {
            let row: Vec<f32> = (0..nq)
                .flat_map(|i| (0..n).map(move |j| (i, j)))
                .map(|(i, j)| {
                    let same = rows.q_seq[i] == rows.k_seq[j];
                    if same && visible(w, rows.q_pos[i], rows.k_pos[j]) {
                        0.0
                    } else {
                        MASKED
                    }
                })
                .collect();
            for _ in 0..groups {
                mask.extend_from_slice(&row);
            }
        }
        HostAttention {
            k_tables,
            mask,
            dims: [self.ropes.len(), self.windows.len(), groups, nq, n],
        }
    }

    /// Member `member`'s raw queries (`q_raw`: `[nq, heads · d]`, at `positions`) as its
    /// attention reads them — q_norm, RoPE at their positions, times the score scale — written
    /// head-major into `slab` (the member's `[heads, q_total, d]`) from query `first` on.
    pub fn queries(
        &self,
        member: usize,
        q_raw: &[f32],
        positions: &[usize],
        slab: &mut [f32],
        q_total: usize,
        first: usize,
    ) {
        let d = self.head_dim;
        let half = d / 2;
        let (cos, sin) = self.ropes[self.rope_of[member]].host_tables(positions);
        let mut head = vec![0.0f32; d];
        for (i, row) in q_raw.chunks_exact(self.heads * d).enumerate() {
            for (h, x) in row.chunks_exact(d).enumerate() {
                head.copy_from_slice(x);
                RmsNorm::normalize_host(&mut head, &self.q_mult[member], self.q_eps);
                Rope::rotate_host(
                    &mut head,
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                let at = (h * q_total + first + i) * d;
                for (o, &v) in slab[at..at + d].iter_mut().zip(&head) {
                    *o = v * self.scale;
                }
            }
        }
    }

    /// Member `member`'s per-head target constants of raw keys `k` and values `v` (`[R,
    /// kv_heads · d]` each), appended to `out`, and the rows' directions `K ⊙ m_k²` and `V ⊙
    /// m_v²` (`V` without a v_norm; a prediction's dot product with them is that of the two
    /// directions, `(K̂ ⊙ m)·(K ⊙ m)`) written to `dir_k`, `dir_v` (`k`'s and `v`'s size).
    pub fn target_heads(
        &self,
        member: usize,
        (k, v): (&[f32], &[f32]),
        out: &mut TargetHeads,
        (dir_k, dir_v): (&mut [f32], &mut [f32]),
    ) {
        let d = self.head_dim;
        head_norms(k, d, &mut out.k_norms);
        head_norms(v, d, &mut out.v_norms);
        let scaled = |x: &[f32], m: &[f32], norms: &mut Vec<f32>, dir: &mut [f32]| {
            let mut once = Vec::with_capacity(x.len());
            times(x, m, &mut once);
            head_norms(&once, d, norms);
            for (o, (a, b)) in dir.iter_mut().zip(once.iter().zip(m.iter().cycle())) {
                *o = a * b;
            }
        };
        scaled(k, &self.k_mult[member], &mut out.k_dir_norms, dir_k);
        match &self.v_mult {
            Some(m) => scaled(v, &m[member], &mut out.v_dir_norms, dir_v),
            None => {
                head_norms(v, d, &mut out.v_dir_norms);
                dir_v.copy_from_slice(v);
            }
        }
    }

    /// Each member's multipliers squared for the keys then for the values, beside ones:
    /// `[2L, d, 2]`, so that the squares of `[K̂; V̂]` head vectors times it give `Σx²` and
    /// `Σ(x ⊙ m)²` of each in one product.
    fn square_multipliers(&self) -> Vec<f32> {
        let d = self.head_dim;
        let ones = vec![1.0f32; d];
        let values: Vec<&[f32]> = match &self.v_mult {
            Some(m) => m.iter().map(Vec::as_slice).collect(),
            None => vec![&ones; self.k_mult.len()],
        };
        let mut out = Vec::with_capacity(2 * self.k_mult.len() * d * 2);
        for m in self.k_mult.iter().map(Vec::as_slice).chain(values) {
            for &x in m {
                out.extend([1.0, x * x]);
            }
        }
        out
    }
}

/// The distinct values of `items` (first-appearance order) and each item's index into them.
fn distinct<T: PartialEq + Clone>(items: impl Iterator<Item = T>) -> (Vec<T>, Vec<usize>) {
    let mut values: Vec<T> = Vec::new();
    let index = items
        .map(|x| match values.iter().position(|v| *v == x) {
            Some(i) => i,
            None => {
                values.push(x);
                values.len() - 1
            }
        })
        .collect();
    (values, index)
}

impl GroupFrozen {
    /// Stacks `layers` (all of one shape), verifier layers `ids`.
    ///
    /// # Panics
    /// When the layers differ in heads, KV heads, head width, score scale or whether they
    /// norm values (f_θ groups layers by KV width, which fixes these in Gemma 3 and 4).
    pub fn new(ids: Vec<usize>, layers: Vec<LayerFrozen>) -> Self {
        let f = &layers[0];
        assert!(
            layers.iter().all(|l| (l.heads, l.kv_heads, l.head_dim)
                == (f.heads, f.kv_heads, f.head_dim)
                && l.scale == f.scale
                && l.v_norm.is_some() == f.v_norm.is_some()),
            "f_θ's loss stacks only layers of one attention shape"
        );
        let hd = f.head_dim;
        let stack = |pick: &dyn Fn(&LayerFrozen) -> Tensor<1>| {
            Tensor::stack::<2>(layers.iter().map(pick).collect(), 0).reshape([
                layers.len(),
                1,
                1,
                hd,
            ])
        };
        let k_scale = stack(&|l| l.k_norm.scale.clone());
        let v_scale = f.v_norm.as_ref().map(|_| {
            stack(&|l| {
                l.v_norm
                    .as_ref()
                    .expect("every member norms values")
                    .scale
                    .clone()
            })
        });
        let o_proj_t = Tensor::stack::<3>(
            layers
                .iter()
                .map(|l| l.o_proj.clone().transpose())
                .collect(),
            0,
        );
        let (windows, window_of) = distinct(layers.iter().map(|l| l.window));
        let (ropes, rope_of) = distinct(layers.iter().map(|l| l.rope.clone()));
        let device = f.o_proj.device();
        let per_head: Vec<usize> = window_of
            .iter()
            .flat_map(|&w| std::iter::repeat_n(w, f.kv_heads))
            .collect();
        let host = |n: &RmsNorm| {
            n.scale
                .clone()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32 norm multipliers")
        };
        let shape = GroupShape {
            heads: f.heads,
            kv_heads: f.kv_heads,
            head_dim: hd,
            scale: f.scale as f32,
            q_mult: layers.iter().map(|l| host(&l.q_norm)).collect(),
            q_eps: f.q_norm.eps as f32,
            k_mult: layers.iter().map(|l| host(&l.k_norm)).collect(),
            v_mult: f.v_norm.as_ref().map(|_| {
                layers
                    .iter()
                    .map(|l| host(l.v_norm.as_ref().expect("every member norms values")))
                    .collect()
            }),
            windows,
            ropes,
            rope_of: rope_of.clone(),
        };
        let square_mult = Tensor::from_data(
            TensorData::new(shape.square_multipliers(), [2 * layers.len(), hd, 2]),
            &device,
        );
        Self {
            ids,
            square_mult,
            window_of: index(&per_head, &device),
            rope_of: index(&rope_of, &device),
            shape,
            layers,
            k_scale,
            v_scale,
            o_proj_t,
        }
    }

    /// See [`GroupShape`].
    pub fn shape(&self) -> &GroupShape {
        &self.shape
    }

    pub(super) fn first(&self) -> &LayerFrozen {
        &self.layers[0]
    }

    /// `[L, n, width]` → `[L, n, heads, head_dim]`.
    pub(super) fn head_vectors(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [l, n, _] = x.dims();
        x.reshape([l, n, heads, self.first().head_dim])
    }

    /// RMSNorm of head vectors with each member's multiplier.
    fn norm(x: Tensor<4>, scale: &Tensor<4>, eps: f64) -> Tensor<4> {
        // `scale` is `[L, 1, 1, d]`; head vectors here are `[L, n, heads, d]`.
        RmsNorm::normalize(x, eps) * scale.clone()
    }

    pub(super) fn keys_normed(&self, hk: Tensor<4>) -> Tensor<4> {
        Self::norm(hk, &self.k_scale, self.first().k_norm.eps)
    }

    /// Value head vectors as attention reads them (v_norm where the model has one).
    pub(super) fn values(&self, hv: Tensor<4>) -> Tensor<4> {
        match (&self.v_scale, &self.first().v_norm) {
            (Some(s), Some(n)) => Self::norm(hv, s, n.eps),
            _ => hv,
        }
    }

    /// Each member's RoPE tables, picked from the distinct RoPEs' (`[ropes, 2, T, d/2]`):
    /// `[L, 1, T, d/2]` each.
    fn tables(&self, kinds: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let per_layer = kinds.select(0, self.rope_of.clone());
        (per_layer.clone().narrow(1, 0, 1), per_layer.narrow(1, 1, 1))
    }

    /// Every member's attention output (after o_proj) at the queries `q` (prepared on the
    /// host, [`GroupShape::queries`]) over raw keys and values (each query within its own
    /// sequence), the masks and key RoPE tables from `inputs`. Each member's mask is picked
    /// from the distinct windows', rows group-major as [`grouped_attention`] reads them:
    /// `[L · kv_heads, G · Q, R]`.
    ///
    /// # Shapes
    /// - `q`: `[L · heads, Q, head_dim]`; `k_raw`, `v_raw`: `[L, R, kv_heads · head_dim]`
    /// - returns `[L, Q, hidden]`
    pub fn attention(
        &self,
        q: Tensor<3>,
        inputs: &AttentionInputs,
        k_raw: Tensor<3>,
        v_raw: Tensor<3>,
    ) -> Tensor<3> {
        let f = self.first();
        let (l, hd) = (self.layers.len(), f.head_dim);
        let [_, n, _] = k_raw.dims();
        let nq = q.dims()[1];
        let (kc, ks) = self.tables(inputs.k_tables.clone());
        let k = self
            .keys_normed(self.head_vectors(k_raw, f.kv_heads))
            .swap_dims(1, 2);
        let v = self
            .values(self.head_vectors(v_raw, f.kv_heads))
            .swap_dims(1, 2);
        let k = Rope::rotate(k, kc, ks).reshape([l * f.kv_heads, n, hd]);
        let v = v.reshape([l * f.kv_heads, n, hd]);
        let mask = inputs.mask.clone().select(0, self.window_of.clone());
        // The score scale is in the prepared queries.
        grouped_attention(q, k, v, 1.0, Some(mask))
            .reshape([nq, l, f.heads * hd])
            .swap_dims(0, 1)
            .matmul(self.o_proj_t.clone())
    }
}

fn index(ids: &[usize], device: &Device) -> Tensor<1, Int> {
    let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(ids.clone(), [ids.len()]), device)
}
