//! The progress bar: epoch, step, smoothed loss, lr, it/s, images/s and memory (device memory in
//! use / peak on CUDA, the process's RSS on the CPU). Hidden when stderr is
//! not a terminal (CI, redirected logs); the JSON-lines log carries the same numbers.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::memory::MemoryUsage;

pub struct Progress {
    bar: ProgressBar,
    start: Instant,
}

impl Progress {
    pub fn new(total_steps: usize, visible: bool) -> Self {
        let bar = ProgressBar::new(total_steps as u64);
        if !visible {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        let style = ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Self {
            bar,
            start: Instant::now(),
        }
    }

    /// Updates the bar after optimizer step `step` (1-based), with the memory in use and its
    /// peak when a reading exists.
    pub fn update(
        &self,
        step: usize,
        epoch: usize,
        loss: f64,
        lr: f64,
        images: usize,
        memory: Option<&MemoryUsage>,
    ) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_position(step as u64);
        let mut msg = format!(
            "epoch {epoch} loss {loss:.4} lr {lr:.2e} {:.2} it/s {:.2} img/s",
            step as f64 / secs,
            images as f64 / secs
        );
        if let Some(m) = memory {
            msg.push(' ');
            msg.push_str(&m.short());
        }
        self.bar.set_message(msg);
    }

    /// Prints a line above the bar without breaking it.
    pub fn println(&self, line: impl AsRef<str>) {
        if self.bar.is_hidden() {
            eprintln!("{}", line.as_ref());
        } else {
            self.bar.println(line);
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
