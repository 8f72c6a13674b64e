//! How an optimizer step's samples are cut into micro-batches, and what an out-of-memory error
//! changes about it.
//!
//! An optimizer step always covers the same samples (`batch_size × grad_accum` of the epoch's
//! order). They go through forward and backward `size` at a time; each micro-batch's loss is
//! weighted by its share of the step, so the update does not depend on `size`. An OOM halves
//! `size` (and so doubles the accumulation) for the rest of the run; at 1 there is nothing left
//! to halve, and the run saves and stops with [`GaveUp`], which lists what to change.

use serde::{Deserialize, Serialize};

use crate::config::{CheckpointChoice, OptimizerKind, TrainMode, TrainPlan};
use crate::precision::{Amp, WeightDtype};

/// The micro-batch size in force, and the OOM retries that set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicroBatching {
    /// Samples per forward/backward pass: `batch_size`, halved by each retry.
    pub size: usize,
    /// Out-of-memory retries so far in the run.
    pub oom_retries: usize,
}

impl MicroBatching {
    pub fn new(batch_size: usize) -> Self {
        Self {
            size: batch_size.max(1),
            oom_retries: 0,
        }
    }

    /// Halves the micro-batch after an OOM (rounding up) and counts the retry; `false` at 1.
    pub fn halve(&mut self) -> bool {
        if self.size <= 1 {
            return false;
        }
        self.size = self.size.div_ceil(2);
        self.oom_retries += 1;
        true
    }

    /// Micro-batches for a step of `effective` samples.
    pub fn accumulation(&self, effective: usize) -> usize {
        effective.div_ceil(self.size)
    }

    /// The line logged for a retry at (1-based) `step`, from micro-batch `old` to this one.
    pub fn retry_line(&self, step: usize, old: usize, effective: usize) -> String {
        format!(
            "out of memory at step {step} with batch {old}: continuing with batch {} × \
             accumulation {} (effective {effective})",
            self.size,
            self.accumulation(effective)
        )
    }
}

/// The run ran out of memory at a micro-batch of 1 sample (or twice outside the step).
#[derive(Debug, thiserror::Error)]
#[error(
    "out of device memory {place}, with nothing left to halve; {saved}.\n\
     To fit this run, try, in this order:\n{rungs}"
)]
pub struct GaveUp {
    /// Where it happened: `at step 12 with batch 1`, `in the optimizer step at step 12`, …
    pub place: String,
    /// What was saved (`saved …/errored-step-000011`) or why not.
    pub saved: String,
    /// The rungs, one `  - …` line each.
    pub rungs: String,
}

/// What to change to use less memory, for this plan, most effective first: the rungs of the
/// ladder it is not on yet. `every_block`: every UNet block is checkpointed already (`true`, or
/// all that `"auto"` chose).
pub fn next_rungs(plan: &TrainPlan, amp: Amp, resolution: usize, every_block: bool) -> Vec<String> {
    let mut rungs = Vec::new();
    match plan.precision.gradient_checkpointing {
        _ if every_block => {}
        CheckpointChoice::Off => rungs.push(
            "turn gradient checkpointing on (`gradient_checkpointing: \"auto\"` checkpoints \
             the fewest blocks that fit, `true` every block)"
                .to_string(),
        ),
        CheckpointChoice::Auto => rungs.push(
            "checkpoint every block (`gradient_checkpointing: true`; `\"auto\"` chose from \
             the plan, which may be short)"
                .to_string(),
        ),
        CheckpointChoice::On => {}
    }
    if amp == Amp::Off {
        rungs.push("compute in bf16 (`amp: \"bf16\"`; fp16 on cards without bf16)".to_string());
    }
    let groups = [
        plan.optimizer.unet.optimizer,
        plan.optimizer.text_encoder.optimizer,
    ];
    if groups.contains(&OptimizerKind::AdamW) {
        rungs.push(
            "use adamw8bit instead of adamw (`\"optimizer\": \"adamw8bit\"` in optimizer.json): \
             2 bytes of state per parameter instead of 8"
                .to_string(),
        );
    }
    if plan.mode == TrainMode::Full && !plan.precision.fused_backward_pass && amp != Amp::Fp16 {
        rungs.push(
            "update each parameter inside the backward pass (`fused_backward_pass: true`): no \
             buffer of the whole model's gradients"
                .to_string(),
        );
    }
    if plan.mode == TrainMode::Full && plan.precision.weight_dtype == WeightDtype::F32 {
        rungs.push(
            "store the trained weights in bf16 (`weight_dtype: \"bf16\"`, with stochastic \
             rounding): half the memory of the weights and of their gradients"
                .to_string(),
        );
    }
    if plan.mode == TrainMode::Full {
        rungs.push(if plan.train_text_encoder {
            "stop training the text encoder (`train_text_encoder: false`), or train a LoRA \
             (`mode: \"lora\"`)"
                .to_string()
        } else {
            "train a LoRA instead of the whole UNet (`mode: \"lora\"`)".to_string()
        });
    }
    let lower = (resolution * 3 / 4) / 64 * 64;
    if lower >= 256 {
        rungs.push(format!(
            "train at a lower resolution (`resolution: {lower}` instead of {resolution})"
        ));
    }
    rungs
}

/// The rungs as the `  - …` lines of [`GaveUp`].
pub fn rung_lines(rungs: &[String]) -> String {
    if rungs.is_empty() {
        return "  - this configuration is already on every rung: it needs a card with more \
                memory"
            .to_string();
    }
    rungs
        .iter()
        .map(|r| format!("  - {r}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halving_keeps_the_effective_batch_and_stops_at_one() {
        let mut m = MicroBatching::new(4);
        assert_eq!(m.accumulation(8), 2);
        assert!(m.halve());
        assert_eq!((m.size, m.accumulation(8), m.oom_retries), (2, 4, 1));
        assert_eq!(
            m.retry_line(120, 4, 8),
            "out of memory at step 120 with batch 4: continuing with batch 2 × accumulation 4 \
             (effective 8)"
        );
        assert!(m.halve());
        assert!(!m.halve());
        assert_eq!((m.size, m.oom_retries), (1, 2));
        let mut odd = MicroBatching::new(3);
        assert!(odd.halve());
        assert_eq!((odd.size, odd.accumulation(3)), (2, 2));
    }

    fn full_plan(extra: serde_json::Value) -> TrainPlan {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = serde_json::json!({
            "model": "tests/fixtures/tiny-sd15",
            "data_root": "data/demo",
            "mode": "full",
        });
        if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        let path = dir.path().join("train.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        TrainPlan::resolve(&path, &[]).unwrap()
    }

    /// A full fine-tune is pointed at the fused backward pass and bf16 weights until it uses
    /// them; `"auto"` checkpointing is pointed at `true` unless every block is checkpointed
    /// already; fp16 gets no fused rung (refused there).
    #[test]
    fn the_rungs_name_what_the_run_is_not_using_yet() {
        let plain = next_rungs(&full_plan(serde_json::json!({})), Amp::Bf16, 512, false);
        let has = |rungs: &[String], key: &str| rungs.iter().any(|r| r.contains(key));
        assert!(has(&plain, "fused_backward_pass") && has(&plain, "weight_dtype"));
        assert!(has(&plain, "gradient_checkpointing"));
        let on = full_plan(serde_json::json!({
            "fused_backward_pass": true, "weight_dtype": "bf16", "gradient_checkpointing": "auto"
        }));
        let rungs = next_rungs(&on, Amp::Bf16, 512, false);
        assert!(!has(&rungs, "fused_backward_pass") && !has(&rungs, "weight_dtype"));
        assert!(has(&rungs, "gradient_checkpointing: true"));
        assert!(!has(
            &next_rungs(&on, Amp::Bf16, 512, true),
            "gradient_checkpointing"
        ));
        let fp16 = next_rungs(&full_plan(serde_json::json!({})), Amp::Fp16, 512, false);
        assert!(!has(&fp16, "fused_backward_pass"));
    }
}
