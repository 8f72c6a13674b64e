//! A cursor over one optimizer step's samples: it hands out chunks of at most the micro-batch
//! size, never across the boundary of one of the step's micro-batches (each is one bucket, with
//! its own weight), and moves on only when a chunk has been trained. After an out-of-memory
//! error the caller halves the size and asks again: the next chunk starts at the same sample.
//!
//! A chunk's `share` is its part of the effective batch times its micro-batch's weight (1, or a
//! runt batch's `(runt/batch)^1.5`, see [`crate::data::epoch_plan`]), so the shares of a whole
//! step add up to the same loss whatever the chunk sizes.

use std::ops::Range;

use crate::data::epoch_plan::MicroBatch;

/// One chunk of a step's samples, as positions into the step's samples (those of its
/// micro-batches, in order: `StepData::samples`).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Chunk<'a> {
    pub range: Range<usize>,
    /// The dataset ids of the chunk's samples.
    pub ids: &'a [usize],
    /// The chunk's weight in the step's loss.
    pub share: f64,
}

/// Where the step is in its samples.
pub(super) struct SampleCursor<'a> {
    micro: &'a [MicroBatch],
    /// The step's samples in all.
    effective: usize,
    /// The micro-batch being trained, and the position of its first sample.
    micro_batch: usize,
    micro_start: usize,
    /// The next sample to train.
    next: usize,
    /// Data parallel: this rank trains the micro-batches whose index is `rank` modulo `world`.
    rank: usize,
    world: usize,
}

impl<'a> SampleCursor<'a> {
    pub fn new(micro: &'a [MicroBatch]) -> Self {
        Self::for_rank(micro, 0, 1)
    }

    /// A cursor over rank `rank`'s share of the step in a data-parallel run of `world` ranks:
    /// the whole micro-batches whose index is `rank` modulo `world`. Shares stay parts of the
    /// whole step, so the ranks' gradients add up to the step's.
    pub fn for_rank(micro: &'a [MicroBatch], rank: usize, world: usize) -> Self {
        let mut cursor = Self {
            micro,
            effective: micro.iter().map(|m| m.ids.len()).sum(),
            micro_batch: 0,
            micro_start: 0,
            next: 0,
            rank,
            world: world.max(1),
        };
        cursor.skip_empty();
        cursor
    }

    /// The step's samples in all.
    pub fn effective(&self) -> usize {
        self.effective
    }

    /// The next chunk of at most `size` samples, or `None` when the step is done.
    pub fn peek(&self, size: usize) -> Option<Chunk<'a>> {
        let mb = self.micro.get(self.micro_batch)?;
        let end = self.micro_start + mb.ids.len();
        let n = size.max(1).min(end - self.next);
        let local = self.next - self.micro_start;
        Some(Chunk {
            range: self.next..self.next + n,
            ids: &mb.ids[local..local + n],
            share: n as f64 / self.effective() as f64 * mb.weight,
        })
    }

    /// Whether `chunk` ends the step (its last samples).
    pub fn is_last(&self, chunk: &Chunk<'_>) -> bool {
        chunk.range.end == self.effective
    }

    /// Marks `chunk` (the last [`SampleCursor::peek`]) as trained.
    pub fn advance(&mut self, chunk: &Chunk<'_>) {
        self.next = chunk.range.end;
        self.skip_empty();
    }

    /// Moves past finished (or empty) micro-batches, and other ranks' ones.
    fn skip_empty(&mut self) {
        while let Some(mb) = self.micro.get(self.micro_batch) {
            let mine = self.micro_batch % self.world == self.rank;
            if mine && self.next < self.micro_start + mb.ids.len() {
                break;
            }
            self.micro_start += mb.ids.len();
            self.micro_batch += 1;
            self.next = self.next.max(self.micro_start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Bucket;

    #[test]
    fn ranks_take_whole_micro_batches_round_robin_and_cover_the_step_once() {
        let micro = data(&[(2, 1.0), (3, 1.0), (1, 0.5), (2, 1.0), (2, 1.0)]);
        let whole = walk(&micro, &mut |_| 2);
        for world in [2, 3, 4] {
            let mut all = Vec::new();
            for rank in 0..world {
                let mut cursor = SampleCursor::for_rank(&micro, rank, world);
                while let Some(chunk) = cursor.peek(2) {
                    let mb = micro
                        .iter()
                        .position(|m| m.ids.contains(&chunk.range.start));
                    assert_eq!(mb.map(|i| i % world), Some(rank), "world {world}");
                    all.push((chunk.range.clone(), chunk.share));
                    cursor.advance(&chunk);
                }
            }
            all.sort_by_key(|(r, _)| r.start);
            assert_eq!(all, whole, "world {world}");
        }
    }

    fn data(micro: &[(usize, f64)]) -> Vec<MicroBatch> {
        let mut next = 0;
        let micro: Vec<MicroBatch> = micro
            .iter()
            .map(|&(n, weight)| {
                let ids = (next..next + n).collect();
                next += n;
                MicroBatch {
                    ids,
                    bucket: Bucket::new(64, 64),
                    weight,
                }
            })
            .collect();
        micro
    }

    fn walk(
        data: &[MicroBatch],
        sizes: &mut dyn FnMut(usize) -> usize,
    ) -> Vec<(Range<usize>, f64)> {
        let mut cursor = SampleCursor::new(data);
        let mut seen = Vec::new();
        let mut k = 0;
        while let Some(chunk) = cursor.peek(sizes(k)) {
            seen.push((chunk.range.clone(), chunk.share));
            assert_eq!(chunk.ids, &(chunk.range.clone()).collect::<Vec<_>>()[..]);
            cursor.advance(&chunk);
            k += 1;
        }
        seen
    }

    /// Chunks stop at each micro-batch's end and carry its weight; a runt micro-batch's
    /// `(runt/batch)^1.5` reaches the share (dropping the weight, or a share over the micro-batch
    /// instead of the step, fails here).
    #[test]
    fn chunks_stop_at_micro_batch_ends_and_carry_their_weight() {
        let runt = (1.0f64 / 3.0).powf(1.5);
        let d = data(&[(3, 1.0), (1, runt)]);
        let seen = walk(&d, &mut |_| 2);
        assert_eq!(
            seen,
            vec![
                (0..2, 2.0 / 4.0),
                (2..3, 1.0 / 4.0),
                (3..4, 1.0 / 4.0 * runt)
            ]
        );
    }

    /// Halving mid-step keeps the position: every sample is trained exactly once and the shares
    /// add up to the same total as one pass.
    #[test]
    fn a_smaller_size_resumes_where_the_last_chunk_ended() {
        let d = data(&[(4, 1.0), (4, 0.5)]);
        let whole: f64 = walk(&d, &mut |_| 4).iter().map(|(_, s)| s).sum();
        let seen = walk(&d, &mut |k| if k == 0 { 4 } else { 1 });
        let covered: Vec<usize> = seen.iter().flat_map(|(r, _)| r.clone()).collect();
        assert_eq!(covered, (0..8).collect::<Vec<_>>());
        let sum: f64 = seen.iter().map(|(_, s)| s).sum();
        assert!(
            (sum - whole).abs() < 1e-12 && (whole - 0.75).abs() < 1e-12,
            "{sum} {whole}"
        );
    }

    /// An empty step has no chunk.
    #[test]
    fn an_empty_step_has_no_chunk() {
        let d = data(&[]);
        assert!(SampleCursor::new(&d).peek(4).is_none());
    }
}
