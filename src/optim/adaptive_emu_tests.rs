#![cfg(test)]
//! src/optim/adaptive.cu under the host emulation ([`crate::kernel_emu`]) against the CPU path of
//! every rule it serves (and schedule-free AdamW's evaluation weights), launched from [`super::adaptive_args`] as the CUDA path launches it.
//!
//! Both paths start from the same parameter and take the same gradients, and every pass of both
//! gets the same scalars (those of the CPU path's own estimate). Each pass must then leave the
//! parameter and every state buffer bit for bit as the CPU path does, and each first pass's
//! shares must agree to 1e-5 relative (f32 sums in another order). The CPU path is itself
//! checked against the PyPI references (tests/adaptive_optim_parity.rs), so a wrong scalar, a
//! dropped term or a buffer out of order here fails on the first step.

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;

use super::adaptive_args::{
    block_totals, AdaCoorKernel, AdaptiveKernel, BufKind, CoordinateDowgKernel, DAdaptAdamKernel,
    DAdaptAdanKernel, DAdaptLionKernel, DAdaptSgdKernel, Launch, ProdigyKernel, ScalarDowgKernel,
    ScheduleFreeKernel,
};
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::{
    AdaCoor, AdaCoorParams, AdamWScheduleFree, CoordinateDowg, DAdaptAdam, DAdaptAdamParams,
    DAdaptAdan, DAdaptAdanParams, DAdaptLion, DAdaptLionParams, DAdaptSgd, DAdaptSgdParams,
    DowgParams, Prodigy, ProdigyParams, ScalarDowg, ScheduleFreeParams,
};
use crate::kernel_emu::{self, Arg};

/// The tests' result: a rule that refuses its hyperparameters fails the test with its error.
type TestResult = Result<(), Box<dyn std::error::Error>>;

const SOURCE: &str = "src/optim/adaptive.cu";

/// Deterministic values in about ±scale, a few of them 100 times larger.
fn values(seed: usize, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let x = (((j * 37 + seed * 101) % 211) as f32 - 105.0) / 105.0;
            x * scale
                * if (j + seed).is_multiple_of(53) {
                    100.0
                } else {
                    1.0
                }
        })
        .collect()
}

/// One state buffer on the host.
enum HostBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl HostBuf {
    fn as_f32(&self) -> Vec<f32> {
        match self {
            Self::F32(v) => v.clone(),
            Self::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// The kernel's side: parameter and state on the host, stepped by emulated launches.
struct Emulated {
    p: Vec<f32>,
    bufs: Vec<HostBuf>,
    grid: Option<u32>,
}

impl Emulated {
    fn new(kernel: &dyn AdaptiveKernel, p: Vec<f32>, grid: Option<u32>) -> Self {
        let n = p.len();
        let bufs = kernel
            .buffers()
            .iter()
            .map(|b| match b.kind {
                BufKind::F32 => HostBuf::F32(vec![b.fill; n]),
                BufKind::Bf16 => HostBuf::Bf16(vec![bf16::from_f32(b.fill); n]),
            })
            .collect();
        Self { p, bufs, grid }
    }

    /// Runs `launch` with gradient `g`: the sums, added over the blocks in f64.
    fn run(&mut self, launch: &Launch, g: &[f32]) -> Vec<f64> {
        let n = self.p.len();
        let grid = self.grid.unwrap_or_else(|| super::launch::grid(n, false));
        let mut sums = vec![0f32; grid as usize * launch.sums];
        let mut args = vec![Arg::out(&mut self.p), Arg::input(g)];
        for b in self.bufs.iter_mut() {
            args.push(match b {
                HostBuf::F32(v) => Arg::out(v),
                HostBuf::Bf16(v) => Arg::out(v),
            });
        }
        if launch.sums > 0 {
            args.push(Arg::out(&mut sums));
        }
        args.extend(launch.scalars.iter().map(|&s| Arg::F32(s)));
        args.push(Arg::Int(n as i64));
        kernel_emu::launch(
            SOURCE,
            &format!("{}_f32", launch.entry),
            [grid, 1, 1],
            [super::launch::THREADS, 1, 1],
            &mut args,
        );
        block_totals(&sums, launch.sums)
    }
}

fn host(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// The parameter and every state buffer equal, bit for bit, by name.
fn assert_same(
    what: &str,
    var: &Var,
    state: &dyn ParamState,
    kernel: &dyn AdaptiveKernel,
    emu: &Emulated,
) -> candle_core::Result<()> {
    let p = host(var.as_tensor())?;
    let worst = p
        .iter()
        .zip(&emu.p)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let differ = p
        .iter()
        .zip(&emu.p)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differ, 0,
        "{what}: parameter: {differ} differ, worst {worst:e}"
    );
    let saved = state.save()?;
    let buffers = kernel.buffers();
    let names: Vec<_> = saved.iter().map(|(n, _)| *n).collect();
    let kernel_names: Vec<_> = buffers.iter().map(|b| b.name).collect();
    assert_eq!(names, kernel_names, "{what}: state buffers");
    for ((name, t), b) in saved.iter().zip(&emu.bufs) {
        let want = match b {
            HostBuf::F32(_) => DType::F32,
            HostBuf::Bf16(_) => DType::BF16,
        };
        assert_eq!(t.dtype(), want, "{what}: {name} dtype");
        let (a, b) = (host(t)?, b.as_f32());
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: {name}: {differ} of {} differ", a.len());
    }
    Ok(())
}

fn assert_shares(what: &str, cpu: &Shares, emu: &Shares) {
    for (a, b) in cpu.iter().zip(emu) {
        let scale = a.abs().max(b.abs()).max(1e-30);
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "{what}: shares {cpu:?} on the CPU, {emu:?} emulated"
        );
    }
}

/// `steps` steps of `rule` on a parameter of `n` elements, the CPU path against the emulated
/// kernels, at learning rates `lrs` (cycled).
fn check(
    what: &str,
    rule: &dyn UpdateRule,
    kernel: &dyn AdaptiveKernel,
    n: usize,
    grid: Option<u32>,
    lrs: &[f64],
    steps: usize,
) -> candle_core::Result<()> {
    let init = values(1, n, 1.0);
    let var = Var::from_slice(&init, n, &Device::Cpu)?;
    let mut state = rule.init(&var)?;
    let mut emu = Emulated::new(kernel, init, grid);
    let mut estimate = rule.estimate();
    let mut done = 0u64;
    for k in 0..steps {
        let what = format!("{what}, grid {grid:?}, step {k}");
        let gv = values(10 + k, n, 1e-2);
        let g = Tensor::from_slice(&gv, n, &Device::Cpu)?;
        let lr = lrs[k % lrs.len()];
        match estimate.as_mut() {
            None => {
                let t = k as u64 + 1;
                state.update(&var, &g, lr, t)?;
                let Some(launch) = kernel.update(lr, t) else {
                    candle_core::bail!("{what}: a one-pass rule has no update launch");
                };
                emu.run(&launch, &gv);
            }
            Some(estimate) => {
                let grad_sq = estimate
                    .needs_grad_sq()
                    .then(|| gv.iter().map(|x| f64::from(*x) * f64::from(*x)).sum());
                let first = estimate.begin(lr, grad_sq);
                two_pass(
                    &what,
                    (&var, &mut *state),
                    &mut emu,
                    kernel,
                    estimate.as_mut(),
                    &first,
                    (&g, &gv),
                    &mut done,
                )?;
            }
        }
        assert_same(&what, &var, state.as_ref(), kernel, &emu)?;
    }
    // The evaluation weights (schedule-free's x), where a rule has them.
    if let Some(launch) = kernel.eval() {
        state.eval_weights(&var)?;
        emu.run(&launch, &vec![0.0; n]);
        assert_same(
            &format!("{what}, eval weights"),
            &var,
            state.as_ref(),
            kernel,
            &emu,
        )?;
    }
    Ok(())
}

/// One step of a two-pass rule on both paths, with the CPU path's scalars.
#[allow(clippy::too_many_arguments)]
fn two_pass(
    what: &str,
    (var, state): (&Var, &mut dyn ParamState),
    emu: &mut Emulated,
    kernel: &dyn AdaptiveKernel,
    estimate: &mut dyn StepEstimate,
    first: &StepScalars,
    (g, gv): (&Tensor, &[f32]),
    done: &mut u64,
) -> candle_core::Result<()> {
    let mut cpu = [0.0; 3];
    state.accumulate(var, g, first, *done, &mut cpu)?;
    let mut mine = [0.0; 3];
    if let Some(launch) = kernel.accumulate(first, *done) {
        let sums = emu.run(&launch, gv);
        mine = kernel.shares(first, &sums);
    }
    assert_shares(what, &cpu, &mine);
    assert_same(&format!("{what}, first pass"), var, state, kernel, emu)?;
    let Some(second) = estimate.finish(&cpu) else {
        return Ok(());
    };
    state.apply(var, g, &second)?;
    if let Some(launch) = kernel.apply(&second) {
        emu.run(&launch, gv);
    }
    *done += 1;
    Ok(())
}

/// 1,000 elements: four blocks at the launch's own grid, and grid 2 makes the loops go round.
fn each_grid(what: &str, rule: &dyn UpdateRule, kernel: &dyn AdaptiveKernel, lrs: &[f64]) {
    for grid in [None, Some(2)] {
        if let Err(e) = check(what, rule, kernel, 1000, grid, lrs, 6) {
            panic!("{what}, grid {grid:?}: {e}");
        }
    }
}

#[test]
fn prodigy_kernels_match_the_cpu_path() -> TestResult {
    let ed2 = ProdigyParams {
        weight_decay: 0.1,
        use_bias_correction: true,
        safeguard_warmup: true,
        growth_rate: 1.5,
        ..ProdigyParams::default()
    };
    let no_m = ProdigyParams {
        beta1: 0.0,
        weight_decay: 0.05,
        decouple: false,
        d0: 1e-4,
        ..ProdigyParams::default()
    };
    for (what, h) in [("prodigy", ed2), ("prodigy β1=0, coupled", no_m)] {
        let rule = Prodigy::rule(h)?;
        // lr 0 first, as the first step of a warmup: only the starting point is taken.
        each_grid(what, &rule, &ProdigyKernel(h), &[0.0, 1.0, 1.0, 0.5]);
    }
    Ok(())
}

#[test]
fn dadapt_adam_kernels_match_the_cpu_path() -> TestResult {
    for decouple in [true, false] {
        let h = DAdaptAdamParams {
            weight_decay: 0.1,
            decouple,
            use_bias_correction: true,
            d0: 1e-4,
            ..DAdaptAdamParams::default()
        };
        let rule = DAdaptAdam::rule(h)?;
        each_grid(
            &format!("dadapt_adam decouple={decouple}"),
            &rule,
            &DAdaptAdamKernel(h),
            &[0.0, 1.0, 0.7],
        );
    }
    Ok(())
}

#[test]
fn dadapt_adan_kernels_match_the_cpu_path() -> TestResult {
    for no_prox in [false, true] {
        let h = DAdaptAdanParams {
            weight_decay: 0.1,
            no_prox,
            d0: 1e-4,
            ..DAdaptAdanParams::default()
        };
        let rule = DAdaptAdan::rule(h)?;
        each_grid(
            &format!("dadapt_adan no_prox={no_prox}"),
            &rule,
            &DAdaptAdanKernel(h),
            &[1.0, 0.5],
        );
    }
    Ok(())
}

#[test]
fn dadapt_lion_kernel_matches_the_cpu_path() -> TestResult {
    let h = DAdaptLionParams {
        weight_decay: 0.1,
        d0: 1e-4,
        ..DAdaptLionParams::default()
    };
    let rule = DAdaptLion::rule(h)?;
    each_grid("dadapt_lion", &rule, &DAdaptLionKernel(h), &[1.0, 0.5]);
    Ok(())
}

#[test]
fn dadapt_sgd_kernels_match_the_cpu_path() -> TestResult {
    let h = DAdaptSgdParams {
        momentum: 0.9,
        weight_decay: 0.01,
        d0: 1e-4,
        growth_rate: 2.0,
    };
    let rule = DAdaptSgd::rule(h)?;
    each_grid("dadapt_sgd", &rule, &DAdaptSgdKernel(h), &[1.0, 0.0, 0.8]);
    Ok(())
}

#[test]
fn dowg_kernels_match_the_cpu_path() -> TestResult {
    let h = DowgParams {
        eps: 1e-4,
        clip: 0.5,
    };
    each_grid(
        "coordinate_dowg",
        &CoordinateDowg::rule(h)?,
        &CoordinateDowgKernel(h),
        &[1.0],
    );
    each_grid(
        "scalar_dowg",
        &ScalarDowg::rule(h)?,
        &ScalarDowgKernel(h),
        &[1.0],
    );
    Ok(())
}

#[test]
fn adacoor_kernel_matches_the_cpu_path() -> TestResult {
    let h = AdaCoorParams { eps: 1e-8 };
    // Gradients of 1e-2 make ε·g² 1e-12: the bf16 accumulator and its rounding are exercised.
    each_grid("adacoor", &AdaCoor::rule(h)?, &AdaCoorKernel(h), &[1.0]);
    Ok(())
}

#[test]
fn schedulefree_kernels_match_the_cpu_path() -> TestResult {
    let warm = ScheduleFreeParams {
        weight_decay: 0.1,
        warmup_steps: 3,
        r: 0.5,
        ..ScheduleFreeParams::default()
    };
    for (what, h) in [
        ("adamw_schedulefree", ScheduleFreeParams::default()),
        ("adamw_schedulefree warmup, decay, r", warm),
    ] {
        let rule = AdamWScheduleFree::rule(h)?;
        each_grid(what, &rule, &ScheduleFreeKernel(h), &[1e-2, 1e-2, 5e-3]);
    }
    Ok(())
}
