//! Adafactor for a parameter on a device (CUDA): its state as f32 tensors beside the parameter,
//! updated by transformers' step in candle ops, the parameter written back in its own dtype.
//! The state file is the host state's, so a run resumes on either device.

use candle_core::{DType, Device, Tensor, Var};

use super::adafactor::{factoring, AdafactorParams};
use super::rule::ParamState;

/// Adafactor's state on the parameter's device.
#[derive(Debug)]
pub struct DeviceState {
    hyper: AdafactorParams,
    shape: Vec<usize>,
    /// Row factors (factored) or the full second moment.
    first: Tensor,
    /// Column factors (factored).
    col: Option<Tensor>,
    /// First moment (with β1).
    m: Option<Tensor>,
}

impl DeviceState {
    pub fn zeros(hyper: AdafactorParams, var: &Var) -> candle_core::Result<Self> {
        let shape = var.dims().to_vec();
        let zeros = |s: &[usize]| Tensor::zeros(s, DType::F32, var.device());
        let (first, col) = match factoring(&shape) {
            Some(_) => {
                let n = shape.len();
                let mut col_shape = shape[..n - 2].to_vec();
                col_shape.push(shape[n - 1]);
                (zeros(&shape[..n - 1])?, Some(zeros(&col_shape)?))
            }
            None => (zeros(&shape)?, None),
        };
        let m = match hyper.beta1 {
            Some(_) => Some(zeros(&shape)?),
            None => None,
        };
        Ok(Self {
            hyper,
            shape,
            first,
            col,
            m,
        })
    }

    fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        std::iter::once(&self.first)
            .chain(self.col.as_ref())
            .chain(self.m.as_ref())
    }
}

impl ParamState for DeviceState {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> candle_core::Result<()> {
        let p = var.as_detached_tensor().to_dtype(DType::F32)?;
        let g = grad.detach().to_dtype(DType::F32)?;
        let state = (&self.first, self.col.as_ref(), self.m.as_ref());
        let (p, first, col, m) = tensor_step(&self.hyper, &p, &g, state, lr, t)?;
        var.set(&p.to_dtype(var.dtype())?)?;
        (self.first, self.col, self.m) = (first, col, m);
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let host = |t: &Tensor| t.to_device(&Device::Cpu);
        let mut out = match &self.col {
            Some(col) => vec![
                ("exp_avg_sq_row", host(&self.first)?),
                ("exp_avg_sq_col", host(col)?),
            ],
            None => vec![("exp_avg_sq", host(&self.first)?)],
        };
        if let Some(m) = &self.m {
            out.push(("exp_avg", host(m)?));
        }
        Ok(out)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let dev = self.first.device().clone();
        let expected = self.tensors().count();
        if tensors.len() != expected {
            candle_core::bail!(
                "adafactor state: {} tensors for a parameter of shape {:?}, expected {expected}",
                tensors.len(),
                self.shape
            );
        }
        let mut it = tensors.into_iter();
        let mut next = || -> candle_core::Result<Tensor> {
            match it.next() {
                Some(t) => t.to_dtype(DType::F32)?.to_device(&dev),
                None => candle_core::bail!("adafactor state: too few tensors"),
            }
        };
        let first = next()?;
        let col = match self.col {
            Some(_) => Some(next()?),
            None => None,
        };
        let m = match self.m {
            Some(_) => Some(next()?),
            None => None,
        };
        (self.first, self.col, self.m) = (first, col, m);
        Ok(())
    }

    fn bytes(&self) -> usize {
        4 * self.tensors().map(Tensor::elem_count).sum::<usize>()
    }
}

/// transformers' `Adafactor.step` for one parameter, literally, in candle ops on any device: the
/// device path, and the reference the host kernel is tested against. `p` and `g` are f32;
/// `state` is the second moment (rows, or the full tensor), the column factors when factored,
/// and the first moment with β1. Returns the new parameter and state.
pub(crate) fn tensor_step(
    h: &AdafactorParams,
    p: &Tensor,
    g: &Tensor,
    state: (&Tensor, Option<&Tensor>, Option<&Tensor>),
    lr: f64,
    t: u64,
) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>, Option<Tensor>)> {
    use candle_core::D;
    let rms = |x: &Tensor| -> candle_core::Result<f64> {
        Ok((x.sqr()?.sum_all()?.to_scalar::<f32>()? as f64 / x.elem_count() as f64).sqrt())
    };
    let lr_eff = if h.scale_parameter {
        lr * h.eps.1.max(rms(p)?)
    } else {
        lr
    };
    let beta2t = 1.0 - (t as f64).powf(h.decay_rate);
    let update = (g.sqr()? + h.eps.0)?;
    let (first, second_col, m) = state;
    let (u, s1, s2) = match second_col {
        Some(col) => {
            let row = ((first * beta2t)? + (update.mean(D::Minus1)? * (1.0 - beta2t))?)?;
            let col = ((col * beta2t)? + (update.mean(D::Minus2)? * (1.0 - beta2t))?)?;
            let rf = row
                .broadcast_div(&row.mean_keepdim(D::Minus1)?)?
                .sqrt()?
                .recip()?
                .unsqueeze(D::Minus1)?;
            let cf = col.unsqueeze(D::Minus2)?.sqrt()?.recip()?;
            let u = rf.broadcast_mul(&cf)?.mul(g)?;
            (u, row, Some(col))
        }
        None => {
            let v = ((first * beta2t)? + (update * (1.0 - beta2t))?)?;
            let u = v.sqrt()?.recip()?.mul(g)?;
            (u, v, None)
        }
    };
    let clip = (rms(&u)? / h.clip_threshold).max(1.0);
    let mut u = ((u / clip)? * lr_eff)?;
    let m = match (m, h.beta1) {
        (Some(m), Some(b1)) => {
            let m = ((m * b1)? + (u * (1.0 - b1))?)?;
            u = m.clone();
            Some(m)
        }
        _ => None,
    };
    let mut p = p.clone();
    if h.weight_decay != 0.0 {
        p = (&p + (&p * (-h.weight_decay * lr_eff))?)?;
    }
    Ok(((p - u)?, s1, s2, m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::test_values;
    use crate::optim::{Adafactor, UpdateRule};

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    fn assert_close(what: &str, a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 + 1e-5 * y.abs(), "{what}: {x} vs {y}");
        }
    }

    /// The device state (run here on the CPU) against the host state: the same parameters over 4
    /// steps, the same state file (names, shapes, values), and the host's file loaded into a
    /// device state continues as the host does.
    #[test]
    fn device_state_tracks_host_state_and_shares_its_file() {
        let h = AdafactorParams {
            beta1: Some(0.9),
            scale_parameter: true,
            weight_decay: 0.1,
            ..AdafactorParams::default()
        };
        for h in [AdafactorParams::default(), h] {
            for shape in [vec![6usize, 5], vec![2, 3, 3, 3], vec![7]] {
                let n: usize = shape.iter().product();
                let p0 = Tensor::from_vec(test_values(1, n, 1.0), shape.as_slice(), &Device::Cpu)
                    .unwrap();
                let (host_var, dev_var) = (
                    Var::from_tensor(&p0).unwrap(),
                    Var::from_tensor(&p0.copy().unwrap()).unwrap(),
                );
                let mut host = Adafactor::rule(h).unwrap().init(&host_var).unwrap();
                let mut dev = DeviceState::zeros(h, &dev_var).unwrap();
                let grad = |t: u64| {
                    Tensor::from_vec(test_values(10 + t, n, 0.1), shape.as_slice(), &Device::Cpu)
                        .unwrap()
                };
                for t in 1..=4 {
                    host.update(&host_var, &grad(t), 1e-2, t).unwrap();
                    dev.update(&dev_var, &grad(t), 1e-2, t).unwrap();
                    let what = format!("{shape:?} t={t}");
                    assert_close(&what, &values(&dev_var), &values(&host_var));
                }
                let (hs, ds) = (host.save().unwrap(), dev.save().unwrap());
                assert_eq!(hs.len(), ds.len(), "{shape:?}");
                for ((hn, ht), (dn, dt)) in hs.iter().zip(&ds) {
                    assert_eq!((hn, ht.dims()), (dn, dt.dims()), "{shape:?}");
                    assert_close(&format!("{shape:?} {hn}"), &values(dt), &values(ht));
                }
                let mut resumed = DeviceState::zeros(h, &dev_var).unwrap();
                resumed
                    .load(hs.into_iter().map(|(_, t)| t).collect())
                    .unwrap();
                assert_eq!(resumed.bytes(), host.bytes());
                let resumed_var = Var::from_tensor(&host_var.as_tensor().copy().unwrap()).unwrap();
                host.update(&host_var, &grad(5), 1e-2, 5).unwrap();
                resumed.update(&resumed_var, &grad(5), 1e-2, 5).unwrap();
                assert_close(
                    &format!("{shape:?} resumed"),
                    &values(&resumed_var),
                    &values(&host_var),
                );
                assert!(resumed.load(Vec::new()).is_err());
            }
        }
    }
}
