//! What can go wrong between ranks.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Ranks that did not arrive at a collective within the timeout.
    #[error(
        "{op}: rank(s) {missing:?} did not arrive within {timeout:?}; ending the run on every rank"
    )]
    Timeout {
        op: &'static str,
        missing: Vec<usize>,
        timeout: Duration,
    },
    /// A rank left the group (its process died or its handle was dropped).
    #[error("{op}: rank {rank} left the run ({why}); ending the run on every rank")]
    RankLost {
        op: &'static str,
        rank: usize,
        why: String,
    },
    /// Ranks called different collectives, or with different sizes.
    #[error("{op}: rank {rank} sent {got} bytes where {want} were expected: the ranks disagree")]
    Mismatch {
        op: &'static str,
        rank: usize,
        got: usize,
        want: usize,
    },
    /// The rendezvous environment is missing or wrong.
    #[error("{key}={value:?}: {why}")]
    Env {
        key: &'static str,
        value: String,
        why: String,
    },
    /// NCCL (the CUDA cards' sum) failed.
    #[error("{op}: {why}")]
    Nccl { op: &'static str, why: String },
    /// The rendezvous could not be made.
    #[error("rendezvous at {addr}: {why}")]
    Rendezvous { addr: String, why: String },
}
