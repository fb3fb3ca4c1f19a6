//! Kakeya's trainers on Burn autodiff: the DFlash drafter (`kakeya train drafter`, see
//! [`train::train_drafter`] and `docs/train-drafter.md`) and f_θ (`kakeya train f-theta`, see
//! [`ftheta::train::train_f_theta`] and `docs/train-f-theta.md`).

pub mod config;
pub mod data;
pub mod drafter;
pub mod error;
pub mod ftheta;
pub mod optim;
pub mod plot;
pub mod run;
pub mod state;
pub mod train;

pub use config::DrafterTrainConfig;
pub use error::{Result, TrainError};
pub use train::{Event, Prepared, Report, TrainOptions, prepare, train_drafter};
