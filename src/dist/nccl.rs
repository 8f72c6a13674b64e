//! The gradient sum on CUDA cards: NCCL's all-reduce through cudarc's bindings (the `nccl`
//! feature), on each rank's own card, in place in device memory.
//!
//! NCCL is the data plane only. The ranks still agree, vote and detect a lost rank through their
//! [`Collective`] (threads, or TCP between processes), which also carries NCCL's unique id from
//! rank 0 to the others, as torchrun's store does. A call into NCCL that does not finish within
//! the group's timeout (a rank died between the host exchange and the sum) ends the run with a
//! [`DistError::Nccl`] that says so, and the communicator is aborted when it is dropped, so no
//! rank spins forever on the card.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, Layout, Tensor};

use super::{Collective, DeviceSum, DistError};

/// One rank's NCCL communicator on its card.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    timeout: Duration,
}

// SAFETY: a communicator may be used from any thread as long as calls do not overlap; `Nccl` is
// owned by one rank, which calls it from one thread at a time (`&mut self`).
unsafe impl Send for Nccl {}

/// `Comm` moved out of the thread that created it (see the `Send` above).
struct Made(Comm);
// SAFETY: as for `Nccl`: the communicator is handed over, never shared.
unsafe impl Send for Made {}

/// An NCCL failure in `op`. Pass an NCCL error's code (`e.0`, which prints as
/// `ncclSystemError` and the like), not the error itself, which prints only "NcclError".
fn nccl_error(op: &'static str, e: impl std::fmt::Debug) -> DistError {
    DistError::Nccl {
        op,
        why: format!("{e:?}"),
    }
}

/// The error for an NCCL call still unfinished at the deadline: some rank never joined it.
fn overdue(op: &'static str, timeout: Duration) -> DistError {
    DistError::Nccl {
        op,
        why: format!(
            "not finished within {timeout:?}: a rank did not join it (it stopped or is stuck); \
             ending the run on every rank"
        ),
    }
}

impl Nccl {
    /// Makes this rank's communicator on `device`: rank 0 draws NCCL's unique id and `coll`
    /// carries it to the others. Every rank calls this, at the same point of the run.
    pub fn join(
        coll: &mut dyn Collective,
        device: &candle_core::CudaDevice,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let (rank, world) = (coll.rank(), coll.world());
        let mine = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e.0))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let bytes = coll.broadcast(&mine)?;
        let internal: [std::ffi::c_char; 128] = match <[u8; 128]>::try_from(bytes.as_slice()) {
            Ok(b) => b.map(|c| c as std::ffi::c_char),
            Err(_) => {
                return Err(DistError::Mismatch {
                    op: "nccl_unique_id",
                    rank: 0,
                    got: bytes.len(),
                    want: 128,
                })
            }
        };
        let id = Id::uninit(internal);
        let stream = device.cuda_stream();
        // ncclCommInitRank blocks until every rank has called it: wait in another thread, with
        // the group's deadline.
        let (tx, rx) = mpsc::channel();
        let init_stream = stream.clone();
        std::thread::spawn(move || {
            let made = init_stream
                .context()
                .bind_to_thread()
                .map_err(|e| nccl_error("binding the card to the NCCL thread", e))
                .and_then(|()| {
                    Comm::from_rank(init_stream, rank, world, id)
                        .map(Made)
                        .map_err(|e| nccl_error("ncclCommInitRank", e.0))
                });
            let _ = tx.send(made);
        });
        let comm = match rx.recv_timeout(timeout) {
            Ok(made) => made?.0,
            Err(_) => return Err(overdue("ncclCommInitRank", timeout)),
        };
        Ok(Self {
            comm,
            stream,
            timeout,
        })
    }

    /// Waits for the card's stream with the group's deadline; past it, the communicator is
    /// aborted (by [`Comm`]'s drop when the run ends) and the run ends.
    fn wait(&self, op: &'static str) -> Result<(), DistError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| nccl_error(op, e))?;
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(nccl_error(op, e)),
            }
            if start.elapsed() > self.timeout {
                return Err(overdue(op, self.timeout));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl DeviceSum for Nccl {
    /// Sums `t` over the ranks, in place, and waits until the sum is done.
    fn sum_in_place(&mut self, t: &Tensor) -> Result<(), DistError> {
        if !t.is_contiguous() || t.dtype() != candle_core::DType::F32 {
            return Err(nccl_error(
                "ncclAllReduce",
                "the buffer must be a contiguous f32 tensor",
            ));
        }
        t.inplace_op1(&AllReduce { comm: &self.comm })
            .map_err(|e| nccl_error("ncclAllReduce", e))?;
        self.wait("ncclAllReduce")
    }
}

/// NCCL's in-place sum of one tensor's storage.
struct AllReduce<'a> {
    comm: &'a Comm,
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL sums CUDA tensors only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL: a non-contiguous buffer".into()))?;
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let mut view = slice.slice_mut(start..end);
        self.comm
            .all_reduce_in_place(&mut view, &ReduceOp::Sum)
            .map_err(|e| candle_core::Error::Msg(format!("ncclAllReduce: {:?}", e.0)))?;
        Ok(())
    }
}
