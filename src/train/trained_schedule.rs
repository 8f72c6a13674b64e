//! The schedule a run trains on, as its samples and saves see it. A run with
//! `zero_terminal_snr` trains on the rescaled schedule; its model layout then carries a
//! scheduler config that declares it ([`crate::model::zero_snr`]), so that:
//! - the run's samples draw on that schedule, with guidance rescale φ =
//!   [`ZERO_SNR_GUIDANCE_RESCALE`] (EveryDream2's sample generator; the paper's §3.4 value);
//! - a saved diffusers folder's `scheduler_config.json` and `model_index.json`, and a saved
//!   single file's metadata and `ztsnr` marker, declare it, so diffusers, ComfyUI, a chained run
//!   and `sdtrain sample` draw on the schedule the weights were trained for.
//!
//! Before, the base model's config was kept: samples and saved models used the unrescaled
//! schedule.

use crate::model::layout::ModelLayout;
use crate::model::zero_snr::declare_zero_terminal_snr;

/// The guidance rescale of a zero-terminal-SNR run's samples (EveryDream2's, the paper's).
pub const ZERO_SNR_GUIDANCE_RESCALE: f64 = 0.7;

/// `layout` as a run trained with `zero_terminal_snr` samples and saves it.
pub(super) fn trained_layout(
    layout: &ModelLayout,
    zero_terminal_snr: bool,
) -> anyhow::Result<ModelLayout> {
    if !zero_terminal_snr {
        return Ok(layout.clone());
    }
    let base = layout.base_scheduler_json()?;
    Ok(layout.with_scheduler(declare_zero_terminal_snr(&base)))
}

/// The guidance rescale of the samples of a run with `zero_terminal_snr`.
pub(super) fn sample_guidance_rescale(zero_terminal_snr: bool) -> f64 {
    match zero_terminal_snr {
        true => ZERO_SNR_GUIDANCE_RESCALE,
        false => 0.0,
    }
}
