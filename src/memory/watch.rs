//! Tells a spike from a creep, so a user need not watch the memory graph themselves (the VRAM
//! guides' advice), and catches the slowdown of a driver that spills device memory to the host
//! instead of failing.
//!
//! The trainer feeds [`StepWatch::observe`] each optimizer step's wall time and the memory in
//! use read right after it, the same point of every step (the CUDA pool's bytes held by tensors,
//! or the process's RSS on the CPU). Activations are freed by then, so in a healthy run the
//! reading is flat from step to step whatever the bucket.
//!
//! - **Creep:** over the last [`WINDOW`] readings after [`WARMUP_STEPS`], the Theil–Sen slope
//!   (the median of the slopes between every pair of readings, which one spike cannot move) times
//!   the window's span is at least [`CREEP_MIN_BYTES`] and 2% of the window's smallest reading,
//!   and each half of the window grows at half that rate at least (sustained, so a creep that
//!   grows every few steps counts and the reported rate is the creep's own). Warned once per run,
//!   with the growth per step and where it was measured.
//! - **Slow step:** a step over [`SLOW_FACTOR`] times what the run's median pace gives for its
//!   size: steps are judged in seconds per unit of work (the caller's measure, the step's image
//!   pixels), so a step of a large aspect bucket is not slow for being large. The median is over
//!   the last [`TIME_HISTORY`] steps after the warm-up, at least [`MIN_TIMES`] of them. Steps
//!   with an out-of-memory retry are slow by design and are not judged. The first slow step of a
//!   streak is warned, with its time and the memory in use, up to [`MAX_SLOW_WARNINGS`] times.

use std::collections::VecDeque;

use serde::Serialize;

use super::{MemorySource, MemoryUsage};

/// Steps not judged at the start of a run (or of a resumed one): the pool and the caches fill.
pub const WARMUP_STEPS: usize = 10;
/// Readings the creep slope is taken over.
pub const WINDOW: usize = 20;
/// The least growth over the window that counts as a creep.
pub const CREEP_MIN_BYTES: f64 = 64.0 * MIB;
/// A step this many times the median step time is slow.
pub const SLOW_FACTOR: f64 = 3.0;
/// Step times the median is taken over.
pub const TIME_HISTORY: usize = 200;
/// Step times needed before a step is judged slow.
pub const MIN_TIMES: usize = 10;
/// Slow-step warnings in one run at most.
pub const MAX_SLOW_WARNINGS: usize = 10;

const MIB: f64 = 1024.0 * 1024.0;

/// What the watch saw at one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WatchEvent {
    /// Memory in use grows from step to step.
    MemoryCreep {
        /// Growth per step, in MiB (the Theil–Sen slope).
        mib_per_step: f64,
        from_step: usize,
        to_step: usize,
        from_mib: f64,
        to_mib: f64,
        source: MemorySource,
    },
    /// One step far slower than the run's median pace.
    SlowStep {
        step: usize,
        secs: f64,
        /// What the median pace (seconds per unit of work) gives for this step's work.
        expected_secs: f64,
        /// Memory in use right after the step, when it could be read.
        #[serde(skip_serializing_if = "Option::is_none")]
        in_use_mib: Option<f64>,
        /// True on the last warning the run will give.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        last_warning: bool,
    },
}

impl WatchEvent {
    /// The warning's text for the console.
    pub fn message(&self) -> String {
        match self {
            Self::MemoryCreep {
                mib_per_step,
                from_step,
                to_step,
                from_mib,
                to_mib,
                source,
            } => format!(
                "memory in use grows by {mib_per_step:.1} MiB per step ({from_mib:.0} MiB at step \
                 {from_step}, {to_mib:.0} MiB at step {to_step}; {} read after each optimizer \
                 step): a creep, not a spike. Something is kept from step to step; the run will \
                 run out of memory if it goes on",
                match source {
                    MemorySource::CudaPool => "the CUDA pool's bytes in use",
                    MemorySource::ProcessRss => "the process's resident memory",
                }
            ),
            Self::SlowStep {
                step,
                secs,
                expected_secs,
                in_use_mib,
                last_warning,
            } => {
                let mem = in_use_mib.map_or(String::new(), |m| format!(", {m:.0} MiB in use"));
                let more = if *last_warning {
                    "; further slow steps are not reported"
                } else {
                    ""
                };
                format!(
                    "step {step} took {secs:.2} s, {:.1}× the {expected_secs:.2} s the run's \
                     median pace gives for its size{mem}. A driver that spills device memory to \
                     the host slows steps this way instead of failing{more}",
                    secs / expected_secs
                )
            }
        }
    }

    /// The TensorBoard scalar this event adds to its step: `warnings/memory_creep_mib_per_step`
    /// or `warnings/slow_step_s`.
    pub fn scalar(&self) -> (&'static str, f64) {
        match self {
            Self::MemoryCreep { mib_per_step, .. } => {
                ("warnings/memory_creep_mib_per_step", *mib_per_step)
            }
            Self::SlowStep { secs, .. } => ("warnings/slow_step_s", *secs),
        }
    }
}

/// The run's watch over step times and memory in use (see the module header).
#[derive(Debug, Default)]
pub struct StepWatch {
    observed: usize,
    readings: VecDeque<(usize, u64)>,
    creep_warned: bool,
    times: VecDeque<f64>,
    slow_streak: bool,
    slow_warnings: usize,
}

impl StepWatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `step` (its wall time `secs`, its `work` in any unit proportional to its cost,
    /// e.g. image pixels, the memory read right after it, whether an out-of-memory retry ran in
    /// it) and returns what it makes worth a warning.
    pub fn observe(
        &mut self,
        step: usize,
        secs: f64,
        work: f64,
        memory: Option<&MemoryUsage>,
        retried: bool,
    ) -> Vec<WatchEvent> {
        self.observed += 1;
        if self.observed <= WARMUP_STEPS {
            return Vec::new();
        }
        let mut events = Vec::new();
        if let Some(e) = self.slow(step, secs, work, memory, retried) {
            events.push(e);
        }
        if let Some(m) = memory {
            if let Some(e) = self.creep(step, m) {
                events.push(e);
            }
        }
        events
    }

    fn slow(
        &mut self,
        step: usize,
        secs: f64,
        work: f64,
        memory: Option<&MemoryUsage>,
        retried: bool,
    ) -> Option<WatchEvent> {
        if retried || !secs.is_finite() || work.is_nan() || work <= 0.0 {
            return None;
        }
        let pace = (self.times.len() >= MIN_TIMES).then(|| median(self.times.iter().copied()));
        if self.times.len() == TIME_HISTORY {
            self.times.pop_front();
        }
        self.times.push_back(secs / work);
        let expected = pace? * work;
        let slow = secs > SLOW_FACTOR * expected;
        let first_of_streak = slow && !self.slow_streak;
        self.slow_streak = slow;
        if !first_of_streak || self.slow_warnings >= MAX_SLOW_WARNINGS {
            return None;
        }
        self.slow_warnings += 1;
        Some(WatchEvent::SlowStep {
            step,
            secs,
            expected_secs: expected,
            in_use_mib: memory.map(|m| m.in_use_bytes as f64 / MIB),
            last_warning: self.slow_warnings == MAX_SLOW_WARNINGS,
        })
    }

    fn creep(&mut self, step: usize, m: &MemoryUsage) -> Option<WatchEvent> {
        if self.readings.len() == WINDOW {
            self.readings.pop_front();
        }
        self.readings.push_back((step, m.in_use_bytes));
        if self.creep_warned || self.readings.len() < WINDOW {
            return None;
        }
        let slope = theil_sen(self.readings.iter());
        let (first, last) = (self.readings[0], self.readings[WINDOW - 1]);
        let span = (last.0 - first.0) as f64;
        let floor = self.readings.iter().map(|r| r.1).min().unwrap_or(0) as f64;
        if slope * span < CREEP_MIN_BYTES.max(0.02 * floor) {
            return None;
        }
        // Sustained: each half of the window grows at half the window's rate at least, so a
        // creep is reported once the whole window is in it, at its own rate.
        let half = WINDOW / 2;
        let early = theil_sen(self.readings.iter().take(half));
        let late = theil_sen(self.readings.iter().skip(half));
        if early < 0.5 * slope || late < 0.5 * slope {
            return None;
        }
        self.creep_warned = true;
        Some(WatchEvent::MemoryCreep {
            mib_per_step: slope / MIB,
            from_step: first.0,
            to_step: last.0,
            from_mib: first.1 as f64 / MIB,
            to_mib: last.1 as f64 / MIB,
            source: m.source,
        })
    }
}

/// The median of the slopes between every pair of `(step, bytes)` points with distinct steps.
fn theil_sen<'a>(points: impl Iterator<Item = &'a (usize, u64)> + Clone) -> f64 {
    let mut slopes = Vec::new();
    for (i, a) in points.clone().enumerate() {
        for b in points.clone().skip(i + 1) {
            if b.0 != a.0 {
                slopes.push((b.1 as f64 - a.1 as f64) / (b.0 as f64 - a.0 as f64));
            }
        }
    }
    median(slopes.into_iter())
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn reading(bytes: u64) -> MemoryUsage {
        MemoryUsage {
            source: MemorySource::CudaPool,
            in_use_bytes: bytes,
            peak_bytes: bytes,
            device_free_bytes: None,
            device_total_bytes: None,
        }
    }

    /// Feeds `steps` steps of `time(step)` seconds and `bytes(step)` in use; returns every event.
    fn run(
        steps: usize,
        time: impl Fn(usize) -> f64,
        bytes: impl Fn(usize) -> u64,
    ) -> Vec<(usize, WatchEvent)> {
        let mut w = StepWatch::new();
        (1..=steps)
            .flat_map(|s| {
                w.observe(s, time(s), 1.0, Some(&reading(bytes(s))), false)
                    .into_iter()
                    .map(move |e| (s, e))
            })
            .collect()
    }

    /// Flat-ish readings with noise of ±20 MiB around 3 GiB, steady times: nothing to say.
    #[test]
    fn a_steady_run_raises_nothing() {
        let noise = |s: usize| ((s * 7919) % 41) as u64 * (1 << 20);
        let events = run(300, |s| 0.5 + (s % 3) as f64 * 0.05, |s| 3 * GIB + noise(s));
        assert!(events.is_empty(), "{events:?}");
    }

    /// 8 MiB more in use after every step from step 40: warned once, with the growth per step
    /// (the slope, not the window's total), as soon as the window's growth passes 64 MiB.
    #[test]
    fn a_creep_is_warned_once_with_its_growth_per_step() {
        let bytes = |s: usize| 3 * GIB + (s.saturating_sub(40) as u64) * 8 * (1 << 20);
        let events = run(300, |_| 0.5, bytes);
        assert_eq!(events.len(), 1, "{events:?}");
        let (step, e) = &events[0];
        let WatchEvent::MemoryCreep {
            mib_per_step,
            to_step,
            ..
        } = e
        else {
            panic!("{e:?}")
        };
        assert_eq!(to_step, step);
        assert!((mib_per_step - 8.0).abs() < 1e-9, "{mib_per_step}");
        // Warned once both halves of the window creep: within the first window after it starts.
        assert!((41..=40 + WINDOW).contains(step), "{step}");
        assert!(e.message().contains("8.0 MiB per step"), "{}", e.message());
    }

    /// A one-step spike of 2 GiB (a sampling round, a large bucket) and a step back down, twice:
    /// the median slope stays 0, so no creep; the spike's step is not slow either.
    #[test]
    fn a_spike_is_not_a_creep() {
        let bytes = |s: usize| 3 * GIB + if s == 100 || s == 219 { 2 * GIB } else { 0 };
        assert!(run(300, |_| 0.5, bytes).is_empty());
    }

    /// A step at 4× the median is warned with its time, the median and the memory in use; the
    /// next slow step of the same streak is not; a later streak is.
    #[test]
    fn a_slow_step_is_warned_once_per_streak() {
        let time = |s: usize| {
            if (50..53).contains(&s) || s == 120 {
                2.0
            } else {
                0.5
            }
        };
        let events = run(200, time, |_| 3 * GIB);
        let steps: Vec<usize> = events.iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, vec![50, 120], "{events:?}");
        let WatchEvent::SlowStep {
            secs,
            expected_secs,
            in_use_mib,
            ..
        } = &events[0].1
        else {
            panic!()
        };
        assert_eq!(
            (*secs, *expected_secs, *in_use_mib),
            (2.0, 0.5, Some(3072.0))
        );
        assert!(events[0].1.message().contains("4.0× the 0.50 s"));
    }

    /// Warm-up steps, steps with an out-of-memory retry and 3× exactly are not judged; the
    /// warnings stop after MAX_SLOW_WARNINGS, the last one saying so.
    #[test]
    fn slow_steps_respect_warmup_retries_and_the_cap() {
        let mut w = StepWatch::new();
        let m = reading(GIB);
        assert!(
            w.observe(1, 50.0, 1.0, Some(&m), false).is_empty(),
            "warm-up"
        );
        for s in 2..=30 {
            w.observe(s, 1.0, 1.0, Some(&m), false);
        }
        assert!(
            w.observe(31, 9.0, 1.0, Some(&m), true).is_empty(),
            "a retry step"
        );
        assert!(
            w.observe(32, 3.0, 1.0, Some(&m), false).is_empty(),
            "3× is not over 3×"
        );
        let mut warned = Vec::new();
        for s in 33..200 {
            let t = if s % 2 == 0 { 5.0 } else { 1.0 };
            warned.extend(w.observe(s, t, 1.0, Some(&m), false));
        }
        assert_eq!(warned.len(), MAX_SLOW_WARNINGS);
        assert!(warned.last().unwrap().message().contains("not reported"));
        assert!(!warned[0].message().contains("not reported"));
    }

    /// 30 MiB every third step (a save point that keeps something, say): a creep too, reported
    /// at its average rate of 10 MiB per step.
    #[test]
    fn a_creep_in_steps_is_a_creep() {
        let bytes = |s: usize| 3 * GIB + (s / 3) as u64 * 30 * (1 << 20);
        let events = run(200, |_| 0.5, bytes);
        assert_eq!(events.len(), 1, "{events:?}");
        let WatchEvent::MemoryCreep { mib_per_step, .. } = events[0].1 else {
            panic!()
        };
        assert!((mib_per_step - 10.0).abs() < 1e-9, "{mib_per_step}");
    }

    /// Steps of a bucket 4× larger take 4× longer: judged by pace, none is slow; a large step at
    /// 4× its own expected time is.
    #[test]
    fn large_buckets_are_not_slow_steps() {
        let mut w = StepWatch::new();
        let mut events = Vec::new();
        for s in 1..=60 {
            let work = if s % 3 == 0 { 4.0 } else { 1.0 };
            let secs = if s == 57 {
                4.0 * 0.5 * work
            } else {
                0.5 * work
            };
            events.extend(w.observe(s, secs, work, None, false));
        }
        let steps: Vec<usize> = events
            .iter()
            .map(|e| match e {
                WatchEvent::SlowStep { step, .. } => *step,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(steps, vec![57]);
    }

    /// Without memory readings (a platform with none) only the times are judged.
    #[test]
    fn works_without_memory_readings() {
        let mut w = StepWatch::new();
        let mut events = Vec::new();
        for s in 1..=40 {
            events.extend(w.observe(s, if s == 35 { 4.0 } else { 1.0 }, 1.0, None, false));
        }
        assert_eq!(events.len(), 1);
        assert!(matches!(
            events[0],
            WatchEvent::SlowStep {
                in_use_mib: None,
                ..
            }
        ));
    }
}
