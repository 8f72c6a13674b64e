//! train.json and optimizer.json: parsing, overrides, validation and the resolved plan.
//!
//! Two stages (STYLE.md): serde mirrors of the files ([`TrainFile`], [`OptimizerFile`], every
//! field optional, `deny_unknown_fields`), then one resolve step, [`TrainPlan::resolve`], that
//! decides every default and checks every range. The key names and their meanings follow
//! EveryDream2 (train.py, optimizer/optimizers.py); docs/config.md lists every key.

mod adapter_blocks;
mod adapter_file;
mod block_lr_plan;
mod ctx;
mod data_plan;
mod dataset_config;
mod dataset_config_schema;
pub mod devices_plan;
mod ema_plan;
mod embedding_plan;
mod error;
mod kohya_aliases;
mod kohya_config;
mod kohya_config_keys;
mod kohya_datasets;
mod kohya_network;
mod kohya_optimizer;
mod kohya_schedule;
mod layout_plan;
mod loss_mix_plan;
mod loss_plan;
mod mask_plan;
mod model_plan;
mod modelspec_plan;
mod objective_plan;
mod onetrainer_concepts;
mod onetrainer_config;
mod onetrainer_keys;
mod onetrainer_method;
mod onetrainer_optimizer;
mod onetrainer_training;
mod optimizer_file;
mod optimizer_plan;
mod overrides;
mod plan;
mod precision_plan;
mod regularization_plan;
mod resume_plan;
mod run_shape;
mod sample_plan;
mod save_plan;
mod sf_came_plan;
mod strict;
mod summary;
mod te_freeze_plan;
mod timestep_plan;
mod train_file;
mod validation_plan;

pub use adapter_file::{AdapterFile, AdapterPlan, LoraPlus, SaveDtype};
pub use data_plan::{
    BucketPlan, CacheLatents, DataPlan, DatasetShape, KohyaBucketRange, TextCacheDecision,
    TextCacheOff, DEFAULT_CROP_JITTER,
};
pub use dataset_config::DatasetConfigPlan;
pub use ema_plan::{EmaDecay, EmaDevice, EmaPlan, DEFAULT_EMA_UPDATE_INTERVAL};
pub use embedding_plan::{CaptionTemplate, EmbeddingPlan};
pub use error::{ConfigError, UnsupportedKey};
pub use kohya_config::KohyaData;
pub use kohya_config_keys::is_kohya_option;
pub use loss_plan::{LossPlan, LossScaler};
pub use mask_plan::MaskPlan;
pub use model_plan::{ModelFilePlan, SaveFormat};
pub use modelspec_plan::ModelSpecPlan;
pub use objective_plan::ObjectivePlan;
pub use optimizer_file::{FreezingFile, GroupFile, OptimizerFile, DEFAULT_OPTIMIZER_JSON};
pub use optimizer_plan::{
    EstimatorPlan, OptimizerKind, OptimizerPlan, ParamGroupPlan, ResolvedSchedule, ScheduleKind,
    ScheduleSpec, StepCount, ADAN_BETA3_DEFAULT,
};
pub use overrides::{apply_all as apply_overrides, Override};
pub use plan::{TrainMode, TrainPlan};
pub use precision_plan::{
    AmpChoice, BaseWeightDtype, Checkpointing as CheckpointChoice, PrecisionPlan,
};
pub use regularization_plan::{
    ClassImagesPlan, RegularizationPlan, DEFAULT_NUM_CLASS_IMAGES, DEFAULT_PRIOR_LOSS_WEIGHT,
};
pub use run_shape::RunShape;
pub use sample_plan::{SamplePlan, DEFAULT_SAMPLE_STEPS};
pub use save_plan::SavePlan;
pub use sf_came_plan::{CamePlan, ScheduleFreePlan, CAME_BETAS_DEFAULT};
pub use te_freeze_plan::{TextEncoderFreeze, TrainedLayers};
pub use train_file::TrainFile;
pub use validation_plan::{NamedSet, SplitRule, ValidationPlan, ValidationWhen};
