//! AdamW with torch.optim.AdamW semantics (amsgrad = false, maximize = false).
//!
//! Decoupled weight decay, Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
//! arXiv 1711.05101, in torch's form. For each parameter `p` with gradient `g`, at its own step
//! count `t` (incremented only on steps where `p` has a gradient, as torch's per-parameter
//! `state["step"]`):
//!
//! ```text
//! p  ← p · (1 − lr·λ)
//! m  ← m + (1 − β1)·(g − m)            (torch: exp_avg.lerp_(g, 1 − β1))
//! v  ← β2·v + (1 − β2)·g²
//! p  ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)
//! ```
//!
//! The moments `m`, `v` are f32 whatever the parameter dtype. A bf16/f16 parameter is upcast,
//! updated in f32, and rounded back once per step (there is no f32 master copy: an update smaller
//! than half a bf16 ulp of `p` is lost, as with torch on a bf16 parameter with f32 state).
//!
//! An f32 CPU parameter is updated by one fused pass in its own storage (`adamw_kernel`); a CUDA
//! parameter (f32, bf16 or f16) by the same pass as a CUDA kernel (`adamw_f32_*` in kernels.cu),
//! its moments in device memory; any other keeps its moments on its device and is updated with
//! candle ops (`adamw_reference`, which the kernels are tested against).

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::group::GroupOptimizer;
use super::host;
use super::rule::{ParamState, UpdateRule};
use super::{OptimError, Result};

const NAME: &str = "adamw";
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";

/// AdamW hyper-parameters. `Default` is torch's: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight_decay 1e-2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWParams {
    /// The ranges torch.optim.AdamW accepts.
    pub fn validate(&self) -> Result<()> {
        let check = |field, value: f64, ok: bool, allowed| {
            if ok {
                Ok(())
            } else {
                Err(OptimError::InvalidParam {
                    field,
                    value,
                    allowed,
                })
            }
        };
        check("lr", self.lr, self.lr >= 0.0, "must be >= 0")?;
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        check(
            "beta1",
            self.beta1,
            beta_ok(self.beta1),
            "must be in [0, 1)",
        )?;
        check(
            "beta2",
            self.beta2,
            beta_ok(self.beta2),
            "must be in [0, 1)",
        )?;
        check("eps", self.eps, self.eps >= 0.0, "must be >= 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "must be >= 0",
        )
    }
}

/// The AdamW rule (see the module docs). Construct a group with [`AdamW::group`].
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    hyper: AdamWParams,
}

impl AdamW {
    /// An AdamW optimizer over `params` at `hyper.lr`. Names must be unique: they key the saved
    /// state.
    pub fn group(params: Vec<(String, Var)>, hyper: AdamWParams) -> Result<GroupOptimizer> {
        GroupOptimizer::new(Box::new(Self::rule(hyper)?), params, hyper.lr)
    }

    /// The rule alone, for [`GroupOptimizer::new`]; `hyper.lr` is the group's business.
    pub fn rule(hyper: AdamWParams) -> Result<Self> {
        hyper.validate()?;
        Ok(Self { hyper })
    }
}

impl UpdateRule for AdamW {
    fn name(&self) -> &'static str {
        NAME
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = var.device() {
            let zeros = super::quant8::Moment::F32(vec![0.0; var.elem_count()]);
            return Ok(Box::new(AdamWState {
                hyper: self.hyper,
                shape: var.dims().to_vec(),
                moments: Moments::Cuda {
                    m: Box::new(super::cuda::CudaMoment::upload(&zeros, dev)?),
                    v: Box::new(super::cuda::CudaMoment::upload(&zeros, dev)?),
                },
            }));
        }
        let moments = if host_kernel(var) {
            Moments::Host {
                m: vec![0.0; var.elem_count()],
                v: vec![0.0; var.elem_count()],
            }
        } else {
            let zeros = Tensor::zeros(var.shape(), DType::F32, var.device())?;
            Moments::Device {
                m: zeros.clone(),
                v: zeros,
            }
        };
        Ok(Box::new(AdamWState {
            hyper: self.hyper,
            shape: var.dims().to_vec(),
            moments,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        2 * 4 * shape.iter().product::<usize>()
    }
}

/// Whether a parameter is updated by the host kernel in its own storage (a contiguous f32 CPU
/// Var); otherwise the moments stay on its device and the update is candle ops.
fn host_kernel(var: &Var) -> bool {
    var.device().is_cpu() && var.dtype() == DType::F32
}

/// The f32 moments: on the host for the host kernel, in CUDA memory for the CUDA kernel, or as
/// tensors on the parameter's device for candle ops.
#[derive(Debug)]
enum Moments {
    Host {
        m: Vec<f32>,
        v: Vec<f32>,
    },
    #[cfg(feature = "cuda")]
    Cuda {
        m: Box<super::cuda::CudaMoment>,
        v: Box<super::cuda::CudaMoment>,
    },
    Device {
        m: Tensor,
        v: Tensor,
    },
}

#[derive(Debug)]
struct AdamWState {
    hyper: AdamWParams,
    shape: Vec<usize>,
    moments: Moments,
}

/// The bias-corrected step's scalars for update `t`, in f64 on the host as torch computes them
/// from a Python float step (`beta ** step` is C `pow`, hence powf and not powi).
struct StepScalars {
    step_size: f64,
    bc2_sqrt: f64,
    decay: f64,
}

impl StepScalars {
    fn new(h: &AdamWParams, lr: f64, t: u64) -> Self {
        Self {
            step_size: lr / (1.0 - h.beta1.powf(t as f64)),
            bc2_sqrt: (1.0 - h.beta2.powf(t as f64)).sqrt(),
            decay: 1.0 - lr * h.weight_decay,
        }
    }

    /// The f32 scalars of the fused kernels (host and kernels.cu's `adamw_f32_*`), in the CUDA
    /// entry point's argument order: `1 − β1`, `1 − β2`, `β2` (rounded from f64, as torch passes
    /// them as Python floats), the step size, `sqrt(1 − β2^t)`, `ε` and the decay factor.
    fn device_args(&self, h: &AdamWParams) -> [f32; 7] {
        [
            (1.0 - h.beta1) as f32,
            (1.0 - h.beta2) as f32,
            h.beta2 as f32,
            self.step_size as f32,
            self.bc2_sqrt as f32,
            h.eps as f32,
            self.decay as f32,
        ]
    }
}

impl ParamState for AdamWState {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> candle_core::Result<()> {
        let h = self.hyper;
        let k = StepScalars::new(&h, lr, t);
        match &mut self.moments {
            Moments::Host { m, v } => {
                let args = k.device_args(&h);
                super::host::update_in_place(var, grad, |p, g| adamw_kernel(p, g, m, v, &args))
            }
            #[cfg(feature = "cuda")]
            Moments::Cuda { m, v } => {
                super::cuda::update(var, grad, NAME, &mut [m, v], &k.device_args(&h))
            }
            Moments::Device { m, v } => {
                let (m2, v2) = adamw_reference(var, grad, m, v, &h, &k)?;
                *m = m2;
                *v = v2;
                Ok(())
            }
        }
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(match &self.moments {
            Moments::Host { m, v } => vec![
                (EXP_AVG, host::tensor_f32(m, &self.shape)?),
                (EXP_AVG_SQ, host::tensor_f32(v, &self.shape)?),
            ],
            #[cfg(feature = "cuda")]
            Moments::Cuda { m, v } => {
                let mut out = m.download()?.save((EXP_AVG, ""), &self.shape)?;
                out.extend(v.download()?.save((EXP_AVG_SQ, ""), &self.shape)?);
                out
            }
            Moments::Device { m, v } => vec![(EXP_AVG, m.clone()), (EXP_AVG_SQ, v.clone())],
        })
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [m, v] = <[Tensor; 2]>::try_from(tensors)
            .map_err(|_| candle_core::Error::Msg("adamw state: expected 2 tensors".into()))?;
        self.moments = match &self.moments {
            Moments::Host { .. } => Moments::Host {
                m: host::host_f32(&m)?,
                v: host::host_f32(&v)?,
            },
            #[cfg(feature = "cuda")]
            Moments::Cuda { m: old, .. } => {
                let dev = old.device().clone();
                let upload = |t: &Tensor| -> candle_core::Result<_> {
                    let host = super::quant8::Moment::F32(host::host_f32(t)?);
                    Ok(Box::new(super::cuda::CudaMoment::upload(&host, &dev)?))
                };
                Moments::Cuda {
                    m: upload(&m)?,
                    v: upload(&v)?,
                }
            }
            Moments::Device { m: old, .. } => Moments::Device {
                m: m.to_device(old.device())?,
                v: v.to_device(old.device())?,
            },
        };
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * 4 * self.shape.iter().product::<usize>()
    }
}

/// The fused host kernel: one pass over each chunk of `p`, `g`, `m`, `v`, in place.
fn adamw_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], args: &[f32; 7]) {
    use rayon::prelude::*;
    let [w1, w2, b2, step_size, bc2_sqrt, eps, decay] = *args;
    const CHUNK: usize = 1 << 14;
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let gi = g[i];
                // torch: exp_avg.lerp_(g, 1 − β1); exp_avg_sq.mul_(β2).addcmul_(g, g, 1 − β2)
                m[i] += w1 * (gi - m[i]);
                v[i] = v[i] * b2 + w2 * gi * gi;
                let denom = v[i].sqrt() / bc2_sqrt + eps;
                p[i] = p[i] * decay - step_size * (m[i] / denom);
            }
        });
}

/// The same update as candle ops on the parameter's device: the reference the kernel is tested
/// against, and the path for parameters the kernel does not take. Returns the new moments; the
/// parameter is written only after every fallible op.
fn adamw_reference(
    var: &Var,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &AdamWParams,
    k: &StepScalars,
) -> candle_core::Result<(Tensor, Tensor)> {
    // A Var's gradient from candle's backward still tracks the ops that made it: keeping it in
    // the moments would chain every step's forward graph into the state.
    let g = grad.detach().to_dtype(DType::F32)?;
    let m = (m + ((&g - m)? * (1.0 - h.beta1))?)?;
    let v = ((v * h.beta2)? + (g.sqr()? * (1.0 - h.beta2))?)?;
    let denom = ((v.sqrt()? / k.bc2_sqrt)? + h.eps)?;
    let p = var.as_detached_tensor().to_dtype(DType::F32)?;
    let p = ((p * k.decay)? - ((&m / &denom)? * k.step_size)?)?;
    var.set(&p.to_dtype(var.dtype())?)?;
    Ok((m, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::quant8::Moment;
    use crate::optim::{kernel_emu, test_values};
    use crate::optim::{OptimError, Optimizer};

    /// kernels.cu's `adamw_f32_*` under the host emulation against the host kernel, 5 steps, on
    /// the launch grid and on a grid of 2 blocks (the grid-stride loop going round): bit for bit.
    #[test]
    fn cuda_kernel_under_emulation_matches_host_kernel() {
        let h = AdamWParams {
            weight_decay: 0.05,
            ..AdamWParams::default()
        };
        let n = 1500;
        for grid in [None, Some(2)] {
            let (mut pa, mut pb) = (test_values(5, n, 1.0), test_values(5, n, 1.0));
            let (mut ma, mut va) = (vec![0f32; n], vec![0f32; n]);
            let (mut mb, mut vb) = (Moment::F32(ma.clone()), Moment::F32(va.clone()));
            for t in 1..=5 {
                let g = test_values(300 + t, n, 0.01);
                let args = StepScalars::new(&h, 2e-3, t).device_args(&h);
                adamw_kernel(&mut pa, &g, &mut ma, &mut va, &args);
                kernel_emu::run_moments(
                    NAME,
                    &mut pb,
                    &g,
                    &mut [&mut mb, &mut vb],
                    &[],
                    &args,
                    grid,
                );
                let (ha, hv) = (Moment::F32(ma.clone()), Moment::F32(va.clone()));
                let gap = kernel_emu::gap(&pa, &pb, &[&ha, &hv], &[&mb, &vb]);
                assert_eq!(
                    (gap.param, gap.state),
                    (0.0, 0.0),
                    "grid {grid:?} t={t}: {gap:?}"
                );
            }
        }
    }

    /// kernels.cu's `adamw_f32_bf16`/`_f16` (bf16 and f16 trained weights, `weight_dtype` with
    /// nearest rounding) against `adamw_f32_f32` under the emulation: each update is the f32
    /// update rounded to nearest even, with the same state. Catches a store that truncates, a
    /// load that misreads the dtype, and an entry point of the wrong rule.
    #[test]
    fn bf16_and_f16_entry_points_round_the_f32_update() {
        let h = AdamWParams {
            weight_decay: 0.05,
            ..AdamWParams::default()
        };
        let n = 1500;
        kernel_emu::assert_low_precision_tracks_f32(
            NAME,
            n,
            &[Moment::F32(vec![0.0; n]), Moment::F32(vec![0.0; n])],
            &[],
            |t| test_values(300 + t, n, 0.01),
            |t| StepScalars::new(&h, 1e-2, t).device_args(&h).to_vec(),
            4,
        );
    }
    use candle_core::backprop::GradStore;
    use candle_core::Device;

    fn var(vals: &[f32]) -> Var {
        Var::from_slice(vals, vals.len(), &Device::Cpu).unwrap()
    }

    #[test]
    fn rejects_out_of_range_hyperparams_naming_the_field() {
        let bad = AdamWParams {
            beta2: 1.0,
            ..AdamWParams::default()
        };
        let err = AdamW::group(vec![], bad).unwrap_err();
        assert!(err.to_string().contains("beta2"), "{err}");
    }

    #[test]
    fn rejects_duplicate_names() {
        let p = vec![
            ("a".to_string(), var(&[1.0])),
            ("a".to_string(), var(&[2.0])),
        ];
        let err = AdamW::group(p, AdamWParams::default()).unwrap_err();
        assert!(
            matches!(err, OptimError::DuplicateParam(ref n) if n == "a"),
            "{err}"
        );
    }

    /// First step from zero state: m̂ = g, v̂ = g², so p ← p(1 − lr·λ) − lr·g/(|g| + ε).
    #[test]
    fn first_step_matches_closed_form() {
        let w = var(&[0.5, -1.0]);
        let mut opt = AdamW::group(vec![("w".into(), w.clone())], AdamWParams::default()).unwrap();
        let mut g = GradStore::default();
        g.insert(&w, Tensor::new(&[2.0f32, -0.25], &Device::Cpu).unwrap());
        let stats = opt.step(&g).unwrap();
        assert!(!stats.skipped_nonfinite);
        assert_eq!(stats.updated, 1);
        let got = w.to_vec1::<f32>().unwrap();
        let want = [
            0.5 * (1.0 - 1e-5) - 1e-3 * 2.0 / (2.0 + 1e-8),
            -(1.0 - 1e-5) + 1e-3 * 0.25 / (0.25 + 1e-8),
        ];
        for (a, b) in got.iter().zip(want) {
            assert!((f64::from(*a) - b).abs() < 1e-7, "{a} vs {b}");
        }
        assert_eq!(opt.state("w").unwrap().step(), 1);
    }

    #[test]
    fn step_checked_updates_exactly_as_step() {
        let (a, b) = (var(&[0.5, -1.0]), var(&[0.5, -1.0]));
        let mut plain =
            AdamW::group(vec![("w".into(), a.clone())], AdamWParams::default()).unwrap();
        let mut checked =
            AdamW::group(vec![("w".into(), b.clone())], AdamWParams::default()).unwrap();
        for k in 0..3 {
            let grad = |v: &Var| {
                let mut g = GradStore::default();
                let t = Tensor::new(&[2.0f32 - k as f32, 0.25 * k as f32], &Device::Cpu).unwrap();
                g.insert(v, t);
                g
            };
            plain.step(&grad(&a)).unwrap();
            let (ga, loss) = (grad(&b), Tensor::new(1f32, &Device::Cpu).unwrap());
            let g: Vec<&Tensor> = ga.get(&b).into_iter().collect();
            let finite = crate::optim::StepCheck::fetch(&loss, &g)
                .unwrap()
                .finite()
                .unwrap();
            let stats = checked.step_checked(&ga, finite).unwrap();
            assert_eq!(stats.updated, 1);
        }
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        assert_eq!(checked.state("w").unwrap().step(), 3);
    }

    #[test]
    fn param_without_grad_is_untouched_and_its_step_does_not_advance() {
        let a = var(&[1.0]);
        let b = var(&[1.0]);
        let mut opt = AdamW::group(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            AdamWParams::default(),
        )
        .unwrap();
        let mut g = GradStore::default();
        g.insert(&a, Tensor::new(&[1.0f32], &Device::Cpu).unwrap());
        let stats = opt.step(&g).unwrap();
        assert_eq!((stats.updated, stats.no_grad), (1, 1));
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![1.0]);
        assert_eq!(opt.state("a").unwrap().step(), 1);
        assert_eq!(opt.state("b").unwrap().step(), 0);
    }

    #[test]
    fn grad_with_wrong_shape_is_an_error_naming_the_param() {
        let a = var(&[1.0, 2.0]);
        let mut opt = AdamW::group(vec![("a".into(), a.clone())], AdamWParams::default()).unwrap();
        let mut g = GradStore::default();
        g.insert(&a, Tensor::new(&[1.0f32], &Device::Cpu).unwrap());
        let err = opt.step(&g).unwrap_err();
        assert!(err.to_string().contains("a has shape [1]"), "{err}");
    }
}
