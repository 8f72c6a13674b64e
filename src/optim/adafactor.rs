//! Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) as transformers' `Adafactor` implements it,
//! with an external learning rate (`relative_step=False`, `warmup_init=False`): the scheduler's
//! lr is used as given, times `max(ε2, RMS(p))` when `scale_parameter` is on.
//!
//! For update `t`, `β2t = 1 − t^decay_rate`, gradient `g`:
//!
//! ```text
//! tensors with ≥ 2 dims, factored over the last two (rows R, columns C):
//!   row ← β2t·row + (1 − β2t)·mean_C(g² + ε1)      col ← β2t·col + (1 − β2t)·mean_R(g² + ε1)
//!   u = g / sqrt(row/mean_R(row) ⊗ col)
//! other tensors:  v ← β2t·v + (1 − β2t)·(g² + ε1);   u = g / sqrt(v)
//! u ← u / max(1, RMS(u)/clip_threshold) · lr_eff
//! with β1:        m ← β1·m + (1 − β1)·u;  u = m
//! p ← p + p·(−λ·lr_eff) − u
//! ```
//!
//! Defaults: ε = (1e-30, 1e-3), clip_threshold 1, decay_rate −0.8, β1 off, scale_parameter off
//! (kohya's recommendation for an external lr). State per parameter: (R + C)·4 bytes per matrix
//! instead of 4·R·C, plus 4 bytes per element with β1.
//!
//! A CPU parameter is updated by a fused host kernel; one on a device (CUDA) keeps its state there
//! and is updated by transformers' step in candle ops ([`super::adafactor_device`]), which is also
//! the reference the host kernel is tested against.

use candle_core::{Tensor, Var};
use rayon::prelude::*;
use serde::Serialize;

use super::adafactor_device::DeviceState;
use super::host;
use super::rule::{ParamState, UpdateRule};
use super::{OptimError, Result};

/// Adafactor's hyper-parameters (the lr is the group's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdafactorParams {
    /// `(ε1, ε2)`: added to g²; the floor of RMS(p) for `scale_parameter`.
    pub eps: (f64, f64),
    pub clip_threshold: f64,
    pub decay_rate: f64,
    /// First-moment decay; `None` keeps no first moment.
    pub beta1: Option<f64>,
    pub weight_decay: f64,
    pub scale_parameter: bool,
}

impl Default for AdafactorParams {
    fn default() -> Self {
        Self {
            eps: (1e-30, 1e-3),
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: false,
        }
    }
}

/// The Adafactor rule.
#[derive(Debug, Clone, Copy)]
pub struct Adafactor {
    hyper: AdafactorParams,
}

impl Adafactor {
    pub fn rule(hyper: AdafactorParams) -> Result<Self> {
        let bad = |field, value, allowed| {
            Err(OptimError::InvalidParam {
                field,
                value,
                allowed,
            })
        };
        if hyper.eps.0 < 0.0 || hyper.eps.1 < 0.0 {
            return bad("eps", hyper.eps.0.min(hyper.eps.1), "must be >= 0");
        }
        if hyper.clip_threshold <= 0.0 {
            return bad("clip_threshold", hyper.clip_threshold, "must be > 0");
        }
        if hyper.decay_rate >= 0.0 {
            return bad("decay_rate", hyper.decay_rate, "must be < 0");
        }
        if let Some(b) = hyper.beta1.filter(|b| !(0.0..1.0).contains(b)) {
            return bad("beta1", b, "must be in [0, 1)");
        }
        if hyper.weight_decay < 0.0 {
            return bad("weight_decay", hyper.weight_decay, "must be >= 0");
        }
        Ok(Self { hyper })
    }
}

/// How a tensor's second moment is stored: `(lead, rows, cols)` when factored.
pub(crate) fn factoring(shape: &[usize]) -> Option<(usize, usize, usize)> {
    match shape {
        [lead @ .., r, c] => Some((lead.iter().product(), *r, *c)),
        _ => None,
    }
}

impl UpdateRule for Adafactor {
    fn name(&self) -> &'static str {
        "adafactor"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        if !var.device().is_cpu() {
            return Ok(Box::new(DeviceState::zeros(self.hyper, var)?));
        }
        let n = var.elem_count();
        let second = match factoring(var.dims()) {
            Some((l, r, c)) => Second::Factored {
                row: vec![0.0; l * r],
                col: vec![0.0; l * c],
            },
            None => Second::Full(vec![0.0; n]),
        };
        Ok(Box::new(State {
            hyper: self.hyper,
            shape: var.dims().to_vec(),
            second,
            m: self.hyper.beta1.map(|_| vec![0.0; n]),
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        let n: usize = shape.iter().product();
        let second = match factoring(shape) {
            Some((l, r, c)) => l * (r + c),
            None => n,
        };
        4 * (second + if self.hyper.beta1.is_some() { n } else { 0 })
    }
}

#[derive(Debug)]
enum Second {
    Factored { row: Vec<f32>, col: Vec<f32> },
    Full(Vec<f32>),
}

#[derive(Debug)]
struct State {
    hyper: AdafactorParams,
    shape: Vec<usize>,
    second: Second,
    m: Option<Vec<f32>>,
}

/// Elements per rayon task at least.
const MIN_TASK: usize = 1 << 14;

fn rms(x: &[f32]) -> f32 {
    let ss: f64 = x.par_iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (ss / x.len().max(1) as f64).sqrt() as f32
}

/// One update on host slices; `shape` is the parameter's.
fn kernel(st: &mut State, p: &mut [f32], g: &[f32], lr: f64, t: u64) {
    let h = st.hyper;
    let beta2t = (1.0 - (t as f64).powf(h.decay_rate)) as f32;
    let eps1 = h.eps.0 as f32;
    let lr_eff = if h.scale_parameter {
        lr as f32 * (h.eps.1 as f32).max(rms(p))
    } else {
        lr as f32
    };
    let pre = update_second(&mut st.second, &st.shape, g, beta2t, eps1);
    let clip = (pre.rms_u(g) / h.clip_threshold as f32).max(1.0);
    apply_update(p, st.m.as_deref_mut(), g, &pre, h, clip, lr_eff);
}

/// Items of `item` elements per rayon task, so a conv's 3×3 matrices are not one task each.
fn per_task(item: usize) -> usize {
    (MIN_TASK / item.max(1)).max(1)
}

/// Moves the second moment to step `t` (`beta2t`) and returns the preconditioner it gives.
fn update_second<'a>(
    second: &'a mut Second,
    shape: &[usize],
    g: &[f32],
    beta2t: f32,
    eps1: f32,
) -> Preconditioner<'a> {
    // The preconditioner as per-row and per-column factors (factored) or per element.
    let (rf, cf, (rows, cols)) = match (&mut *second, factoring(shape)) {
        (Second::Factored { row, col }, Some((_, r, c))) => {
            update_factored(row, col, g, (r, c), beta2t, eps1);
            let (rf, cf) = factors(row, col, r);
            (rf, cf, (r, c))
        }
        (Second::Full(v), _) => {
            v.par_iter_mut().zip(g).for_each(|(v, x)| {
                *v = beta2t * *v + (1.0 - beta2t) * (x * x + eps1);
            });
            (Vec::new(), Vec::new(), (1, 0))
        }
        (Second::Factored { .. }, None) => unreachable!("factored state for a 1-d tensor"),
    };
    Preconditioner {
        second,
        rf,
        cf,
        rows,
        cols,
        width: if cols == 0 { 1 << 14 } else { cols },
    }
}

/// Moves the row and column means of `g² + ε1` (matrices of `r × c`) into `row` and `col`.
fn update_factored(
    row: &mut [f32],
    col: &mut [f32],
    g: &[f32],
    (r, c): (usize, usize),
    beta2t: f32,
    eps1: f32,
) {
    // Row means over each row's C entries; column means over each matrix's R rows.
    row.par_iter_mut()
        .zip(g.par_chunks(c))
        .with_min_len(per_task(c))
        .for_each(|(row, gr)| {
            let mean = gr.iter().map(|x| x * x + eps1).sum::<f32>() / c as f32;
            *row = beta2t * *row + (1.0 - beta2t) * mean;
        });
    col.par_chunks_mut(c)
        .zip(g.par_chunks(r * c))
        .with_min_len(per_task(r * c))
        .for_each(|(col, gm)| {
            let mut small = [0f32; 16];
            let mut large = Vec::new();
            let sums: &mut [f32] = if c <= small.len() {
                &mut small[..c]
            } else {
                large.resize(c, 0f32);
                &mut large
            };
            for gr in gm.chunks(c) {
                for (s, x) in sums.iter_mut().zip(gr) {
                    *s += x * x + eps1;
                }
            }
            for (cv, s) in col.iter_mut().zip(sums.iter()) {
                *cv = beta2t * *cv + (1.0 - beta2t) * (s / r as f32);
            }
        });
}

/// The row factors `1/sqrt(row/mean_R(row))` (`r` rows a matrix) and column factors `1/sqrt(col)`.
fn factors(row: &[f32], col: &[f32], r: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rf = row.to_vec();
    rf.par_chunks_mut(r)
        .with_min_len(per_task(r))
        .for_each(|rows| {
            let mean = rows.iter().sum::<f32>() / r as f32;
            rows.iter_mut()
                .for_each(|x| *x = (*x / mean).sqrt().recip());
        });
    let cf: Vec<f32> = col.par_iter().map(|x| x.sqrt().recip()).collect();
    (rf, cf)
}

/// The step's preconditioner for one row of C (factored) or one chunk (not): u = pre ∘ g, computed
/// again in each pass instead of held in a full-size buffer.
struct Preconditioner<'a> {
    second: &'a Second,
    /// Per-row and per-column factors (factored; empty otherwise).
    rf: Vec<f32>,
    cf: Vec<f32>,
    /// Rows (R) and columns (C) of each matrix; `(1, 0)` when not factored.
    rows: usize,
    cols: usize,
    /// Elements per row (factored: C) or chunk.
    width: usize,
}

impl Preconditioner<'_> {
    /// `u` for element `j` of row (or chunk) `row`, whose gradient is `x`.
    fn at(&self, row: usize, j: usize, x: f32) -> f32 {
        match self.second {
            Second::Factored { .. } => {
                self.rf[row] * self.cf[(row / self.rows) * self.cols + j] * x
            }
            Second::Full(v) => v[row * self.width + j].sqrt().recip() * x,
        }
    }

    /// Rows (or chunks) per rayon task at least.
    fn min_rows(&self) -> usize {
        (MIN_TASK / self.width).max(1)
    }

    /// RMS(u) over the whole gradient `g`.
    fn rms_u(&self, g: &[f32]) -> f32 {
        let ss: f64 = g
            .par_chunks(self.width)
            .with_min_len(self.min_rows())
            .enumerate()
            .map(|(row, gr)| {
                gr.iter()
                    .enumerate()
                    .map(|(j, &x)| f64::from(self.at(row, j, x)).powi(2))
                    .sum::<f64>()
            })
            .sum();
        (ss / g.len().max(1) as f64).sqrt() as f32
    }
}

/// `p ← p + p·(−λ·lr_eff) − u` for `u = pre ∘ g / clip · lr_eff` (through `m` when β1 is on).
fn apply_update(
    p: &mut [f32],
    m: Option<&mut [f32]>,
    g: &[f32],
    pre: &Preconditioner,
    h: AdafactorParams,
    clip: f32,
    lr_eff: f32,
) {
    let wd = (-h.weight_decay * f64::from(lr_eff)) as f32;
    let apply = |p: &mut f32, u: f32| {
        if h.weight_decay != 0.0 {
            *p += *p * wd;
        }
        *p -= u;
    };
    let (width, min_rows) = (pre.width, pre.min_rows());
    match (m, h.beta1) {
        (Some(m), Some(b1)) => {
            let b1 = b1 as f32;
            p.par_chunks_mut(width)
                .zip(m.par_chunks_mut(width))
                .zip(g.par_chunks(width))
                .with_min_len(min_rows)
                .enumerate()
                .for_each(|(row, ((p, m), g))| {
                    for (j, ((p, m), &x)) in p.iter_mut().zip(m).zip(g).enumerate() {
                        let u = pre.at(row, j, x) / clip * lr_eff;
                        *m = *m * b1 + (1.0 - b1) * u;
                        apply(p, *m);
                    }
                });
        }
        _ => p
            .par_chunks_mut(width)
            .zip(g.par_chunks(width))
            .with_min_len(min_rows)
            .enumerate()
            .for_each(|(row, (p, g))| {
                for (j, (p, &x)) in p.iter_mut().zip(g).enumerate() {
                    apply(p, pre.at(row, j, x) / clip * lr_eff);
                }
            }),
    }
}

impl ParamState for State {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> candle_core::Result<()> {
        host::update_in_place(var, grad, |p, g| kernel(self, p, g, lr, t))
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let mut out = match (&self.second, factoring(&self.shape)) {
            (Second::Factored { row, col }, Some(_)) => {
                let n = self.shape.len();
                let mut col_shape = self.shape[..n - 2].to_vec();
                col_shape.push(self.shape[n - 1]);
                vec![
                    (
                        "exp_avg_sq_row",
                        host::tensor_f32(row, &self.shape[..n - 1])?,
                    ),
                    ("exp_avg_sq_col", host::tensor_f32(col, &col_shape)?),
                ]
            }
            (Second::Full(v), _) => vec![("exp_avg_sq", host::tensor_f32(v, &self.shape)?)],
            (Second::Factored { .. }, None) => unreachable!("factored state for a 1-d tensor"),
        };
        if let Some(m) = &self.m {
            out.push(("exp_avg", host::tensor_f32(m, &self.shape)?));
        }
        Ok(out)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let mut it = tensors.into_iter();
        let mut next = || {
            it.next()
                .ok_or_else(|| candle_core::Error::Msg("adafactor state: too few tensors".into()))
        };
        self.second = match self.second {
            Second::Factored { .. } => Second::Factored {
                row: host::host_f32(&next()?)?,
                col: host::host_f32(&next()?)?,
            },
            Second::Full(_) => Second::Full(host::host_f32(&next()?)?),
        };
        if self.m.is_some() {
            self.m = Some(host::host_f32(&next()?)?);
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        let second = match &self.second {
            Second::Factored { row, col } => row.len() + col.len(),
            Second::Full(v) => v.len(),
        };
        4 * (second + self.m.as_ref().map_or(0, Vec::len))
    }
}

#[cfg(test)]
mod tests {
    use super::super::adafactor_device::tensor_step;
    use super::*;
    use crate::optim::test_values;
    use candle_core::Device;

    /// The host kernel against transformers' step in candle ops, over a matrix, a conv weight
    /// (factored over its kernel dims) and a vector, 4 steps, with and without β1, scaling and
    /// decay.
    #[test]
    fn kernel_matches_reference() {
        let settings = [
            AdafactorParams::default(),
            AdafactorParams {
                beta1: Some(0.9),
                scale_parameter: true,
                weight_decay: 0.1,
                clip_threshold: 0.5,
                ..AdafactorParams::default()
            },
        ];
        for h in settings {
            for shape in [vec![6usize, 5], vec![2, 3, 3, 3], vec![7]] {
                let n: usize = shape.iter().product();
                let p0 = Tensor::from_vec(test_values(1, n, 1.0), shape.as_slice(), &Device::Cpu)
                    .unwrap();
                let var = Var::from_tensor(&p0).unwrap();
                let rule = Adafactor::rule(h).unwrap();
                let mut st = rule.init(&var).unwrap();
                let mut p_ref = p0.clone();
                let factored = shape.len() >= 2;
                let lead = &shape[..shape.len().saturating_sub(1)];
                let mut s1 = Tensor::zeros(
                    if factored { lead } else { &shape[..] },
                    candle_core::DType::F32,
                    &Device::Cpu,
                )
                .unwrap();
                let mut s2 = factored.then(|| {
                    let mut c = shape[..shape.len() - 2].to_vec();
                    c.push(shape[shape.len() - 1]);
                    Tensor::zeros(c, candle_core::DType::F32, &Device::Cpu).unwrap()
                });
                let mut m = h.beta1.map(|_| {
                    Tensor::zeros(shape.as_slice(), candle_core::DType::F32, &Device::Cpu).unwrap()
                });
                for t in 1..=4u64 {
                    let g = Tensor::from_vec(
                        test_values(10 + t, n, 0.1),
                        shape.as_slice(),
                        &Device::Cpu,
                    )
                    .unwrap();
                    st.update(&var, &g, 1e-2, t).unwrap();
                    let (p, a, b, mm) =
                        tensor_step(&h, &p_ref, &g, (&s1, s2.as_ref(), m.as_ref()), 1e-2, t)
                            .unwrap();
                    (p_ref, s1, s2, m) = (p, a, b, mm);
                    let got = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let want = p_ref.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for (x, y) in got.iter().zip(&want) {
                        assert!(
                            (x - y).abs() <= 1e-6 + 1e-5 * y.abs(),
                            "{shape:?} t={t}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}
