//! Data-parallel training (issue 24): the same run on several ranks, each with its own copy of the
//! model, each taking whole micro-batches of every step ([`super::sample_cursor::SampleCursor::for_rank`]).
//!
//! After its micro-batches, each rank's summed loss and gradients are summed over the ranks
//! ([`reduce_step`]): every micro-batch's loss is already weighted by its share of the whole
//! step, so the sum is the step's gradient, the same as one process accumulating every
//! micro-batch (to f32 rounding: the order of the additions differs). Every rank then applies
//! the same update to the same weights. Each rank decodes only its own micro-batches' images,
//! and the ranks agree on those that failed to decode ([`agree_failures`]), on the micro-batch
//! size after an out-of-memory halving ([`agree_micro`]), and on stopping ([`agree_flag`]).
//!
//! [`train_ranks`] runs the ranks as threads of this process, through the in-process
//! collective; rank 0 alone logs, samples, validates and saves.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use candle_core::{DType, Device, Tensor, Var};

use super::accumulate::Accumulated;
use super::data_feed::Failure;
use super::micro_batch::MicroBatching;
use super::outcome::TrainOutcome;
use super::trainer::{RunOptions, Session};
use crate::config::TrainPlan;
use crate::dist::{Collective, DeviceSum, DistError, InProcess};

/// This rank's place in the run and its link to the others.
pub struct RankLink {
    pub coll: Box<dyn Collective>,
    /// The gradients' sum on the cards (NCCL), when the ranks train on CUDA and the build has
    /// it; else the gradients go through `coll` on the host.
    pub device_sum: Option<Box<dyn DeviceSum>>,
}

impl RankLink {
    /// A link whose gradients are summed through `coll` on the host.
    pub fn host(coll: Box<dyn Collective>) -> Self {
        Self {
            coll,
            device_sum: None,
        }
    }

    pub fn rank(&self) -> usize {
        self.coll.rank()
    }

    pub fn world(&self) -> usize {
        self.coll.world()
    }

    pub fn leads(&self) -> bool {
        self.rank() == 0
    }
}

/// The most gradient elements summed in one exchange: the step's gradients go in chunks of about
/// 256 MiB of f32, each a fresh buffer, so the sum needs that much memory beyond the gradients,
/// not a second copy of all of them.
pub(super) const CHUNK_ELEMS: usize = 64 << 20;

/// Sums the step's loss, gradients and sample count over the ranks, into `done` on every rank.
/// A parameter no rank has a gradient for stays without one (as in one process); one that some
/// rank lacks counts as zeros there. The small values (which parameters have a gradient, the
/// loss, the counts) go through the collective first; the gradients follow in f32 chunks of at
/// most `chunk` elements, summed on the card when the link has a [`DeviceSum`].
pub(super) fn reduce_step(
    link: &mut RankLink,
    params: &[Var],
    done: &mut Accumulated,
    chunk: usize,
) -> anyhow::Result<()> {
    let mut small: Vec<f32> = params
        .iter()
        .map(|v| f32::from(u8::from(done.grads.get(v).is_some())))
        .collect();
    small.push(done.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
    small.push(done.samples as f32);
    small.push(done.micro_batches as f32);
    link.coll
        .all_reduce_sum(&mut small)
        .context("summing the step's loss over the ranks")?;
    let n = params.len();
    let wanted: Vec<&Var> = params
        .iter()
        .zip(&small)
        .filter(|(_, &p)| p > 0.0)
        .map(|(v, _)| v)
        .collect();
    let mut start = 0;
    while start < wanted.len() {
        let mut end = start + 1;
        let mut elems = wanted[start].elem_count();
        while end < wanted.len() && elems + wanted[end].elem_count() <= chunk {
            elems += wanted[end].elem_count();
            end += 1;
        }
        sum_chunk(link, &wanted[start..end], done)
            .context("summing the step's gradients over the ranks")?;
        start = end;
    }
    let device = done.loss.device().clone();
    done.loss = Tensor::new(small[n], &device)?.to_dtype(done.loss.dtype())?;
    done.samples = small[n + 1] as usize;
    done.micro_batches = small[n + 2] as usize;
    Ok(())
}

/// Sums the gradients of `params` (zeros where this rank has none) over the ranks, as one fresh
/// f32 buffer, and puts the sums back in each gradient's dtype.
fn sum_chunk(link: &mut RankLink, params: &[&Var], done: &mut Accumulated) -> anyhow::Result<()> {
    let Some(first) = params.first() else {
        return Ok(());
    };
    let device = first.device().clone();
    let mut parts = Vec::with_capacity(params.len());
    let mut dtypes = Vec::with_capacity(params.len());
    for v in params {
        let g = match done.grads.get(v) {
            Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
            None => Tensor::zeros(v.elem_count(), DType::F32, &device)?,
        };
        dtypes.push(done.grads.get(v).map_or(v.dtype(), Tensor::dtype));
        parts.push(g);
    }
    // The device sum writes in place, so it gets a buffer of its own: `cat` makes one for
    // several parts, but hands one part back as it is (a gradient's own storage).
    let single = parts.len() == 1;
    let flat = Tensor::cat(&parts, 0)?;
    drop(parts);
    let flat = match link.device_sum.as_mut() {
        Some(sum) if !device.is_cpu() => {
            let flat = if single {
                flat.copy()?
            } else {
                flat.contiguous()?
            };
            sum.sum_in_place(&flat)?;
            flat
        }
        _ => {
            let mut host = flat.to_vec1::<f32>()?;
            link.coll.all_reduce_sum(&mut host)?;
            Tensor::from_vec(host, flat.dims1()?, &Device::Cpu)?.to_device(&device)?
        }
    };
    let mut offset = 0;
    for (v, dtype) in params.iter().zip(dtypes) {
        let n = v.elem_count();
        let g = flat
            .narrow(0, offset, n)?
            .reshape(v.shape())?
            .to_dtype(dtype)?;
        done.grads.insert(v, g);
        offset += n;
    }
    Ok(())
}

/// The smallest micro-batch size in force on any rank, on every rank: after an out-of-memory
/// halving on one rank, all go on at the halved size (the effective batch is the step's either
/// way).
pub(super) fn agree_micro(
    coll: &mut dyn Collective,
    micro: &mut MicroBatching,
) -> anyhow::Result<()> {
    let sizes = coll
        .all_gather("micro_batch_size", &(micro.size as u64).to_le_bytes())
        .context("agreeing on the micro-batch size")?;
    let smallest = sizes
        .iter()
        .filter_map(|b| b.as_slice().try_into().ok().map(u64::from_le_bytes))
        .min()
        .unwrap_or(micro.size as u64) as usize;
    while micro.size > smallest.max(1) {
        if !micro.halve() {
            break;
        }
    }
    Ok(())
}

/// Every rank's decode failures of a step, on every rank, in the step's order: each rank
/// decodes only its own micro-batches ([`super::data_feed::Shard`]), and all must leave out the
/// same samples, or their shares of the step (and so the summed gradient) would differ. Paths
/// travel as text (they are shown, not opened).
pub(super) fn agree_failures(
    coll: &mut dyn Collective,
    own: Vec<Failure>,
) -> anyhow::Result<Vec<Failure>> {
    let wire: Vec<(usize, String, String)> = own
        .into_iter()
        .map(|(pos, path, why)| (pos, path.to_string_lossy().into_owned(), why))
        .collect();
    let parts = coll
        .all_gather("decode_failures", &serde_json::to_vec(&wire)?)
        .context("agreeing on the step's images that failed to decode")?;
    let mut all = Vec::new();
    for (rank, bytes) in parts.iter().enumerate() {
        let theirs: Vec<(usize, String, String)> = serde_json::from_slice(bytes)
            .with_context(|| format!("rank {rank}'s list of images that failed to decode"))?;
        all.extend(
            theirs
                .into_iter()
                .map(|(pos, path, why)| (pos, PathBuf::from(path), why)),
        );
    }
    all.sort_by_key(|f| f.0);
    all.dedup_by_key(|f| f.0);
    Ok(all)
}

/// Steps between the weight checks of debug builds and tests ([`check_same_weights`]).
pub const WEIGHT_CHECK_EVERY: usize = 10;

/// Debug builds and tests: every rank's trained weights hash to rank 0's, or the run ends with
/// the rank that differs (a rank that skipped or mis-summed a gradient). Copies every trained
/// parameter to the host, so release builds do not run it.
pub(super) fn check_same_weights(
    coll: &mut dyn Collective,
    params: &[Var],
    step: usize,
) -> anyhow::Result<()> {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for v in params {
        for x in v
            .as_tensor()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
        {
            hash = (hash ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let all = coll
        .all_gather("weight_check", &hash.to_le_bytes())
        .context("comparing the ranks' weights")?;
    if let Some(rank) = all.iter().position(|h| *h != all[0]) {
        anyhow::bail!(
            "after step {}: rank {rank}'s weights differ from rank 0's (the ranks' updates \
             diverged)",
            step + 1
        );
    }
    Ok(())
}

/// Whether any rank's `flag` is set (Ctrl-C seen, a stop asked for), on every rank.
pub(super) fn agree_flag(coll: &mut dyn Collective, flag: bool) -> anyhow::Result<bool> {
    coll.any(flag).context("agreeing to stop")
}

/// How long a rank waits for the others at a collective before the run ends. Rank 0 may be
/// sampling, validating or saving meanwhile, which can take minutes on a large model.
pub const RANK_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Runs `plan` data-parallel on `devices`, one rank per device as a thread of this process;
/// rank 0 alone logs, samples, validates and saves, and its outcome is returned. A rank that
/// fails ends the run on every rank, and its error is the one returned.
pub fn train_ranks(
    plan: &TrainPlan,
    devices: &[Device],
    show_progress: bool,
    timeout: Duration,
) -> anyhow::Result<TrainOutcome> {
    if devices.is_empty() {
        anyhow::bail!("a data-parallel run needs at least one device");
    }
    refuse_unsupported(plan)?;
    let links = InProcess::group(devices.len(), timeout);
    let results: Vec<anyhow::Result<TrainOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = links
            .into_iter()
            .zip(devices)
            .map(|(link, device)| {
                let opts = RunOptions {
                    device: device.clone(),
                    show_progress: show_progress && link.rank() == 0,
                };
                scope.spawn(move || {
                    #[cfg(test)]
                    super::oom::inject::install_for_rank(link.rank());
                    // Rank 0 speaks for the run: the others would repeat its setup lines.
                    crate::console::set_quiet(link.rank() != 0);
                    train_rank(plan, &opts, Box::new(link))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("rank {rank} panicked")))
            })
            .collect()
    });
    pick_result(results)
}

/// The settings a run on several ranks cannot honour.
fn refuse_unsupported(plan: &TrainPlan) -> anyhow::Result<()> {
    if plan.precision.fused_backward_pass {
        anyhow::bail!(
            "fused_backward_pass updates each parameter during backward, before the ranks could \
             sum its gradient: turn it off to train on several devices"
        );
    }
    if plan.load_settings_every_epoch {
        anyhow::bail!(
            "load_settings_every_epoch would let ranks read train.json at different moments: \
             turn it off to train on several devices"
        );
    }
    Ok(())
}

/// Runs one rank of a data-parallel run over `coll` (the in-process group's, or a TCP group's in
/// a multi-process run): rank 0 writes the run's outputs. A run of more than one rank refuses
/// what it cannot honour ([`refuse_unsupported`]) on every rank.
pub fn train_rank(
    plan: &TrainPlan,
    opts: &RunOptions,
    coll: Box<dyn Collective>,
) -> anyhow::Result<TrainOutcome> {
    let rank = coll.rank();
    if coll.world() > 1 {
        refuse_unsupported(plan).with_context(|| format!("rank {rank}"))?;
    }
    let link = link_for(&opts.device, coll).with_context(|| format!("rank {rank}"))?;
    let session = Session::setup_rank(plan, opts, link).with_context(|| format!("rank {rank}"))?;
    session.run().with_context(|| format!("rank {rank}"))
}

/// This rank's link: on a CUDA card with the `nccl` feature, the gradients are summed by NCCL
/// on the cards (every rank joins the communicator here, at the same point); otherwise through
/// `coll` on the host.
fn link_for(device: &Device, mut coll: Box<dyn Collective>) -> anyhow::Result<RankLink> {
    #[cfg(feature = "nccl")]
    if let Device::Cuda(card) = device {
        let timeout = coll.timeout();
        let nccl = crate::dist::Nccl::join(coll.as_mut(), card, timeout)
            .context("joining the NCCL communicator")?;
        return Ok(RankLink {
            coll,
            device_sum: Some(Box::new(nccl)),
        });
    }
    let _ = (device, &mut coll);
    Ok(RankLink::host(coll))
}

/// Rank 0's outcome when every rank finished; else the first error that is not another rank's
/// leaving (the cause), else the first error.
fn pick_result(results: Vec<anyhow::Result<TrainOutcome>>) -> anyhow::Result<TrainOutcome> {
    if results.iter().all(Result::is_ok) {
        return results
            .into_iter()
            .next()
            .unwrap_or_else(|| Err(anyhow::anyhow!("no ranks")));
    }
    let is_echo = |e: &anyhow::Error| {
        e.chain().any(|c| {
            matches!(
                c.downcast_ref::<DistError>(),
                Some(DistError::RankLost { .. })
            )
        })
    };
    let errors: Vec<anyhow::Error> = results.into_iter().filter_map(Result::err).collect();
    let cause = errors.iter().position(|e| !is_echo(e)).unwrap_or(0);
    Err(errors
        .into_iter()
        .nth(cause)
        .unwrap_or_else(|| anyhow::anyhow!("no ranks")))
}

/// A folder of its own for a data-parallel follower's log, removed when dropped.
pub struct ScratchDir {
    path: std::path::PathBuf,
}

impl ScratchDir {
    pub fn create(rank: usize) -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("sdtrain-rank{rank}-{}-{nanos}", std::process::id());
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("creating rank {rank}'s scratch folder {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
