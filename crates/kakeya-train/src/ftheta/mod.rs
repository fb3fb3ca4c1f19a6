//! f_θ training (`kakeya train f-theta`, DESIGN §7): the config, the streamed capture data,
//! the five losses, and the loop.

pub mod config;
pub mod data;
pub mod frozen;
pub mod loss;
pub mod lstsq;
pub mod params;
pub mod pass;
pub mod replay;
pub mod step;
pub mod targets;
pub mod train;

pub use config::FThetaTrainConfig;
pub use loss::{Diagnostics, LossKind};
pub use train::{FEvent, FThetaReport, Setup, prepare, train_f_theta};
