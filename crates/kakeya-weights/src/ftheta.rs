//! f_θ checkpoints: `config.json` + `f_theta.safetensors`.
//!
//! f_θ maps the drafter's per-position context K (and, on a separate path, V) to the
//! verifier's raw k_proj / v_proj outputs. Each path is a shared encoder
//! `Linear(drafter_layers · drafter_kv_dim → rank)` and one decoder
//! `Linear(rank → verifier_kv_dim)` per verifier layer (with `inputs = "both"` each path reads
//! the drafter's K and V concatenated, twice the width). Tensor names:
//! `{k,v}_enc.weight [rank, in]`, `{k,v}_enc.bias [rank]`, `{k,v}_dec.{L}.weight [out, rank]`,
//! `{k,v}_dec.{L}.bias [out]` (biases only when `bias` is set).
//!
//! A checkpoint belongs to one verifier and one drafter: the config records both models' content
//! hashes (as `kakeya capture` computes them), and [`FThetaCheckpoint::check_pair`] refuses any
//! other pair.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    HostTensor, read_safetensors_as, write_dir_atomically, write_safetensors_f32,
};
use crate::error::{Result, WeightsError};

/// `format` value of an f_θ `config.json`.
pub const FTHETA_FORMAT: &str = "kakeya-f-theta";
/// Version of the layout.
pub const FTHETA_VERSION: u32 = 1;
/// Weights file inside an f_θ folder.
pub const FTHETA_WEIGHTS: &str = "f_theta.safetensors";

/// What each path reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FThetaInputs {
    /// The K path reads the drafter's K, the V path its V (DESIGN §7).
    #[default]
    Own,
    /// Both paths read `[drafter K ; drafter V]` (twice the input width).
    Both,
}

/// A model f_θ belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRef {
    /// Path it was trained with (informational).
    pub path: PathBuf,
    /// SHA-256 of the GGUF file, or of a folder's files in name order.
    pub sha256: String,
}

/// f_θ's shape and owners (`config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FThetaConfig {
    /// Always [`FTHETA_FORMAT`].
    pub format: String,
    /// Always [`FTHETA_VERSION`].
    pub version: u32,
    /// The verifier whose K/V it predicts.
    pub verifier: ModelRef,
    /// The drafter whose context K/V it reads.
    pub drafter: ModelRef,
    /// Drafter layers whose K (and V) are concatenated into the input, in order.
    pub drafter_layers: Vec<usize>,
    /// Per-layer drafter KV width (`kv_heads · head_dim`).
    pub drafter_kv_dim: usize,
    /// What each path reads.
    #[serde(default)]
    pub inputs: FThetaInputs,
    /// Encoder width.
    pub rank: usize,
    /// Verifier layers (one decoder each, in this order): the layers with K/V of their own,
    /// `0..verifier_layers` (Gemma 4's KV-sharing layers come last and read these).
    pub verifier_layers: usize,
    /// Verifier KV width (`kv_heads · head_dim`) of every layer, unless
    /// [`Self::verifier_kv_dims`] gives each layer its own.
    pub verifier_kv_dim: usize,
    /// Each verifier layer's KV width where the layers differ (Gemma 4's full and sliding
    /// layers); empty when every layer is [`Self::verifier_kv_dim`] wide.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verifier_kv_dims: Vec<usize>,
    /// Whether the linear maps have biases.
    pub bias: bool,
    /// The loss it was trained with (informational).
    #[serde(default)]
    pub loss: String,
}

impl FThetaConfig {
    /// Input width of each path.
    pub fn in_dim(&self) -> usize {
        let per = self.drafter_layers.len() * self.drafter_kv_dim;
        match self.inputs {
            FThetaInputs::Own => per,
            FThetaInputs::Both => 2 * per,
        }
    }

    /// Verifier layer `layer`'s KV width (the width of its decoder's output).
    pub fn kv_dim_of(&self, layer: usize) -> usize {
        self.verifier_kv_dims
            .get(layer)
            .copied()
            .unwrap_or(self.verifier_kv_dim)
    }

    /// Every verifier layer's KV width, in order.
    pub fn layer_widths(&self) -> Vec<usize> {
        (0..self.verifier_layers)
            .map(|l| self.kv_dim_of(l))
            .collect()
    }

    /// The same config predicting layers of these widths (one decoder each): a config with
    /// equal widths records one [`Self::verifier_kv_dim`], as before per-layer widths existed.
    ///
    /// # Panics
    /// When `widths` is empty.
    pub fn with_layer_widths(mut self, widths: &[usize]) -> Self {
        self.verifier_layers = widths.len();
        self.verifier_kv_dim = widths[0];
        self.verifier_kv_dims = if widths.iter().all(|&w| w == widths[0]) {
            Vec::new()
        } else {
            widths.to_vec()
        };
        self
    }

    /// The tensors of each linear map: its weight, and its bias when the maps have one.
    fn parts(&self) -> &'static [&'static str] {
        if self.bias {
            &["weight", "bias"]
        } else {
            &["weight"]
        }
    }

    /// The PyTorch shape of `part` of a map with `out` outputs reading `inp` inputs.
    fn part_shape(part: &str, out: usize, inp: usize) -> Vec<usize> {
        if part == "weight" {
            vec![out, inp]
        } else {
            vec![out]
        }
    }

    /// Every tensor name with its PyTorch shape, K path first.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = Vec::new();
        for p in ["k", "v"] {
            for part in self.parts() {
                let shape = Self::part_shape(part, self.rank, self.in_dim());
                v.push((format!("{p}_enc.{part}"), shape));
            }
            for l in 0..self.verifier_layers {
                for part in self.parts() {
                    let shape = Self::part_shape(part, self.kv_dim_of(l), self.rank);
                    v.push((format!("{p}_dec.{l}.{part}"), shape));
                }
            }
        }
        v
    }

    /// The verifier layers grouped by KV width, groups in order of their first layer: each
    /// group's decoders run as one stacked product ([`Self::stacked_tensors`]).
    pub fn width_groups(&self) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (l, w) in self.layer_widths().into_iter().enumerate() {
            match groups.iter_mut().find(|(gw, _)| *gw == w) {
                Some((_, layers)) => layers.push(l),
                None => groups.push((w, vec![l])),
            }
        }
        groups
    }

    /// The tensors with each width group's decoders stacked (the trainer's layout), with their
    /// shapes: `{p}_dec.w{width}.weight` is `[layers · width, rank]` (the group's layers'
    /// `[width, rank]` weights one under the other, in layer order) and `{p}_dec.w{width}.bias`
    /// `[layers · width]`; the encoders as in [`Self::expected_tensors`].
    pub fn stacked_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = Vec::new();
        for p in ["k", "v"] {
            for part in self.parts() {
                let shape = Self::part_shape(part, self.rank, self.in_dim());
                v.push((format!("{p}_enc.{part}"), shape));
            }
            for (w, layers) in self.width_groups() {
                for part in self.parts() {
                    let shape = Self::part_shape(part, layers.len() * w, self.rank);
                    v.push((format!("{p}_dec.w{w}.{part}"), shape));
                }
            }
        }
        v
    }

    /// Per-layer tensors ([`Self::expected_tensors`], taken out of `layered`) in the stacked
    /// layout ([`Self::stacked_tensors`]). Errors name a missing or misshapen tensor.
    pub fn stack(
        &self,
        layered: &mut BTreeMap<String, HostTensor>,
    ) -> std::result::Result<BTreeMap<String, HostTensor>, String> {
        let mut take = |name: String, shape: Vec<usize>| {
            let t = layered
                .remove(&name)
                .ok_or_else(|| format!("missing tensor {name}"))?;
            if t.data.len() != shape.iter().product::<usize>() {
                return Err(format!(
                    "tensor {name} has {} values, expected shape {shape:?}",
                    t.data.len()
                ));
            }
            Ok(HostTensor {
                shape,
                data: t.data,
            })
        };
        let mut out = BTreeMap::new();
        for p in ["k", "v"] {
            for part in self.parts() {
                let name = format!("{p}_enc.{part}");
                let shape = Self::part_shape(part, self.rank, self.in_dim());
                out.insert(name.clone(), take(name, shape)?);
            }
            for (w, layers) in self.width_groups() {
                for part in self.parts() {
                    let mut data = Vec::new();
                    for &l in &layers {
                        let shape = Self::part_shape(part, w, self.rank);
                        data.extend(take(format!("{p}_dec.{l}.{part}"), shape)?.data);
                    }
                    let shape = Self::part_shape(part, layers.len() * w, self.rank);
                    out.insert(format!("{p}_dec.w{w}.{part}"), HostTensor { shape, data });
                }
            }
        }
        Ok(out)
    }

    /// The inverse of [`Self::stack`]: per-layer tensors from the stacked layout.
    ///
    /// # Panics
    /// When `stacked` lacks a tensor of [`Self::stacked_tensors`] (the caller built it).
    pub fn unstack(&self, stacked: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
        let mut out = BTreeMap::new();
        for p in ["k", "v"] {
            for part in self.parts() {
                let name = format!("{p}_enc.{part}");
                out.insert(name.clone(), stacked[&name].clone());
            }
            for (w, layers) in self.width_groups() {
                for part in self.parts() {
                    let all = &stacked[&format!("{p}_dec.w{w}.{part}")].data;
                    let shape = Self::part_shape(part, w, self.rank);
                    let per: usize = shape.iter().product();
                    for (i, &l) in layers.iter().enumerate() {
                        let data = all[i * per..(i + 1) * per].to_vec();
                        let t = HostTensor {
                            shape: shape.clone(),
                            data,
                        };
                        out.insert(format!("{p}_dec.{l}.{part}"), t);
                    }
                }
            }
        }
        out
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(WeightsError::format(path, m));
        if self.format != FTHETA_FORMAT {
            return bad(format!(
                "format is {:?}, not an f_θ config ({FTHETA_FORMAT:?})",
                self.format
            ));
        }
        if self.version != FTHETA_VERSION {
            return bad(format!(
                "f_θ layout version {} is not supported (this build reads {FTHETA_VERSION})",
                self.version
            ));
        }
        if self.rank == 0
            || self.drafter_kv_dim == 0
            || self.drafter_layers.is_empty()
            || self.verifier_layers == 0
            || self.verifier_kv_dim == 0
        {
            return bad("rank, drafter and verifier dims must all be positive".into());
        }
        if !self.verifier_kv_dims.is_empty()
            && (self.verifier_kv_dims.len() != self.verifier_layers
                || self.verifier_kv_dims.contains(&0))
        {
            return bad(format!(
                "verifier_kv_dims must give a positive width for each of the {} verifier layers, got {:?}",
                self.verifier_layers, self.verifier_kv_dims
            ));
        }
        Ok(())
    }
}

/// An f_θ checkpoint in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct FThetaCheckpoint {
    /// Shape and owners.
    pub config: FThetaConfig,
    /// Tensors by name ([`FThetaConfig::expected_tensors`]).
    pub tensors: BTreeMap<String, HostTensor>,
}

impl FThetaCheckpoint {
    /// Reads `dir/config.json` and `dir/f_theta.safetensors` and checks every tensor's shape.
    pub fn read_dir(dir: &Path) -> Result<Self> {
        let cp = dir.join("config.json");
        let text = std::fs::read_to_string(&cp).map_err(|e| WeightsError::io(&cp, e))?;
        let config: FThetaConfig = serde_json::from_str(&text)
            .map_err(|e| WeightsError::format(&cp, format!("not an f_θ config: {e}")))?;
        config.validate(&cp)?;
        let wp = dir.join(FTHETA_WEIGHTS);
        let mut tensors = BTreeMap::new();
        read_safetensors_as(&wp, &|n| Some(n.to_string()), &mut tensors)?;
        let ck = Self { config, tensors };
        ck.check_shapes(&wp)?;
        Ok(ck)
    }

    /// Errors unless the tensors are exactly the config's, with their shapes.
    pub fn check_shapes(&self, path: &Path) -> Result<()> {
        let expected = self.config.expected_tensors();
        for (name, shape) in &expected {
            match self.tensors.get(name) {
                None => {
                    return Err(WeightsError::format(path, format!("missing tensor {name}")));
                }
                Some(t) if &t.shape != shape => {
                    return Err(WeightsError::format(
                        path,
                        format!("tensor {name} has shape {:?}, expected {shape:?}", t.shape),
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some(extra) = self
            .tensors
            .keys()
            .find(|k| !expected.iter().any(|(n, _)| n == *k))
        {
            return Err(WeightsError::format(
                path,
                format!("unexpected tensor {extra}"),
            ));
        }
        Ok(())
    }

    /// Errors (naming `dir`'s config and the model) unless this f_θ was trained for the
    /// verifier and drafter with these content hashes.
    pub fn check_pair(&self, dir: &Path, verifier_sha: &str, drafter_sha: &str) -> Result<()> {
        let cp = dir.join("config.json");
        let c = &self.config;
        if c.verifier.sha256 != verifier_sha {
            return Err(WeightsError::format(
                &cp,
                format!(
                    "this f_θ was trained for the verifier {} (sha256 {}), not for the one given (sha256 {verifier_sha})",
                    c.verifier.path.display(),
                    short(&c.verifier.sha256)
                ),
            ));
        }
        if c.drafter.sha256 != drafter_sha {
            return Err(WeightsError::format(
                &cp,
                format!(
                    "this f_θ was trained for the drafter {} (sha256 {}), not for the one given (sha256 {drafter_sha})",
                    c.drafter.path.display(),
                    short(&c.drafter.sha256)
                ),
            ));
        }
        Ok(())
    }

    /// Writes the folder atomically (built beside `dir`, then renamed); an existing non-empty
    /// folder is refused.
    pub fn write_dir(&self, dir: &Path) -> Result<()> {
        self.check_shapes(dir)?;
        write_dir_atomically(dir, |tmp| self.write_files(tmp))
    }

    /// Writes `config.json` and the weights (f32) into an existing folder.
    pub fn write_files(&self, dir: &Path) -> Result<()> {
        let cp = dir.join("config.json");
        let json = serde_json::to_string_pretty(&self.config).expect("config serialises");
        std::fs::write(&cp, json).map_err(|e| WeightsError::io(&cp, e))?;
        write_safetensors_f32(&dir.join(FTHETA_WEIGHTS), &self.tensors)
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> FThetaCheckpoint {
        let config = FThetaConfig {
            format: FTHETA_FORMAT.into(),
            version: FTHETA_VERSION,
            verifier: ModelRef {
                path: "v.gguf".into(),
                sha256: "aa".repeat(32),
            },
            drafter: ModelRef {
                path: "d".into(),
                sha256: "bb".repeat(32),
            },
            drafter_layers: vec![0, 1],
            drafter_kv_dim: 3,
            inputs: FThetaInputs::Own,
            rank: 4,
            verifier_layers: 2,
            verifier_kv_dim: 5,
            verifier_kv_dims: Vec::new(),
            bias: true,
            loss: "mse".into(),
        };
        with_tensors(config)
    }

    fn with_tensors(config: FThetaConfig) -> FThetaCheckpoint {
        let tensors = config
            .expected_tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (n, shape))| {
                let len = shape.iter().product();
                (
                    n,
                    HostTensor {
                        shape,
                        data: (0..len).map(|j| (i * 100 + j) as f32).collect(),
                    },
                )
            })
            .collect();
        FThetaCheckpoint { config, tensors }
    }

    #[test]
    fn round_trips_and_refuses_another_pair() {
        let root = std::env::temp_dir().join(format!("kakeya-ftheta-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("f");
        let ck = tiny();
        ck.write_dir(&dir).unwrap();
        let back = FThetaCheckpoint::read_dir(&dir).unwrap();
        assert_eq!(back, ck);
        back.check_pair(&dir, &"aa".repeat(32), &"bb".repeat(32))
            .unwrap();
        let e = back
            .check_pair(&dir, &"cc".repeat(32), &"bb".repeat(32))
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json") && e.contains("verifier"), "{e}");
        let e = back
            .check_pair(&dir, &"aa".repeat(32), &"cc".repeat(32))
            .unwrap_err()
            .to_string();
        assert!(e.contains("drafter"), "{e}");
        // A wrong shape is named.
        let mut bad = ck.clone();
        bad.tensors.get_mut("v_dec.1.weight").unwrap().shape = vec![4, 5];
        let e = bad.write_dir(&root.join("g")).unwrap_err().to_string();
        assert!(e.contains("v_dec.1.weight"), "{e}");
        assert!(!root.join("g").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn per_layer_widths_round_trip_and_equal_widths_keep_the_old_layout() {
        let root = std::env::temp_dir().join(format!("kakeya-ftheta-w-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // Gemma 4: sliding layers 2 × 16 wide, full layers 1 × 64; three decoders.
        let ck = with_tensors(tiny().config.with_layer_widths(&[32, 32, 64]));
        assert_eq!(ck.config.layer_widths(), vec![32, 32, 64]);
        assert_eq!(ck.tensors["k_dec.2.weight"].shape, vec![64, 4]);
        assert_eq!(ck.tensors["v_dec.1.bias"].shape, vec![32]);
        ck.write_dir(&root.join("f")).unwrap();
        assert_eq!(FThetaCheckpoint::read_dir(&root.join("f")).unwrap(), ck);
        // Equal widths: no per-layer list, the config reads as before.
        let same = tiny().config.with_layer_widths(&[5, 5]);
        assert_eq!(same, tiny().config);
        let json = serde_json::to_string(&same).unwrap();
        assert!(!json.contains("verifier_kv_dims"), "{json}");
        // A width list that does not match the layers is refused, naming the file.
        let mut bad = ck.clone();
        bad.config.verifier_kv_dims.pop();
        bad.write_files(&{
            let d = root.join("g");
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .unwrap();
        let e = FThetaCheckpoint::read_dir(&root.join("g"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json") && e.contains("verifier_kv_dims"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stacking_groups_layers_by_width_and_unstacking_restores_them() {
        // Widths 5, 7, 5, 7, 7: groups (5: layers 0, 2) and (7: layers 1, 3, 4).
        let base = tiny().config;
        let config = base.with_layer_widths(&[5, 7, 5, 7, 7]);
        assert_eq!(
            config.width_groups(),
            vec![(5, vec![0, 2]), (7, vec![1, 3, 4])]
        );
        let ck = with_tensors(config.clone());
        let stacked = config.stack(&mut ck.tensors.clone()).unwrap();
        let names: Vec<(String, Vec<usize>)> = config.stacked_tensors();
        assert_eq!(stacked.len(), names.len());
        for (n, shape) in &names {
            assert_eq!(&stacked[n].shape, shape, "{n}");
        }
        // Layer 2's weight sits under layer 0's in the width-5 group.
        let w = &stacked["k_dec.w5.weight"].data;
        assert_eq!(&w[..20], &ck.tensors["k_dec.0.weight"].data[..]);
        assert_eq!(&w[20..], &ck.tensors["k_dec.2.weight"].data[..]);
        assert_eq!(config.unstack(&stacked), ck.tensors);
        let mut missing = ck.tensors.clone();
        missing.remove("v_dec.3.bias");
        assert_eq!(
            config.stack(&mut missing).unwrap_err(),
            "missing tensor v_dec.3.bias"
        );
    }
}
