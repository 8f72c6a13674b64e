//! The optimizers' CUDA kernels (src/optim/kernels.cu, src/optim/adaptive.cu) against the CPU
//! path: every optimizer, f32 and bf16 parameters, a tensor with 8-bit state (ragged last block)
//! and one with f32 state. Then the state file crosses devices: CUDA state saved and resumed on
//! the CPU continues as the CUDA run does. The 8-bit state kernels of src/optim/quant8.cu
//! against the host's quantization, bit for bit, and came8bit's device-held 8-bit moments
//! resumed across devices both ways.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use sdtrain::optim::cuda::CudaMoment;
use sdtrain::optim::quant8::{maps, requantize, Moment, BLOCK};
use sdtrain::optim::{
    AdaCoor, AdaCoorParams, Adafactor, AdafactorParams, AdamW, AdamW8bit, AdamWParams,
    AdamWScheduleFree, Came, CameParams, CoordinateDowg, DAdaptAdam, DAdaptAdamParams, DAdaptAdan,
    DAdaptAdanParams, DAdaptLion, DAdaptLionParams, DAdaptSgd, DAdaptSgdParams, DowgParams,
    GroupOptimizer, Lion, LionParams, Optimizer, Prodigy, ProdigyParams, ScalarDowg,
    ScheduleFreeParams, UpdateRule,
};

use super::common;

type MakeRule = fn() -> Box<dyn UpdateRule>;

fn rules() -> [(&'static str, MakeRule); 17] {
    const ADAM: AdamWParams = AdamWParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    const LION: LionParams = LionParams {
        beta1: 0.9,
        beta2: 0.99,
        weight_decay: 0.1,
    };
    [
        ("adamw", || Box::new(AdamW::rule(ADAM).unwrap())),
        ("adamw8bit", || Box::new(AdamW8bit::rule(ADAM).unwrap())),
        ("lion", || Box::new(Lion::rule(LION, false).unwrap())),
        ("lion8bit", || Box::new(Lion::rule(LION, true).unwrap())),
        ("adafactor", || {
            let p = AdafactorParams {
                beta1: Some(0.9),
                weight_decay: 0.1,
                ..AdafactorParams::default()
            };
            Box::new(Adafactor::rule(p).unwrap())
        }),
        // The fused kernels of src/optim/adaptive.cu.
        ("prodigy", || {
            let p = ProdigyParams {
                weight_decay: 0.1,
                use_bias_correction: true,
                safeguard_warmup: true,
                d0: 1e-4,
                ..ProdigyParams::default()
            };
            Box::new(Prodigy::rule(p).unwrap())
        }),
        ("prodigy β1=0", || {
            let p = ProdigyParams {
                beta1: 0.0,
                weight_decay: 0.1,
                decouple: false,
                d0: 1e-4,
                ..ProdigyParams::default()
            };
            Box::new(Prodigy::rule(p).unwrap())
        }),
        ("dadapt_adam", || {
            let p = DAdaptAdamParams {
                weight_decay: 0.1,
                d0: 1e-4,
                ..DAdaptAdamParams::default()
            };
            Box::new(DAdaptAdam::rule(p).unwrap())
        }),
        ("dadapt_adan", || {
            let p = DAdaptAdanParams {
                weight_decay: 0.1,
                d0: 1e-4,
                ..DAdaptAdanParams::default()
            };
            Box::new(DAdaptAdan::rule(p).unwrap())
        }),
        ("dadapt_lion", || {
            let p = DAdaptLionParams {
                weight_decay: 0.1,
                d0: 1e-4,
                ..DAdaptLionParams::default()
            };
            Box::new(DAdaptLion::rule(p).unwrap())
        }),
        ("dadapt_sgd", || {
            let p = DAdaptSgdParams {
                momentum: 0.9,
                weight_decay: 0.01,
                d0: 1e-4,
                growth_rate: f64::INFINITY,
            };
            Box::new(DAdaptSgd::rule(p).unwrap())
        }),
        ("coordinate_dowg", || {
            Box::new(CoordinateDowg::rule(DowgParams::default()).unwrap())
        }),
        ("scalar_dowg", || {
            Box::new(ScalarDowg::rule(DowgParams::default()).unwrap())
        }),
        ("adacoor", || {
            Box::new(AdaCoor::rule(AdaCoorParams { eps: 1e-8 }).unwrap())
        }),
        ("adamw_schedulefree", || {
            let p = ScheduleFreeParams {
                weight_decay: 0.1,
                warmup_steps: 2,
                ..ScheduleFreeParams::default()
            };
            Box::new(AdamWScheduleFree::rule(p).unwrap())
        }),
        // CAME's step is candle ops on either device (src/optim/came.rs); came8bit's 8-bit
        // moments stay on the device (more shapes in came8bit_state_on_the_device_resumes_both_ways).
        ("came", || {
            let p = CameParams {
                weight_decay: 0.1,
                ..CameParams::default()
            };
            Box::new(Came::rule(p, false).unwrap())
        }),
        ("came8bit", || {
            let p = CameParams {
                weight_decay: 0.1,
                ..CameParams::default()
            };
            Box::new(Came::rule(p, true).unwrap())
        }),
    ]
}

const SHAPES: [&[usize]; 2] = [&[70, 80], &[7, 3]];

fn vars(init: &[Tensor], dev: &Device) -> Vec<(String, Var)> {
    init.iter()
        .enumerate()
        .map(|(i, t)| {
            let t = t.to_device(dev).unwrap();
            (format!("p{i}"), Var::from_tensor(&t).unwrap())
        })
        .collect()
}

/// Gradients of step `k`, in each parameter's dtype, spanning four decades.
fn grads(k: usize, vars: &[(String, Var)]) -> GradStore {
    let mut g = GradStore::default();
    for (i, (_, v)) in vars.iter().enumerate() {
        let vals: Vec<f32> = (0..v.elem_count())
            .map(|j| {
                let x = (((j * 31 + k * 17 + i * 7) % 97) as f32 - 48.0) / 48.0;
                x * if j % 50 == 0 { 1.0 } else { 1e-3 }
            })
            .collect();
        let t = Tensor::from_vec(vals, v.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(v.dtype())
            .unwrap()
            .to_device(v.device())
            .unwrap();
        g.insert(v.as_tensor(), t);
    }
    g
}

fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Two optimizers of one rule, on the CPU and on `dev`, over the same parameters (`shapes`, in
/// `dtype`), after three steps on the same gradients, checked to agree within `tol`.
struct Stepped {
    a: GroupOptimizer,
    b: GroupOptimizer,
    cpu: Vec<(String, Var)>,
    gpu: Vec<(String, Var)>,
}

fn three_steps(
    what: &str,
    make: &dyn Fn() -> Box<dyn UpdateRule>,
    shapes: &[&[usize]],
    dtype: DType,
    dev: &Device,
    tol: f32,
) -> Stepped {
    let init: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| common::fill(s, i as u64 + 1).to_dtype(dtype).unwrap())
        .collect();
    let (cpu, gpu) = (vars(&init, &Device::Cpu), vars(&init, dev));
    let mut a = GroupOptimizer::new(make(), cpu.clone(), 1e-2).unwrap();
    let mut b = GroupOptimizer::new(make(), gpu.clone(), 1e-2).unwrap();
    assert_eq!(a.state_bytes(), b.state_bytes(), "{what}: state bytes");
    for k in 0..3 {
        a.step(&grads(k, &cpu)).unwrap();
        b.step(&grads(k, &gpu)).unwrap();
    }
    assert_same(&format!("{what}, 3 steps"), (&a, &cpu), (&b, &gpu), tol);
    Stepped { a, b, cpu, gpu }
}

/// Parameters within `tol`; state codes equal but for 1 + 1/100 of them; f32 state within 1e-5
/// relative to its largest value. With 8-bit state, a moment whose code differs from the host's
/// moves that element's later updates by a quantisation step, so a few parameters may differ by
/// more than `tol`: up to 1 + 1/100 of them (on an H100, 2026-11-24: 10 of 5,600 after three
/// adamw8bit steps, worst 2.9e-3 at lr 1e-2). A wrong index, scale or missing term moves nearly
/// every element.
fn assert_same(
    what: &str,
    a: (&GroupOptimizer, &[(String, Var)]),
    b: (&GroupOptimizer, &[(String, Var)]),
    tol: f32,
) {
    for ((name, va), (_, vb)) in a.1.iter().zip(b.1) {
        let (x, y) = (host_f32(va.as_tensor()), host_f32(vb.as_tensor()));
        let diffs: Vec<f32> = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).collect();
        let worst = diffs.iter().copied().fold(0f32, f32::max);
        let over = diffs.iter().filter(|d| d.is_nan() || **d > tol).count();
        let (sa, sb) = (a.0.state(name).unwrap(), b.0.state(name).unwrap());
        let q8 = sa.tensors().iter().any(|(_, t)| t.dtype() == DType::U8);
        let allowed = if q8 { 1 + x.len() / 100 } else { 0 };
        eprintln!(
            "{what}: {name}: worst {worst:.3e}, {over} of {} over {tol:e}",
            x.len()
        );
        assert!(
            over <= allowed,
            "{what}: {name} differs by {worst} ({over} of {} elements over {tol}, {allowed} allowed)",
            x.len()
        );
        assert_eq!(sa.step(), sb.step(), "{what}: {name} step");
        for ((s, ta), (_, tb)) in sa.tensors().iter().zip(sb.tensors()) {
            assert_eq!(ta.dtype(), tb.dtype(), "{what}: {name}.{s}");
            let (x, y) = (host_f32(ta), host_f32(tb));
            if ta.dtype() == DType::U8 {
                let diff = x.iter().zip(&y).filter(|(p, q)| p != q).count();
                eprintln!("{what}: {name}.{s}: {diff} of {} codes differ", x.len());
                assert!(
                    diff <= 1 + x.len() / 100,
                    "{what}: {name}.{s}: {diff} codes differ"
                );
            } else {
                let scale = x.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                let worst = x
                    .iter()
                    .zip(&y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= 1e-5 * scale,
                    "{what}: {name}.{s} differs by {worst} (scale {scale})"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_optimizers_match_cpu_and_resume_across_devices() {
    let dev = super::cuda("cuda_optimizers_match_cpu_and_resume_across_devices");
    let dir = tempfile::tempdir().unwrap();
    for (name, make) in rules() {
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let what = format!("{name} {dtype:?}");
            let Stepped { mut b, gpu, .. } = three_steps(&what, &make, &SHAPES, dtype, &dev, tol);

            // The CUDA state, resumed on the CPU over copies of the CUDA parameters.
            let path = dir.path().join(format!("{name}-{dtype:?}.safetensors"));
            b.save_state(&path).unwrap();
            let copies: Vec<Tensor> = gpu.iter().map(|(_, v)| v.as_tensor().clone()).collect();
            let resumed = vars(&copies, &Device::Cpu);
            let mut c = GroupOptimizer::new(make(), resumed.clone(), 1e-2).unwrap();
            c.load_state(&path).unwrap();
            for k in 3..5 {
                b.step(&grads(k, &gpu)).unwrap();
                c.step(&grads(k, &resumed)).unwrap();
            }
            assert_same(
                &format!("{what}, resumed on the CPU"),
                (&c, &resumed),
                (&b, &gpu),
                tol,
            );
        }
    }
}

/// Values for the quantization kernels: a block per scale from 1e-30 to 1e30, a block of zeros
/// with signed zeros, a block exactly on the map's midpoints (absmax 1), then a ragged tail.
fn q8_values(signed: bool) -> Vec<f32> {
    let map = if signed { &maps().0 } else { &maps().1 };
    let mut v = Vec::new();
    for (b, scale) in [1e-30f32, 1e-8, 1e-3, 1.0, 1e30].into_iter().enumerate() {
        v.extend((0..BLOCK).map(|j| {
            let x = (((j * 31 + b * 17) % 97) as f32 - 48.0) / 48.0 * scale;
            if signed {
                x
            } else {
                x.abs()
            }
        }));
    }
    v.extend((0..BLOCK).map(|j| if j % 2 == 0 { -0.0 } else { 0.0 }));
    v.extend(map.code.windows(2).map(|w| (w[0] + w[1]) * 0.5));
    v.push(1.0);
    v.extend((0..131).map(|j| j as f32 * if signed { -1e-4 } else { 1e-4 }));
    v
}

/// src/optim/quant8.cu on the GPU against the host's quantization (src/optim/quant8.rs), bit for
/// bit: `q8_requant` gives `quant8::requantize`'s codes and absmax block by block, `q8_dequant`
/// gives `Moment::values`. The unit tests check the same under the host emulation.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn q8_kernels_match_host_quantization_bit_for_bit() {
    let dev = super::cuda("q8_kernels_match_host_quantization_bit_for_bit");
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    for signed in [true, false] {
        let map = if signed { &maps().0 } else { &maps().1 };
        let vals = q8_values(signed);
        let n = vals.len();
        let mut want_codes = vec![0u8; n];
        let want_absmax: Vec<f32> = vals
            .chunks(BLOCK)
            .zip(want_codes.chunks_mut(BLOCK))
            .map(|(v, c)| requantize(v, map, c))
            .collect();
        let mut m = CudaMoment::upload(&Moment::zeros(n, true, map), cuda).unwrap();
        let t = Tensor::from_slice(&vals, n, &dev).unwrap();
        m.requantize(&t, signed).unwrap();
        let Moment::Q8 { codes, absmax } = m.download().unwrap() else {
            panic!("signed={signed}: the moment is not 8-bit")
        };
        let differ = codes
            .iter()
            .zip(&want_codes)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(differ, 0, "signed={signed}: {differ} of {n} codes differ");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&absmax), bits(&want_absmax), "signed={signed}: absmax");
        let back = host_f32(&m.dequantize(&[n], signed).unwrap());
        let want = Moment::Q8 { codes, absmax }.values(map);
        assert_eq!(bits(&back), bits(&want), "signed={signed}: dequantized");
    }
}

/// came8bit's 8-bit moments on the device (src/optim/came.rs, `q8_dequant`/`q8_requant` each
/// step): a factored matrix (`exp_avg` 8-bit), a vector over 4096 elements (`exp_avg` and
/// `exp_avg_sq` 8-bit) and a small tensor (f32), f32 and bf16 parameters. The CUDA run tracks the
/// CPU run, and the state crosses devices both ways: saved on CUDA and resumed on the CPU, saved
/// on the CPU and resumed on CUDA, each then tracking the run it left.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn came8bit_state_on_the_device_resumes_both_ways() {
    let dev = super::cuda("came8bit_state_on_the_device_resumes_both_ways");
    let dir = tempfile::tempdir().unwrap();
    let make = || -> Box<dyn UpdateRule> {
        let p = CameParams {
            weight_decay: 0.1,
            ..CameParams::default()
        };
        Box::new(Came::rule(p, true).unwrap())
    };
    let shapes: [&[usize]; 3] = [&[70, 80], &[4500], &[7, 3]];
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let what = format!("came8bit {dtype:?}");
        let Stepped {
            mut a,
            mut b,
            cpu,
            gpu,
        } = three_steps(&what, &make, &shapes, dtype, &dev, tol);
        let vector = b.state("p1").unwrap();
        for name in ["exp_avg", "exp_avg_sq"] {
            assert_eq!(
                vector.tensor(name).unwrap().dtype(),
                DType::U8,
                "{what}: {name}"
            );
        }

        let (from_gpu, from_cpu) = (dir.path().join("gpu.st"), dir.path().join("cpu.st"));
        b.save_state(&from_gpu).unwrap();
        a.save_state(&from_cpu).unwrap();
        let on = |vars: &[(String, Var)], dev: &Device| {
            let copies: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
            self::vars(&copies, dev)
        };
        let (to_cpu, to_gpu) = (on(&gpu, &Device::Cpu), on(&cpu, &dev));
        let mut c = GroupOptimizer::new(make(), to_cpu.clone(), 1e-2).unwrap();
        c.load_state(&from_gpu).unwrap();
        let mut d = GroupOptimizer::new(make(), to_gpu.clone(), 1e-2).unwrap();
        d.load_state(&from_cpu).unwrap();
        for k in 3..5 {
            for (o, v) in [
                (&mut a, &cpu),
                (&mut b, &gpu),
                (&mut c, &to_cpu),
                (&mut d, &to_gpu),
            ] {
                o.step(&grads(k, v)).unwrap();
            }
        }
        let resumed = format!("{what}, resumed on the CPU");
        assert_same(&resumed, (&c, &to_cpu), (&b, &gpu), tol);
        let resumed = format!("{what}, resumed on CUDA");
        assert_same(&resumed, (&d, &to_gpu), (&a, &cpu), tol);
    }
}

/// The step check's gradient norm on CUDA (src/optim/sumsq.cu: one launch per gradient into one
/// buffer) against the CPU's: f32, bf16 and f16 gradients, a tensor past one block's share
/// (1,024 blocks of 256 threads), and a non-finite gradient still found.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check runs it (--include-ignored)"]
fn cuda_gradient_norm_matches_cpu() {
    let dev = super::cuda("cuda_gradient_norm_matches_cpu");
    let shapes: [&[usize]; 4] = [&[320, 16], &[16, 640], &[3_000_000], &[7]];
    let vars: Vec<Var> = shapes
        .iter()
        .map(|s| Var::from_tensor(&Tensor::zeros(*s, DType::F32, &Device::Cpu).unwrap()).unwrap())
        .collect();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let grads: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| common::fill(s, i as u64 + 3).to_dtype(dtype).unwrap())
            .collect();
        let store = |dev: &Device| {
            let mut g = GradStore::default();
            for (v, t) in vars.iter().zip(&grads) {
                g.insert(v.as_tensor(), t.to_device(dev).unwrap());
            }
            g
        };
        let cpu = sdtrain::optim::grad_norm(&vars, &store(&Device::Cpu)).unwrap();
        let gpu = sdtrain::optim::grad_norm(&vars, &store(&dev)).unwrap();
        eprintln!("gradient norm {dtype:?}: cpu {cpu}, cuda {gpu}");
        assert!((gpu - cpu).abs() <= 1e-5 * cpu, "{dtype:?}: {gpu} vs {cpu}");
    }
    let mut bad = GradStore::default();
    let inf = Tensor::new(&[1.0f32, f32::INFINITY, 2.0, 0.0, 0.0, 0.0, 0.0], &dev).unwrap();
    bad.insert(vars[3].as_tensor(), inf);
    assert!(!sdtrain::optim::grad_norm(&vars, &bad).unwrap().is_finite());
}
