//! Gradient checkpointing: a segment (a resnet, a transformer block, a text-encoder layer) keeps
//! only its inputs in the forward and is recomputed in backward.
//!
//! Candle has no facility for this, so it is built from its pieces (../shared/NOTES.md):
//! - the forward runs the segment on detached inputs; its graph is dropped at once and only the
//!   output is attached (`super::fused_op`) as an op over the inputs and an anchor
//!   (`(inputs…, anchor) → out`), so the outer graph holds the segment's inputs and nothing
//!   inside it;
//! - the op's backward reruns the segment with the tracked inputs as fresh Vars and runs an
//!   inner backward seeded with the upstream gradient (`Tensor::into_backward_seeded`: the
//!   gradients of `Σ(out · grad)` without that sum in the graph, the recomputed graph freed as
//!   the walk passes it). The inputs' gradients go back to candle's backward; the parameters'
//!   gradients (which candle's backward cannot return from an attached op) are summed into this
//!   object's store, which the step merges after the outer backward
//!   ([`Checkpointing::take_grads`]);
//! - `anchor` is a 1-element Var, so the op joins the graph even when no input is tracked (the
//!   first resnet of a LoRA run sees a constant input, yet its adapters train).
//!
//! Randomness replays: a draw made through [`replayable`] while a segment runs forward is
//! recorded as the RNG's state before it, and the recomputation draws from that state again,
//! so LoRA dropout picks the same mask twice.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, TensorId, Var};
use rand::rngs::StdRng;

use super::fused_op::{attach_n, BackwardN};

/// A segment: inputs `(a, b)` → output. `b` is `None` for one-input segments.
pub type Segment = Arc<dyn Fn(&Tensor, Option<&Tensor>) -> Result<Tensor> + Send + Sync>;

/// A segment of any number of inputs, in the order [`Checkpointing::run_n`] was given them.
pub type SegmentN = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// The checkpointing context of one model: the trainable parameters and the gradients the
/// recomputations produced for them. Cheap to clone (shared).
#[derive(Clone)]
pub struct Checkpointing {
    inner: Arc<Inner>,
}

struct Inner {
    params: Vec<Var>,
    param_ids: HashSet<TensorId>,
    grads: Mutex<GradStore>,
    anchor: Var,
    /// Segments run forward since creation.
    segments: AtomicUsize,
    /// Whether each segment's forward counts the parameters it uses (for a fused backward).
    track_uses: AtomicBool,
    /// Segments that used each parameter since the last [`Checkpointing::take_uses`].
    uses: Mutex<HashMap<TensorId, usize>>,
}

impl std::fmt::Debug for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpointing({} params)", self.inner.params.len())
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| candle_core::Error::Msg("checkpointing: poisoned lock".into()))
}

impl Checkpointing {
    /// Checkpointing for segments whose trainable parameters are among `params`.
    pub fn new(params: Vec<Var>, device: &Device) -> Result<Self> {
        Ok(Self {
            inner: Arc::new(Inner {
                param_ids: params.iter().map(|v| v.as_tensor().id()).collect(),
                params,
                grads: Mutex::new(GradStore::default()),
                anchor: Var::zeros(1, DType::F32, device)?,
                segments: Default::default(),
                track_uses: Default::default(),
                uses: Default::default(),
            }),
        })
    }

    /// The parameter gradients the recomputations produced since the last call (summed over
    /// segments), leaving the store empty.
    pub fn take_grads(&self) -> Result<GradStore> {
        Ok(std::mem::take(&mut *lock(&self.inner.grads)?))
    }

    /// Segments run through [`Checkpointing::run`] since this context was made (its clones
    /// count together): which blocks a partial selection checkpoints shows here.
    pub fn segments(&self) -> usize {
        self.inner.segments.load(Ordering::Relaxed)
    }

    /// Counts, from now on, the parameters each segment's forward uses (a fused backward pass
    /// needs to know how many parts of each gradient to wait for).
    pub fn track_uses(&self, on: bool) {
        self.inner.track_uses.store(on, Ordering::Relaxed);
    }

    /// How many segments used each parameter since the last call, leaving the count empty.
    pub fn take_uses(&self) -> Result<HashMap<TensorId, usize>> {
        Ok(std::mem::take(&mut *lock(&self.inner.uses)?))
    }

    /// Runs `segment(a, b)` keeping only `a` and `b` for backward.
    pub fn run(&self, a: &Tensor, b: Option<&Tensor>, segment: Segment) -> Result<Tensor> {
        let inputs: Vec<&Tensor> = std::iter::once(a).chain(b).collect();
        self.run_n(
            &inputs,
            Arc::new(move |xs: &[Tensor]| segment(&xs[0], xs.get(1))),
        )
    }

    /// Runs `segment(inputs)` keeping only `inputs` for backward. A segment that combines
    /// tensors the outer graph keeps anyway (an up block's resnet concatenating its input with
    /// a skip) takes them as separate inputs, so the combination is not kept beside them.
    pub fn run_n(&self, inputs: &[&Tensor], segment: SegmentN) -> Result<Tensor> {
        if inputs.is_empty() {
            candle_core::bail!("checkpointing: a segment without inputs");
        }
        // A segment nested in one being recomputed was counted by the forward.
        let first_run = !replaying();
        if first_run {
            self.inner.segments.fetch_add(1, Ordering::Relaxed);
        }
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        let (out, tape) = record(|| segment(&detached))?;
        drop(detached);
        if first_run && self.inner.track_uses.load(Ordering::Relaxed) {
            let mut uses = lock(&self.inner.uses)?;
            for node in out.sorted_nodes() {
                if node.is_variable() && self.inner.param_ids.contains(&node.id()) {
                    *uses.entry(node.id()).or_default() += 1;
                }
            }
        }
        let recompute = Recompute {
            ctx: self.clone(),
            segment,
            tape: Mutex::new(tape),
        };
        // Detached: the segment's forward graph is dropped with `out`.
        let held = out.detach();
        drop(out);
        let mut args = inputs.to_vec();
        args.push(self.inner.anchor.as_tensor());
        attach_n(&args, "checkpoint", held, recompute)
    }

    fn add_param_grads(&self, mut inner: GradStore) -> Result<()> {
        let mut store = lock(&self.inner.grads)?;
        for var in &self.inner.params {
            if let Some(g) = inner.remove(var) {
                let sum = match store.remove(var) {
                    Some(acc) => (acc + g)?.detach(),
                    None => g.detach(),
                };
                store.insert(var, sum);
            }
        }
        Ok(())
    }
}

/// The backward of a checkpointed segment: rerun it, then backpropagate through the rerun.
struct Recompute {
    ctx: Checkpointing,
    segment: SegmentN,
    tape: Mutex<VecDeque<StdRng>>,
}

/// `t` as a recomputation input: a fresh Var when the outer graph wants its gradient, else a
/// constant.
fn recompute_input(t: &Tensor) -> Result<(Tensor, Option<Var>)> {
    if t.track_op() {
        let v = Var::from_tensor(&t.detach())?;
        Ok((v.as_tensor().clone(), Some(v)))
    } else {
        Ok((t.detach(), None))
    }
}

impl BackwardN for Recompute {
    /// `args` are the segment's inputs and the anchor, last (it gets no gradient).
    fn backward(
        &self,
        args: &[Tensor],
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let Some((_anchor, inputs)) = args.split_last() else {
            candle_core::bail!("checkpointing: a segment's op lost its arguments");
        };
        let (values, vars): (Vec<Tensor>, Vec<Option<Var>>) = inputs
            .iter()
            .map(recompute_input)
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let tape = std::mem::take(&mut *lock(&self.tape)?);
        let out = replay(tape, || (self.segment)(&values))?;
        drop(values);
        let grad = grad.detach().to_dtype(out.dtype())?;
        let mut grads = if super::grad_sink::active() {
            self.backward_fused(out, &grad, &vars)?
        } else {
            // Given up to the backward: the recomputed graph is freed as the walk passes it.
            let mut store = out.into_backward_seeded(&grad)?;
            drop(grad);
            let grads = vars
                .iter()
                .map(|v| v.as_ref().and_then(|v| store.remove(v.as_tensor())))
                .collect();
            self.ctx.add_param_grads(store)?;
            grads
        };
        grads.push(None);
        Ok(grads)
    }
}

impl Recompute {
    /// The inner backward of a fused backward pass: each parameter's part of its gradient goes
    /// to the installed sink as soon as this segment's walk completes it, and only the inputs'
    /// gradients come back.
    fn backward_fused(
        &self,
        out: Tensor,
        grad: &Tensor,
        vars: &[Option<Var>],
    ) -> Result<Vec<Option<Tensor>>> {
        let ids: Vec<Option<TensorId>> = vars
            .iter()
            .map(|v| v.as_ref().map(|v| v.as_tensor().id()))
            .collect();
        let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
        let params = &self.ctx.inner.param_ids;
        out.into_backward_seeded_with(grad, &mut |node, g| {
            if let Some(i) = ids.iter().position(|id| *id == Some(node.id())) {
                grads[i] = Some(g);
            } else if params.contains(&node.id()) {
                super::grad_sink::deliver(node, g)?;
            }
            Ok(())
        })?;
        Ok(grads)
    }
}

/// One level of the RNG tape: a segment's forward recording its draws, or its recomputation
/// replaying them. Segments nest (SDXL's transformers checkpoint each of their blocks inside the
/// transformer's own segment), so the tape is a stack.
enum Frame {
    Record(VecDeque<StdRng>),
    Replay(VecDeque<StdRng>),
}

thread_local! {
    static TAPE: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `frame` on top of the tape; returns the frame as `f` left it.
fn with_frame<T>(frame: Frame, f: impl FnOnce() -> Result<T>) -> Result<(T, Frame)> {
    TAPE.with(|t| t.borrow_mut().push(frame));
    let result = f();
    let frame = TAPE.with(|t| t.borrow_mut().pop());
    match frame {
        Some(frame) => Ok((result?, frame)),
        None => candle_core::bail!("checkpointing: the RNG tape lost a frame"),
    }
}

fn record<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, VecDeque<StdRng>)> {
    match with_frame(Frame::Record(VecDeque::new()), f)? {
        (value, Frame::Record(states)) => Ok((value, states)),
        _ => candle_core::bail!("checkpointing: the RNG tape changed mode while recording"),
    }
}

fn replay<T>(states: VecDeque<StdRng>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match with_frame(Frame::Replay(states), f)? {
        (value, Frame::Replay(s)) if s.is_empty() => Ok(value),
        _ => candle_core::bail!("checkpointing: the recomputation drew a different number of random values than the forward"),
    }
}

/// Whether a segment is being recomputed on this thread (segments run inside it are then
/// replays of segments the forward already counted).
fn replaying() -> bool {
    TAPE.with(|t| t.borrow().iter().any(|f| matches!(f, Frame::Replay(_))))
}

/// Draws with `draw` from `rng` so that a checkpointed segment's recomputation draws the same
/// values: recorded (the state before the draw) inside a segment's forward, replayed from that
/// state inside its recomputation, a plain draw elsewhere. Nested segments: the draw comes from
/// the innermost recomputation under way (what the original forward drew), else from `rng`, and
/// every segment recording on the tape records it.
pub fn replayable<T>(rng: &mut StdRng, draw: impl FnOnce(&mut StdRng) -> T) -> T {
    TAPE.with(|t| {
        let mut stack = t.borrow_mut();
        if stack.is_empty() {
            return draw(rng);
        }
        // Some(None): more draws than recorded; `replay` reports it after the segment.
        let replayed: Option<Option<StdRng>> = stack.iter_mut().rev().find_map(|f| match f {
            Frame::Replay(states) => Some(states.pop_front()),
            Frame::Record(_) => None,
        });
        let state = match &replayed {
            Some(Some(saved)) => saved.clone(),
            _ => rng.clone(),
        };
        for f in stack.iter_mut() {
            if let Frame::Record(states) = f {
                states.push_back(state.clone());
            }
        }
        match replayed {
            None => draw(rng),
            Some(_) => draw(&mut state.clone()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::randn;
    use rand::{Rng, SeedableRng};

    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        (d.to_scalar::<f32>().unwrap()) / m.to_scalar::<f32>().unwrap().max(1e-12)
    }

    /// Under a fused backward pass, a parameter used by two checkpointed segments and by the
    /// outer graph arrives in three parts (one per segment, from its recomputation, and one from
    /// the outer walk), which sum to its plain gradient; the forward counted the two segment
    /// uses. Catches a segment's part kept in the store instead of delivered, or a use not
    /// counted (the sink would update before the last part).
    #[test]
    fn a_fused_backward_delivers_each_segments_part() {
        use std::cell::RefCell;
        use std::rc::Rc;
        struct Record(Rc<RefCell<Vec<(TensorId, Tensor)>>>);
        impl super::super::grad_sink::GradSink for Record {
            fn deliver(&mut self, param: &Tensor, grad: Tensor) -> Result<()> {
                self.0.borrow_mut().push((param.id(), grad));
                Ok(())
            }
        }
        let dev = Device::Cpu;
        let w = Var::from_tensor(&randn(&[5, 5], 11)).unwrap();
        let a = Var::from_tensor(&randn(&[2, 5], 12)).unwrap();
        let wt = w.as_tensor().clone();
        let seg: Segment = Arc::new(move |x: &Tensor, _| x.matmul(&wt)?.tanh());
        let forward = |ck: Option<&Checkpointing>| {
            let run = |x: &Tensor| match ck {
                Some(ck) => ck.run(x, None, seg.clone()),
                None => seg(x, None),
            };
            let y = run(&run(a.as_tensor()).unwrap()).unwrap();
            y.matmul(w.as_tensor())
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let plain = forward(None).backward().unwrap();
        let ck = Checkpointing::new(vec![w.clone()], &dev).unwrap();
        ck.track_uses(true);
        let loss = forward(Some(&ck));
        let uses = ck.take_uses().unwrap();
        assert_eq!(uses.get(&w.as_tensor().id()), Some(&2));
        let parts = Rc::new(RefCell::new(Vec::new()));
        super::super::grad_sink::install(Box::new(Record(parts.clone())));
        let rest = loss
            .backward_with(&mut |n, g| super::super::grad_sink::deliver(n, g))
            .unwrap();
        drop(super::super::grad_sink::take());
        assert!(rest.get(w.as_tensor()).is_none() && ck.take_grads().unwrap().get(&w).is_none());
        let parts: Vec<Tensor> = parts
            .borrow()
            .iter()
            .filter(|(id, _)| *id == w.as_tensor().id())
            .map(|(_, g)| g.clone())
            .collect();
        assert_eq!(parts.len(), 3);
        let sum = ((&parts[0] + &parts[1]).unwrap() + &parts[2]).unwrap();
        assert!(rel_diff(&sum, plain.get(&w).unwrap()) < 1e-5);
    }

    /// Gradients of a two-input segment with its own parameter, checkpointed and plain.
    #[test]
    fn gradients_match_the_plain_path_for_inputs_and_parameters() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&randn(&[6, 6], 1)).unwrap();
        let a = Var::from_tensor(&randn(&[3, 6], 2)).unwrap();
        let b = Var::from_tensor(&randn(&[3, 6], 3)).unwrap();
        let wt = w.as_tensor().clone();
        let seg: Segment = Arc::new(move |x: &Tensor, y: Option<&Tensor>| {
            let h = x.matmul(&wt)?.tanh()?;
            (h * y.unwrap())?.matmul(&wt.t()?)
        });
        let plain = seg(a.as_tensor(), Some(b.as_tensor()))
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let ck = Checkpointing::new(vec![w.clone()], &dev).unwrap();
        let out = ck.run(a.as_tensor(), Some(b.as_tensor()), seg).unwrap();
        let mut outer = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let inner = ck.take_grads().unwrap();
        assert!(outer.get(w.as_tensor()).is_none());
        for v in [&a, &b] {
            let d = rel_diff(
                outer.remove(v.as_tensor()).as_ref().unwrap(),
                plain.get(v).unwrap(),
            );
            assert!(d < 1e-6, "input grad differs by {d}");
        }
        let d = rel_diff(inner.get(w.as_tensor()).unwrap(), plain.get(&w).unwrap());
        assert!(d < 1e-6, "parameter grad differs by {d}");
        assert!(
            ck.take_grads().unwrap().get(w.as_tensor()).is_none(),
            "taken once"
        );
    }

    /// A seeded backward (what a segment's recomputation runs) gives the gradients of the
    /// surrogate `Σ(out ⊙ grad)` it replaced, bit for bit in bf16, and refuses a seed that does
    /// not match its tensor. Catches a seed ignored (ones), or cast in a way that rounds it.
    #[test]
    fn a_seeded_backward_equals_the_surrogate_sum() -> Result<()> {
        let x = Var::from_tensor(&randn(&[3, 6], 21).to_dtype(DType::BF16)?)?;
        let w = Var::from_tensor(&randn(&[6, 6], 22).to_dtype(DType::BF16)?)?;
        let out = (x.as_tensor().matmul(w.as_tensor())?.tanh()? * x.as_tensor())?;
        let g = randn(&[3, 6], 23).to_dtype(DType::BF16)?;
        let surrogate = (out.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?;
        let want = surrogate.backward()?;
        let got = out.clone().into_backward_seeded(&g)?;
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.flatten_all()?
                .to_vec1::<half::bf16>()?
                .into_iter()
                .map(half::bf16::to_bits)
                .collect())
        };
        for v in [&x, &w] {
            let (Some(a), Some(b)) = (got.get(v.as_tensor()), want.get(v.as_tensor())) else {
                candle_core::bail!("a gradient is missing");
            };
            assert_eq!(bits(a)?, bits(b)?);
        }
        assert!(
            out.clone().into_backward_seeded(&g.t()?).is_err(),
            "a transposed seed"
        );
        assert!(
            out.into_backward_seeded(&g.to_dtype(DType::F32)?).is_err(),
            "an f32 seed"
        );
        Ok(())
    }

    /// A three-input segment with a constant in the middle (an up block's resnet over its input,
    /// a skip from below the adapters and the time embedding): each tracked input gets its own
    /// gradient, the constant none, and the parameter's equals the plain path's. Catches the
    /// inputs' gradients returned in the wrong places (the anchor's slot, a swap) or a constant
    /// recomputed as a Var.
    #[test]
    fn a_three_input_segment_matches_the_plain_path() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&randn(&[7, 5], 31))?;
        let a = Var::from_tensor(&randn(&[2, 4], 32))?;
        let skip = randn(&[2, 3], 33);
        let t = Var::from_tensor(&randn(&[2, 5], 34))?;
        let wt = w.as_tensor().clone();
        let seg: SegmentN = Arc::new(move |xs: &[Tensor]| match xs {
            [a, skip, t] => Tensor::cat(&[a, skip], 1)?.matmul(&wt)?.tanh()? * t.sin()?,
            _ => candle_core::bail!("three inputs"),
        });
        let loss = |out: Tensor| -> Result<Tensor> { (out.sqr()? * 0.5)?.sum_all() };
        let inputs = [a.as_tensor(), &skip, t.as_tensor()];
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        let plain = loss(seg(&owned)?)?.backward()?;
        let ck = Checkpointing::new(vec![w.clone()], &dev)?;
        let outer = loss(ck.run_n(&inputs, seg)?)?.backward()?;
        let inner = ck.take_grads()?;
        assert!(outer.get(&skip).is_none(), "the constant got a gradient");
        assert!(outer.get(w.as_tensor()).is_none());
        let pairs = [
            (outer.get(a.as_tensor()), plain.get(a.as_tensor())),
            (outer.get(t.as_tensor()), plain.get(t.as_tensor())),
            (inner.get(w.as_tensor()), plain.get(w.as_tensor())),
        ];
        for (i, pair) in pairs.into_iter().enumerate() {
            let (Some(got), Some(want)) = pair else {
                candle_core::bail!("gradient {i} is missing");
            };
            let d = crate::nn::test_util::rel_err(got, want);
            assert!(d < 1e-6, "gradient {i} differs by {d}");
        }
        Ok(())
    }

    /// A constant input (no tracked op) still lets the segment's parameters train, and gets no
    /// gradient itself.
    #[test]
    fn a_constant_input_still_trains_the_segment() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&randn(&[4, 4], 4)).unwrap();
        let x = randn(&[2, 4], 5);
        let wt = w.as_tensor().clone();
        let seg: Segment = Arc::new(move |x: &Tensor, _| x.matmul(&wt)?.sin());
        let plain = seg(&x, None)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let ck = Checkpointing::new(vec![w.clone()], &dev).unwrap();
        let out = ck.run(&x, None, seg).unwrap();
        let outer = out.sum_all().unwrap().backward().unwrap();
        assert!(outer.get(&x).is_none());
        let inner = ck.take_grads().unwrap();
        assert!(rel_diff(inner.get(w.as_tensor()).unwrap(), plain.get(&w).unwrap()) < 1e-6);
    }

    /// Segments nested in a segment (SDXL's transformer blocks inside their transformer's): the
    /// loss and every gradient equal the plain path's, with each inner segment drawing a random
    /// mask, and the segment count is the forward's (3), not the recomputations'. Catches an outer
    /// tape that misses the inner draws (the outer recomputation would draw fresh masks), and the
    /// replays counted as segments.
    #[test]
    fn nested_segments_replay_their_draws() {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&randn(&[4, 4], 21)).unwrap();
        let a = Var::from_tensor(&randn(&[3, 4], 22)).unwrap();
        let inner = |rng: Arc<Mutex<StdRng>>| -> Segment {
            let wt = w.as_tensor().clone();
            Arc::new(move |x: &Tensor, _| {
                let mask: Vec<f32> = {
                    let mut g = rng.lock().unwrap();
                    replayable(&mut g, |g| {
                        (0..12).map(|_| g.random_range(0.0..2.0f32)).collect()
                    })
                };
                let m = Tensor::from_vec(mask, (3, 4), x.device())?;
                (x.matmul(&wt)? * m)?.tanh()
            })
        };
        let run = |ck: Option<&Checkpointing>| {
            let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(5)));
            let seg = inner(rng);
            let ck_inner = ck.cloned();
            let outer: Segment = Arc::new(move |x: &Tensor, _| {
                let mut y = x.clone();
                for _ in 0..2 {
                    y = match &ck_inner {
                        Some(ck) => ck.run(&y, None, seg.clone())?,
                        None => seg(&y, None)?,
                    };
                }
                Ok(y)
            });
            let y = match ck {
                Some(ck) => ck.run(a.as_tensor(), None, outer).unwrap(),
                None => outer(a.as_tensor(), None).unwrap(),
            };
            let loss = y.sqr().unwrap().sum_all().unwrap();
            let mut grads = loss.backward().unwrap();
            if let Some(ck) = ck {
                let inner = ck.take_grads().unwrap();
                let g = inner.get(w.as_tensor()).unwrap().clone();
                grads.insert(w.as_tensor(), g);
            }
            (loss.to_scalar::<f32>().unwrap(), grads)
        };
        let (l0, g0) = run(None);
        let ck = Checkpointing::new(vec![w.clone()], &dev).unwrap();
        let (l1, g1) = run(Some(&ck));
        assert_eq!(l0, l1);
        for v in [&w, &a] {
            let d = rel_diff(g1.get(v).unwrap(), g0.get(v).unwrap());
            assert!(d < 1e-6, "gradient differs by {d}");
        }
        assert_eq!(ck.segments(), 3, "one outer and two inner segments");
    }

    /// The recomputation sees the forward's random draws, not fresh ones.
    #[test]
    fn random_draws_replay_in_the_recomputation() {
        let dev = Device::Cpu;
        let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(7)));
        let w = Var::from_tensor(&Tensor::ones(5, DType::F32, &dev).unwrap()).unwrap();
        let wt = w.as_tensor().clone();
        let r = rng.clone();
        let seg: Segment = Arc::new(move |x: &Tensor, _| {
            let mask: Vec<f32> = {
                let mut g = r.lock().unwrap();
                replayable(&mut g, |g| {
                    (0..5).map(|_| g.random_range(0.0..1.0f32)).collect()
                })
            };
            let m = Tensor::new(mask.as_slice(), x.device())?;
            (x * m)?.mul(&wt)
        });
        let x = Tensor::ones(5, DType::F32, &dev).unwrap();
        let ck = Checkpointing::new(vec![w.clone()], &dev).unwrap();
        let out = ck.run(&x, None, seg).unwrap();
        let mask = out.to_vec1::<f32>().unwrap();
        out.sum_all().unwrap().backward().unwrap();
        let g = ck.take_grads().unwrap();
        // d/dw Σ x·m·w = m: the forward's mask, drawn once.
        assert_eq!(
            g.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            mask
        );
        // The module's RNG advanced by one draw only: the replay did not consume it.
        let mut fresh = StdRng::seed_from_u64(7);
        let _: Vec<f32> = (0..5).map(|_| fresh.random_range(0.0..1.0f32)).collect();
        assert_eq!(rng.lock().unwrap().random::<u64>(), fresh.random::<u64>());
    }
}
