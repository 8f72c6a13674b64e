//! CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization",
//! arXiv 2307.02047) as the `came-pytorch` package (0.1.3) implements it, and `came8bit`: the
//! same with its full-size moments in blockwise 8-bit.
//!
//! Adafactor's factored second moment, plus a factored "instability" (the squared gap between the
//! update and its running mean) that scales the first moment by how much to trust it. For a
//! gradient `g`, betas `(β1, β2, β3)`, eps `(ε1, ε2)`:
//!
//! ```text
//! tensors with ≥ 2 dims, factored over the last two (rows R, columns C):
//!   row ← β2·row + (1 − β2)·mean_C(g² + ε1);  col ← β2·col + (1 − β2)·mean_R(g² + ε1)
//!   u = g / sqrt(row/mean_R(row) ⊗ col)
//! other tensors:  v ← β2·v + (1 − β2)·(g² + ε1);  u = g / sqrt(v)
//! u ← u / max(1, RMS(u)/clip_threshold)
//! m ← β1·m + (1 − β1)·u
//! factored:  res = (u − m)² + ε2
//!   res_row ← β3·res_row + (1 − β3)·mean_C(res);  res_col likewise over R
//!   update = m / sqrt(res_row/mean_R(res_row) ⊗ res_col)
//! other tensors:  update = m
//! p ← p − λ·lr·p;  p ← p − lr·update
//! ```
//!
//! State per matrix: `m` (full size) and four vectors; per other tensor `m` and `v`. `came8bit`
//! keeps `m`, and `v` of the non-factored tensors, in bitsandbytes' blockwise 8-bit
//! ([`super::quant8`]: dynamic maps, blocks of 256, tensors under 4096 elements in f32) as
//! SimpleTuner's `CAME8bit` quantizes them; the factored row and column vectors stay f32, as in
//! OneTrainer's `CAME8bit` (which also quantizes only `m`; they are a few bytes per row). Within a
//! step the update uses the f32 moment before it is requantized, as both do.
//!
//! The step is written with candle ops on the parameter's device (the reductions over rows,
//! columns and the whole tensor are Adafactor's, [`super::adafactor_device`]). An 8-bit moment
//! lives where its parameter does ([`PlacedMoment`]): on the host for a CPU parameter, in device
//! memory for a CUDA one, where each step dequantizes it to an f32 tensor and requantizes the new
//! values with the kernels of src/optim/quant8.cu (`super::quant8_cuda`, bit for bit the host's
//! [`super::quant8`] arithmetic), so the step copies no moment between host and device. The state
//! file is the same from either device.

use candle_core::{DType, Device, Tensor, Var, D};
use serde::Serialize;

use super::adafactor::factoring;
use super::hyper::invalid;
use super::placed::PlacedMoment;
use super::quant8::{maps, requantize, Moment, BLOCK, MIN_8BIT_SIZE};
use super::rule::{ParamState, UpdateRule};
use super::Result;

/// CAME's hyper-parameters (the lr is the group's). `Default` is came-pytorch's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CameParams {
    pub betas: (f64, f64, f64),
    /// `(ε1, ε2)`: added to g², and to the instability.
    pub eps: (f64, f64),
    pub clip_threshold: f64,
    pub weight_decay: f64,
}

impl Default for CameParams {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999, 0.9999),
            eps: (1e-30, 1e-16),
            clip_threshold: 1.0,
            weight_decay: 0.0,
        }
    }
}

/// The CAME rule, with f32 or 8-bit full-size moments.
#[derive(Debug, Clone, Copy)]
pub struct Came {
    hyper: CameParams,
    eight_bit: bool,
}

impl Came {
    pub fn rule(hyper: CameParams, eight_bit: bool) -> Result<Self> {
        let (b1, b2, b3) = hyper.betas;
        // came-pytorch accepts [0, 1]; β = 1 would freeze a moment at its zero start.
        for (field, b) in [("beta1", b1), ("beta2", b2), ("beta3", b3)] {
            if !(0.0..1.0).contains(&b) {
                return Err(invalid(field, b, "must be in [0, 1)"));
            }
        }
        if !(hyper.eps.0 >= 0.0 && hyper.eps.1 >= 0.0) {
            return Err(invalid("eps", hyper.eps.0.min(hyper.eps.1), "must be >= 0"));
        }
        if !(hyper.clip_threshold.is_finite() && hyper.clip_threshold > 0.0) {
            return Err(invalid(
                "clip_threshold",
                hyper.clip_threshold,
                "must be greater than 0",
            ));
        }
        if !(hyper.weight_decay.is_finite() && hyper.weight_decay >= 0.0) {
            return Err(invalid("weight_decay", hyper.weight_decay, "must be >= 0"));
        }
        Ok(Self { hyper, eight_bit })
    }

    /// Whether a full-size moment of `n` elements is 8-bit.
    fn q8(&self, n: usize) -> bool {
        self.eight_bit && n >= MIN_8BIT_SIZE
    }
}

/// The shapes of the factored vectors of a parameter of `shape`: rows, then columns.
fn factored_shapes(shape: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    factoring(shape)?;
    let n = shape.len();
    let mut col = shape[..n - 2].to_vec();
    col.push(shape[n - 1]);
    Some((shape[..n - 1].to_vec(), col))
}

impl UpdateRule for Came {
    fn name(&self) -> &'static str {
        if self.eight_bit {
            "came8bit"
        } else {
            "came"
        }
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        let shape = var.dims().to_vec();
        let dev = var.device();
        let zeros = |s: &[usize]| Tensor::zeros(s, DType::F32, dev);
        let full = |signed: bool| -> candle_core::Result<Full> {
            Ok(if self.q8(var.elem_count()) {
                let (s, u) = maps();
                Full::Q8(PlacedMoment::zeros(var, true, if signed { s } else { u })?)
            } else {
                Full::F32(zeros(&shape)?)
            })
        };
        let second = match factored_shapes(&shape) {
            Some((row, col)) => {
                Second::Factored([zeros(&row)?, zeros(&col)?, zeros(&row)?, zeros(&col)?])
            }
            None => Second::Full(full(false)?),
        };
        let m = full(true)?;
        Ok(Box::new(State {
            hyper: self.hyper,
            shape,
            device: dev.clone(),
            m,
            second,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        let n: usize = shape.iter().product();
        let full = Moment::bytes_for(n, self.eight_bit);
        match factored_shapes(shape) {
            Some((row, col)) => {
                full + 2 * 4 * (row.iter().product::<usize>() + col.iter().product::<usize>())
            }
            None => 2 * full,
        }
    }
}

/// A full-size moment: an f32 tensor on the parameter's device, or 8-bit where the parameter
/// lives.
#[derive(Debug)]
enum Full {
    F32(Tensor),
    Q8(PlacedMoment),
}

impl Full {
    /// The values as an f32 tensor of `shape` on `dev`.
    fn values(&self, shape: &[usize], dev: &Device, signed: bool) -> candle_core::Result<Tensor> {
        match self {
            Full::F32(t) => Ok(t.clone()),
            Full::Q8(PlacedMoment::Host(m)) => {
                let (s, u) = maps();
                Tensor::from_vec(m.values(if signed { s } else { u }), shape, &Device::Cpu)?
                    .to_device(dev)
            }
            #[cfg(feature = "cuda")]
            Full::Q8(PlacedMoment::Cuda(m)) => m.dequantize(shape, signed),
        }
    }

    /// Stores `t`'s values (requantized block by block for 8-bit).
    fn store(&mut self, t: Tensor, signed: bool) -> candle_core::Result<()> {
        match self {
            Full::F32(x) => *x = t,
            Full::Q8(PlacedMoment::Host(Moment::Q8 { codes, absmax })) => {
                let vals = t.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
                let (s, u) = maps();
                let map = if signed { s } else { u };
                for ((v, c), a) in vals.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)).zip(absmax) {
                    *a = requantize(v, map, c);
                }
            }
            Full::Q8(PlacedMoment::Host(m @ Moment::F32(_))) => {
                *m = Moment::F32(t.flatten_all()?.to_vec1()?)
            }
            #[cfg(feature = "cuda")]
            Full::Q8(PlacedMoment::Cuda(m)) => m.requantize(&t, signed)?,
        }
        Ok(())
    }

    fn save(
        &self,
        names: (&'static str, &'static str),
        shape: &[usize],
    ) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        match self {
            Full::F32(t) => Ok(vec![(names.0, t.to_device(&Device::Cpu)?)]),
            Full::Q8(m) => m.save(names, shape),
        }
    }

    fn load(
        &mut self,
        it: &mut std::vec::IntoIter<Tensor>,
        dev: &Device,
    ) -> candle_core::Result<()> {
        match self {
            Full::F32(t) => match it.next() {
                Some(x) => *t = x.to_dtype(DType::F32)?.to_device(dev)?,
                None => candle_core::bail!("came state: too few tensors"),
            },
            // A device moment is uploaded from the loaded host values.
            Full::Q8(m) => m.load(it)?,
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        match self {
            Full::F32(t) => 4 * t.elem_count(),
            Full::Q8(m) => m.bytes(),
        }
    }
}

/// The second moment and the instability: factored (row, col, res_row, res_col), or a full `v`.
#[derive(Debug)]
enum Second {
    Factored([Tensor; 4]),
    Full(Full),
}

#[derive(Debug)]
struct State {
    hyper: CameParams,
    shape: Vec<usize>,
    device: Device,
    m: Full,
    second: Second,
}

/// The state one step reads and writes, as f32 tensors on the parameter's device.
pub(crate) struct StepState {
    pub m: Tensor,
    /// `[row, col, res_row, res_col]` (factored) or `[v]`.
    pub second: Vec<Tensor>,
}

/// came-pytorch's `CAME.step` for one parameter, literally, in candle ops: the CPU and device
/// path. `p` and `g` are f32. Returns the new parameter and state.
pub(crate) fn came_step(
    h: &CameParams,
    p: &Tensor,
    g: &Tensor,
    st: &StepState,
    lr: f64,
) -> candle_core::Result<(Tensor, StepState)> {
    let (b1, b2, b3) = h.betas;
    let ema = |x: &Tensor, b: f64, new: &Tensor| (x * b)? + (new * (1.0 - b))?;
    let update = (g.sqr()? + h.eps.0)?;
    let (u, mut second) = match st.second.as_slice() {
        [row, col, ..] => {
            let row = ema(row, b2, &update.mean(D::Minus1)?)?;
            let col = ema(col, b2, &update.mean(D::Minus2)?)?;
            let u = approx_rsqrt(&row, &col)?.mul(g)?;
            (u, vec![row, col])
        }
        [v] => {
            let v = ema(v, b2, &update)?;
            let u = v.sqrt()?.recip()?.mul(g)?;
            (u, vec![v])
        }
        _ => candle_core::bail!("came state: {} second-moment tensors", st.second.len()),
    };
    let rms = (u.sqr()?.sum_all()?.to_scalar::<f32>()? as f64 / u.elem_count() as f64).sqrt();
    let u = (u / (rms / h.clip_threshold).max(1.0))?;
    let m = ema(&st.m, b1, &u)?;
    let step = match st.second.as_slice() {
        [_, _, res_row, res_col] => {
            let res = ((&u - &m)?.sqr()? + h.eps.1)?;
            let res_row = ema(res_row, b3, &res.mean(D::Minus1)?)?;
            let res_col = ema(res_col, b3, &res.mean(D::Minus2)?)?;
            let step = approx_rsqrt(&res_row, &res_col)?.mul(&m)?;
            second.extend([res_row, res_col]);
            step
        }
        _ => m.clone(),
    };
    let mut p = p.clone();
    if h.weight_decay != 0.0 {
        p = (&p + (&p * (-h.weight_decay * lr))?)?;
    }
    let p = (p - (step * lr)?)?;
    Ok((p, StepState { m, second }))
}

/// came-pytorch's `_approx_sq_grad`: `rsqrt(row/mean(row))` ⊗ `rsqrt(col)`, over the last two
/// dims.
fn approx_rsqrt(row: &Tensor, col: &Tensor) -> candle_core::Result<Tensor> {
    let rf = row
        .broadcast_div(&row.mean_keepdim(D::Minus1)?)?
        .sqrt()?
        .recip()?
        .unsqueeze(D::Minus1)?;
    let cf = col.unsqueeze(D::Minus2)?.sqrt()?.recip()?;
    rf.broadcast_mul(&cf)
}

impl ParamState for State {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, _t: u64) -> candle_core::Result<()> {
        let p = var.as_detached_tensor().to_dtype(DType::F32)?;
        let g = grad.detach().to_dtype(DType::F32)?;
        let (shape, dev) = (&self.shape, &self.device);
        let second = match &self.second {
            Second::Factored(t) => t.to_vec(),
            Second::Full(v) => vec![v.values(shape, dev, false)?],
        };
        let st = StepState {
            m: self.m.values(shape, dev, true)?,
            second,
        };
        let (p, st) = came_step(&self.hyper, &p, &g, &st, lr)?;
        var.set(&p.to_dtype(var.dtype())?)?;
        self.m.store(st.m, true)?;
        match (&mut self.second, st.second.try_into()) {
            (Second::Factored(t), Ok::<[Tensor; 4], _>(new)) => *t = new,
            (Second::Full(v), Err(mut one)) if one.len() == 1 => v.store(one.remove(0), false)?,
            _ => candle_core::bail!("came state: the step changed the state's layout"),
        }
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let mut out = self.m.save(("exp_avg", "exp_avg_absmax"), &self.shape)?;
        match &self.second {
            Second::Factored(t) => {
                let names = [
                    "exp_avg_sq_row",
                    "exp_avg_sq_col",
                    "exp_avg_res_row",
                    "exp_avg_res_col",
                ];
                for (name, t) in names.into_iter().zip(t) {
                    out.push((name, t.to_device(&Device::Cpu)?));
                }
            }
            Second::Full(v) => {
                out.extend(v.save(("exp_avg_sq", "exp_avg_sq_absmax"), &self.shape)?)
            }
        }
        Ok(out)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let dev = self.device.clone();
        let mut it = tensors.into_iter();
        self.m.load(&mut it, &dev)?;
        match &mut self.second {
            Second::Factored(t) => {
                for x in t.iter_mut() {
                    match it.next() {
                        Some(v) => *x = v.to_dtype(DType::F32)?.to_device(&dev)?,
                        None => candle_core::bail!("came state: too few tensors"),
                    }
                }
            }
            Second::Full(v) => v.load(&mut it, &dev)?,
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        let second = match &self.second {
            Second::Factored(t) => 4 * t.iter().map(Tensor::elem_count).sum::<usize>(),
            Second::Full(v) => v.bytes(),
        };
        self.m.bytes() + second
    }
}
