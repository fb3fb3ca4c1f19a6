//! Kakeya's trainers on Burn autodiff. Now: the DFlash drafter (`kakeya train drafter`) —
//! see [`train::train_drafter`] and `docs/train-drafter.md`.

pub mod config;
pub mod data;
pub mod drafter;
pub mod error;
pub mod optim;
pub mod plot;
pub mod train;

pub use config::DrafterTrainConfig;
pub use error::{Result, TrainError};
pub use train::{Event, Prepared, Report, TrainOptions, prepare, train_drafter};
