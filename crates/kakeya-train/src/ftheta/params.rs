//! f_θ's trainable tensors: initialisation, warm start, the model view used by the loss, and
//! export. Training holds each width group's decoders stacked
//! ([`FThetaConfig::stacked_tensors`]): a step's products, gradients and AdamW updates then run
//! once per group, not once per verifier layer. Checkpoints keep one tensor per layer.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::{Device, Tensor};
use kakeya_models::FTheta;
use kakeya_weights::{FThetaCheckpoint, FThetaConfig, HostTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Result, TrainError};
use crate::run::{self, Named, Params, named_from_host};

/// f_θ's tensors in [`FThetaConfig::stacked_tensors`] order, stored 2-D (biases `[1, n]`).
#[derive(Debug, Clone)]
pub struct FThetaParams {
    /// Shape and owners.
    pub config: FThetaConfig,
    /// `(name, PyTorch shape, value)`.
    pub tensors: Named,
}

impl Params for FThetaParams {
    fn tensors(&self) -> &Named {
        &self.tensors
    }

    fn tensors_mut(&mut self) -> &mut Named {
        &mut self.tensors
    }
}

impl FThetaParams {
    /// PyTorch `nn.Linear`'s default: weights and biases uniform in `±1/√in` (drawn per
    /// layer, in [`FThetaConfig::expected_tensors`] order).
    pub fn init(config: FThetaConfig, seed: u64, device: &Device) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut host: BTreeMap<String, HostTensor> = config
            .expected_tensors()
            .into_iter()
            .map(|(name, shape)| {
                let fan_in = if name.starts_with("k_enc") || name.starts_with("v_enc") {
                    config.in_dim()
                } else {
                    config.rank
                };
                let bound = 1.0 / (fan_in as f32).sqrt();
                let n: usize = shape.iter().product();
                let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
                (name, HostTensor { shape, data })
            })
            .collect();
        Self::from_host(config, &mut host, device).expect("every tensor was drawn")
    }

    /// Warm start from an exported f_θ folder of the same shape (owners are taken from
    /// `config`, the new run's).
    pub fn from_dir(config: FThetaConfig, dir: &Path, device: &Device) -> Result<Self> {
        let ck = FThetaCheckpoint::read_dir(dir)?;
        let c = &ck.config;
        if c.rank != config.rank
            || c.in_dim() != config.in_dim()
            || c.layer_widths() != config.layer_widths()
            || c.bias != config.bias
            || c.inputs != config.inputs
        {
            return Err(TrainError::invalid(
                &dir.join("config.json"),
                format!(
                    "init_from has rank {}, input {}, layers of widths {:?}, bias {}; this run needs rank {}, input {}, layers of widths {:?}, bias {}",
                    c.rank,
                    c.in_dim(),
                    c.layer_widths(),
                    c.bias,
                    config.rank,
                    config.in_dim(),
                    config.layer_widths(),
                    config.bias
                ),
            ));
        }
        let mut host = ck.tensors;
        Self::from_host(config, &mut host, device).map_err(|m| TrainError::invalid(dir, m))
    }

    /// Builds from per-layer host tensors ([`FThetaConfig::expected_tensors`] names, taken out
    /// of `host`).
    pub fn from_host(
        config: FThetaConfig,
        host: &mut BTreeMap<String, HostTensor>,
        device: &Device,
    ) -> std::result::Result<Self, String> {
        let mut stacked = config.stack(host)?;
        Self::from_stacked(config, &mut stacked, device)
    }

    /// Builds from host tensors in the stacked layout ([`FThetaConfig::stacked_tensors`]
    /// names, taken out of `host`).
    pub fn from_stacked(
        config: FThetaConfig,
        host: &mut BTreeMap<String, HostTensor>,
        device: &Device,
    ) -> std::result::Result<Self, String> {
        let tensors = named_from_host(config.stacked_tensors(), host, device)?;
        Ok(Self { config, tensors })
    }

    /// Number of scalars.
    pub fn count(&self) -> usize {
        run::count(&self.tensors)
    }

    /// The model over `weights` (these tensors, or gradient-tracking leaves in the same order).
    pub fn model(&self, weights: &[Tensor<2>]) -> FTheta {
        let mut by_name: BTreeMap<&str, Tensor<2>> = self
            .tensors
            .iter()
            .zip(weights)
            .map(|((n, _, _), w)| (n.as_str(), w.clone()))
            .collect();
        FTheta::from_stacked(self.config.clone(), &mut |n| by_name.remove(n))
            .expect("every expected tensor is present")
    }

    /// The current values as a checkpoint (one tensor per layer).
    pub fn to_checkpoint(&self) -> FThetaCheckpoint {
        let stacked = self
            .tensors
            .iter()
            .map(|(n, shape, t)| {
                let data = t
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32 data");
                (
                    n.clone(),
                    HostTensor {
                        shape: shape.clone(),
                        data,
                    },
                )
            })
            .collect();
        FThetaCheckpoint {
            config: self.config.clone(),
            tensors: self.config.unstack(&stacked),
        }
    }
}
