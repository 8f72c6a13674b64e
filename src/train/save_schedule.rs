//! When a run saves between its end points: every `save_every_n_epochs` epochs (from
//! `save_ckpts_from_n_epochs`), every `save_every_n_steps` steps, and every
//! `ckpt_every_n_minutes` minutes of wall time (EveryDream2's timed saves, counted from the
//! start of this process or its last timed save). Pure rules over the plan and a clock, so they
//! are tested without a run.

use std::time::{Duration, Instant};

use crate::config::SavePlan;

/// The wall clock of timed saves.
#[derive(Debug, Clone, Copy)]
pub(super) struct SaveClock {
    since: Instant,
}

impl Default for SaveClock {
    fn default() -> Self {
        Self {
            since: Instant::now(),
        }
    }
}

impl SaveClock {
    /// Whether a save is due after step `steps` of `total` at `now`: a step save or a timed
    /// one. A timed save restarts the clock. The last step is left to the run's final save.
    pub fn step_save_due(
        &mut self,
        plan: &SavePlan,
        steps: usize,
        total: usize,
        now: Instant,
    ) -> bool {
        if steps >= total {
            return false;
        }
        let by_steps = plan
            .every_n_steps
            .is_some_and(|n| n > 0 && steps.is_multiple_of(n as usize));
        // A period past what a Duration holds (1e30 minutes) never comes round.
        let by_time = plan.every_n_minutes.is_some_and(|m| {
            Duration::try_from_secs_f64(m * 60.0)
                .is_ok_and(|period| now.saturating_duration_since(self.since) >= period)
        });
        if by_time {
            self.since = now;
        }
        by_steps || by_time
    }
}

/// Whether the end of epoch `completed` (1-based) saves, unless it is the run's last (the final
/// save covers that).
pub(super) fn epoch_save_due(plan: &SavePlan, completed: usize, last: bool) -> bool {
    let Some(every) = plan.every_n_epochs else {
        return false;
    };
    !last && completed.is_multiple_of(every as usize) && completed as u64 >= plan.from_n_epochs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> SavePlan {
        SavePlan::at_end()
    }

    #[test]
    fn epoch_saves_start_at_save_ckpts_from_n_epochs() {
        let p = SavePlan {
            every_n_epochs: Some(2),
            from_n_epochs: 4,
            ..plan()
        };
        let due: Vec<usize> = (1..=9).filter(|&e| epoch_save_due(&p, e, e == 9)).collect();
        assert_eq!(due, [4, 6, 8]);
        let p = SavePlan {
            every_n_epochs: Some(3),
            ..plan()
        };
        let due: Vec<usize> = (1..=9).filter(|&e| epoch_save_due(&p, e, e == 9)).collect();
        assert_eq!(due, [3, 6]);
        assert!(!epoch_save_due(&plan(), 2, false));
    }

    #[test]
    fn timed_saves_follow_the_clock_and_restart_it() {
        let p = SavePlan {
            every_n_minutes: Some(20.0),
            ..plan()
        };
        let t0 = Instant::now();
        let mut clock = SaveClock { since: t0 };
        let at = |m: u64| t0 + Duration::from_secs(m * 60);
        assert!(!clock.step_save_due(&p, 1, 100, at(19)));
        assert!(clock.step_save_due(&p, 2, 100, at(20)));
        assert!(!clock.step_save_due(&p, 3, 100, at(39)));
        assert!(clock.step_save_due(&p, 4, 100, at(40)));
        // The last step is the final save's.
        assert!(!clock.step_save_due(&p, 100, 100, at(90)));
        // A period no Duration holds (found by a config fuzz: it panicked) never comes round.
        let never = SavePlan {
            every_n_minutes: Some(1e30),
            ..plan()
        };
        assert!(!clock.step_save_due(&never, 5, 100, at(10_000)));
    }

    #[test]
    fn step_saves_every_n() {
        let p = SavePlan {
            every_n_steps: Some(5),
            ..plan()
        };
        let mut clock = SaveClock::default();
        let now = Instant::now();
        let due: Vec<usize> = (1..=20)
            .filter(|&s| clock.step_save_due(&p, s, 20, now))
            .collect();
        assert_eq!(due, [5, 10, 15]);
    }
}
