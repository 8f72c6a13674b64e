//! The collective operations, all built on one primitive, the all-gather: every rank's bytes, in
//! rank order, on every rank. Sums are taken in rank order from the gathered parts, so every rank
//! holds the same bits.

use super::DistError;

/// A group of ranks. Every rank calls each operation, in the same order.
pub trait Collective: Send {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// How long a rank waits for the others before the run ends.
    fn timeout(&self) -> std::time::Duration;
    /// Every rank's `bytes`, in rank order. `op` names the operation in errors and is checked to
    /// be the same on every rank.
    fn all_gather(&mut self, op: &'static str, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError>;

    /// `values` summed over every rank, in rank order (`((r0 + r1) + r2) + …` per element), into
    /// `values` on every rank.
    fn all_reduce_sum(&mut self, values: &mut [f32]) -> Result<(), DistError> {
        const OP: &str = "all_reduce_sum";
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let parts = self.all_gather(OP, &bytes)?;
        let mut floats = Vec::with_capacity(parts.len());
        for (rank, p) in parts.iter().enumerate() {
            if p.len() != bytes.len() {
                return Err(DistError::Mismatch {
                    op: OP,
                    rank,
                    got: p.len(),
                    want: bytes.len(),
                });
            }
            floats.push(
                p.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<_>>(),
            );
        }
        let refs: Vec<&[f32]> = floats.iter().map(Vec::as_slice).collect();
        sum_in_rank_order(&refs, values);
        Ok(())
    }

    /// Whether any rank's `flag` is set (every rank gets the same answer): the out-of-memory vote.
    fn any(&mut self, flag: bool) -> Result<bool, DistError> {
        let parts = self.all_gather("any", &[u8::from(flag)])?;
        Ok(parts.iter().any(|p| p.first().is_some_and(|b| *b != 0)))
    }

    /// Rank 0's `bytes` on every rank (the others' are ignored).
    fn broadcast(&mut self, bytes: &[u8]) -> Result<Vec<u8>, DistError> {
        let send = if self.rank() == 0 { bytes } else { &[] };
        let mut parts = self.all_gather("broadcast", send)?;
        Ok(std::mem::take(&mut parts[0]))
    }
}

/// A sum over the ranks that stays on the card (NCCL): the gradients' data plane, beside the
/// [`Collective`] that carries everything else.
pub trait DeviceSum: Send {
    /// Sums `t` (a contiguous f32 tensor with storage of its own, on this rank's device) over
    /// the ranks, in place.
    fn sum_in_place(&mut self, t: &candle_core::Tensor) -> Result<(), DistError>;
}

/// `out[i] = ((parts[0][i] + parts[1][i]) + …)`, in f32, in the parts' order.
pub fn sum_in_rank_order(parts: &[&[f32]], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = parts.first().map_or(0.0, |p| p[i]);
        for p in parts.iter().skip(1) {
            acc += p[i];
        }
        *o = acc;
    }
}

#[cfg(test)]
mod tests {
    use super::sum_in_rank_order;

    #[test]
    fn sums_are_taken_in_rank_order() {
        // (1e8 + 1) rounds to 1e8 in f32, so rank order gives 0 where any other order gives 1.
        let parts: [&[f32]; 3] = [&[1e8, 2.0], &[1.0, 3.0], &[-1e8, 4.0]];
        let mut out = [0f32; 2];
        sum_in_rank_order(&parts, &mut out);
        assert_eq!(out, [0.0, 9.0]);
    }
}
