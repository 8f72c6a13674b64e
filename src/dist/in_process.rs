//! Ranks as threads of one process, exchanging buffers through shared memory: the CPU tests'
//! group, and the same code path as the cards'.
//!
//! Each collective is a round: a rank leaves its bytes in its slot and waits; the last to arrive
//! publishes every slot as the round's result and opens the next round. A rank that does not
//! arrive within the timeout, or whose handle is dropped (its thread ended or panicked), breaks
//! the group: every waiting rank, and every later call on any rank, gets the error.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Collective, DistError};

struct Round {
    generation: u64,
    op: Option<&'static str>,
    slots: Vec<Option<Vec<u8>>>,
    /// The last completed round's parts.
    last: Arc<Vec<Vec<u8>>>,
    /// Why the group is broken, once it is: the error every rank gets from then on.
    broken: Option<Broken>,
}

#[derive(Clone)]
enum Broken {
    Timeout(Vec<usize>),
    Lost(usize, String),
}

struct Shared {
    world: usize,
    timeout: Duration,
    round: Mutex<Round>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of an in-process group.
pub struct InProcess {
    rank: usize,
    shared: Arc<Shared>,
}

impl InProcess {
    /// A group of `world` ranks whose collectives give up after `timeout`: one handle per rank,
    /// in rank order, each to be moved to its thread.
    pub fn group(world: usize, timeout: Duration) -> Vec<InProcess> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            round: Mutex::new(Round {
                generation: 0,
                op: None,
                slots: vec![None; world],
                last: Arc::new(Vec::new()),
                broken: None,
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| InProcess {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

fn error(op: &'static str, broken: &Broken, timeout: Duration) -> DistError {
    match broken {
        Broken::Timeout(missing) => DistError::Timeout {
            op,
            missing: missing.clone(),
            timeout,
        },
        Broken::Lost(rank, why) => DistError::RankLost {
            op,
            rank: *rank,
            why: why.clone(),
        },
    }
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn all_gather(&mut self, op: &'static str, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let shared = &self.shared;
        let mut round = shared.lock();
        if let Some(b) = &round.broken {
            return Err(error(op, b, shared.timeout));
        }
        match round.op {
            Some(other) if other != op => {
                let b = Broken::Lost(
                    self.rank,
                    format!("it called {op} where others called {other}"),
                );
                round.broken = Some(b.clone());
                shared.cv.notify_all();
                return Err(error(op, &b, shared.timeout));
            }
            _ => round.op = Some(op),
        }
        round.slots[self.rank] = Some(bytes.to_vec());
        if round.slots.iter().all(Option::is_some) {
            let parts: Vec<Vec<u8>> = round.slots.iter_mut().filter_map(Option::take).collect();
            round.last = Arc::new(parts);
            round.generation += 1;
            round.op = None;
            shared.cv.notify_all();
            return Ok(round.last.as_ref().clone());
        }
        let mine = round.generation;
        let deadline = Instant::now() + shared.timeout;
        loop {
            if round.generation > mine {
                return Ok(round.last.as_ref().clone());
            }
            if let Some(b) = &round.broken {
                return Err(error(op, b, shared.timeout));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..shared.world)
                    .filter(|r| round.slots[*r].is_none())
                    .collect();
                let b = Broken::Timeout(missing);
                round.broken = Some(b.clone());
                shared.cv.notify_all();
                return Err(error(op, &b, shared.timeout));
            }
            round = shared
                .cv
                .wait_timeout(round, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for InProcess {
    /// A rank that goes (its thread ended, returned an error or panicked) breaks the group, so
    /// no other rank waits for it.
    fn drop(&mut self) {
        let mut round = self.shared.lock();
        if round.broken.is_none() {
            let why = if std::thread::panicking() {
                "its thread panicked"
            } else {
                "its handle was dropped"
            };
            round.broken = Some(Broken::Lost(self.rank, why.to_string()));
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on every rank of a group of `world`, one thread each: the results in rank order.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        f: impl Fn(InProcess) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let handles: Vec<_> = InProcess::group(world, timeout)
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_same_rank_order_sum() {
        for world in [1, 2, 4] {
            let out = on_ranks(world, Duration::from_secs(30), |mut c| {
                let r = c.rank() as f32;
                let mut v = vec![0.1 + r, 1e8, -1e8 + r * 1e-3];
                for _ in 0..3 {
                    c.all_reduce_sum(&mut v).unwrap();
                }
                v
            });
            // ((r0 + r1) + r2) + r3, three times over, in f32.
            let mut want = vec![0f32; 3];
            let mut start: Vec<Vec<f32>> = (0..world)
                .map(|r| vec![0.1 + r as f32, 1e8, -1e8 + r as f32 * 1e-3])
                .collect();
            for _ in 0..3 {
                want = (0..3)
                    .map(|i| start.iter().skip(1).fold(start[0][i], |acc, p| acc + p[i]))
                    .collect();
                start = vec![want.clone(); world];
            }
            for (r, v) in out.iter().enumerate() {
                let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
                let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                assert_eq!(bits, want_bits, "world {world}, rank {r}");
            }
        }
    }

    #[test]
    fn any_and_broadcast_agree_on_every_rank() {
        let out = on_ranks(3, Duration::from_secs(30), |mut c| {
            let oom = c.any(c.rank() == 2).unwrap();
            let none = c.any(false).unwrap();
            let id = c
                .broadcast(format!("id from {}", c.rank()).as_bytes())
                .unwrap();
            (oom, none, String::from_utf8(id).unwrap())
        });
        for o in out {
            assert_eq!(o, (true, false, "id from 0".to_string()));
        }
    }

    #[test]
    fn a_rank_that_goes_ends_the_collective_on_the_others() {
        let start = Instant::now();
        let out = on_ranks(3, Duration::from_secs(60), |mut c| {
            if c.rank() == 1 {
                return None;
            }
            let mut v = vec![1.0f32];
            Some(c.all_reduce_sum(&mut v).unwrap_err().to_string())
        });
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        for e in out.into_iter().flatten() {
            assert!(e.contains("rank 1 left the run"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_never_arrives_times_out_on_every_rank() {
        let out = on_ranks(3, Duration::from_millis(300), |mut c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(900));
                let mut v = vec![1.0f32];
                // The group broke while it slept: it gets the same error at once.
                return c.all_reduce_sum(&mut v).unwrap_err().to_string();
            }
            let mut v = vec![1.0f32];
            c.all_reduce_sum(&mut v).unwrap_err().to_string()
        });
        for e in out {
            assert!(e.contains("rank(s) [2] did not arrive"), "{e}");
        }
    }

    #[test]
    fn ranks_calling_different_collectives_fail_instead_of_mixing_them() {
        let out = on_ranks(2, Duration::from_secs(30), |mut c| {
            if c.rank() == 0 {
                let mut v = vec![1.0f32];
                c.all_reduce_sum(&mut v).map(|_| ()).is_err()
            } else {
                std::thread::sleep(Duration::from_millis(100));
                c.any(true).is_err()
            }
        });
        assert_eq!(out, vec![true, true]);
    }
}
