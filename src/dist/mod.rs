//! Data-parallel training's collectives (issue 24): the operations ranks use to agree, behind one
//! trait ([`Collective`]) with an in-process implementation (threads exchanging buffers, for the
//! CPU tests and one machine) and a TCP one (processes on one or several machines, joined through
//! the environment torchrun users know). On CUDA cards the gradients are summed by NCCL
//! ([`DeviceSum`], the `nccl` feature), on the cards; the [`Collective`] still carries the
//! rest.
//!
//! Every operation is collective: every rank calls it, in the same order. A rank that does not
//! arrive within the group's timeout, or that has gone, ends the operation on every other rank
//! with [`DistError`], so no rank waits forever.

mod collective;
mod env;
mod error;
mod in_process;
#[cfg(feature = "nccl")]
mod nccl;
mod tcp;

pub use collective::{sum_in_rank_order, Collective, DeviceSum};
pub use env::{DistEnv, ENV_KEYS};
pub use error::DistError;
pub use in_process::InProcess;
#[cfg(feature = "nccl")]
pub use nccl::Nccl;
pub use tcp::Tcp;
