use super::*;
use candle_core::Device;

/// Values across the ranges that round differently: zeros, f32 and f16 subnormals, ordinary
/// values of both signs, powers of two, the edge of f16's range, infinities and NaN.
fn awkward_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::from_bits(1),
        -f32::from_bits(0x0040_0000),
        1e-7,
        -3.0e-6,
        6.1e-5,
        6.103_515_6e-5,
        1.0,
        -1.0,
        1.000_3,
        -0.333_333_34,
        2.0f32.powi(-13) * 1.7,
        1024.5,
        -4097.3,
        65503.0,
        65504.0,
        65510.0,
        65519.9,
        65520.0,
        -70000.0,
        3.0e38,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    v.extend(
        crate::optim::test_values(7, 200, 1.0)
            .iter()
            .enumerate()
            .map(|(i, x)| {
                // Spread over exponents 2^-30 … 2^20.
                x * 2f32.powi(i as i32 % 51 - 30)
            }),
    );
    v
}

/// The two representable values around `x` (toward zero, away from zero) in `dtype`, in f64.
fn neighbours(x: f32, dtype: DType) -> (f64, f64) {
    let to_zero = |x: f32| -> f64 {
        match dtype {
            DType::BF16 => {
                let r = half::bf16::from_f32(x);
                let r = if r.to_f32().abs() > x.abs() {
                    half::bf16::from_bits(r.to_bits() - 1)
                } else {
                    r
                };
                f64::from(r.to_f32())
            }
            _ => {
                let r = half::f16::from_f32(x);
                let r = if r.to_f32().abs() > x.abs() {
                    half::f16::from_bits(r.to_bits() - 1)
                } else {
                    r
                };
                f64::from(r.to_f32())
            }
        }
    };
    let lo = to_zero(x);
    let hi = match dtype {
        DType::BF16 => {
            let b = half::bf16::from_f64(lo).to_bits();
            f64::from(half::bf16::from_bits(b + 1).to_f32())
        }
        _ => {
            let b = half::f16::from_f64(lo).to_bits();
            f64::from(half::f16::from_bits(b + 1).to_f32())
        }
    };
    let s = if x.is_sign_negative() { -1.0 } else { 1.0 };
    (lo, s * hi.abs())
}

/// Finite values away from the top of each format's range.
fn ordinary(dtype: DType) -> Vec<f32> {
    awkward_values()
        .into_iter()
        .filter(|x| x.is_finite() && x.abs() < if dtype == DType::F16 { 65504.0 } else { 1e38 })
        .collect()
}

/// The mean over all 2^16 draws of the bits bf16 uses is the f32 value exactly, and every draw
/// gives one of its two neighbours. Catches a biased carry (fewer random bits, a fixed offset,
/// rounding to nearest) or a result outside the two neighbours.
#[test]
fn bf16_rounding_is_exactly_unbiased() {
    for x in ordinary(DType::BF16) {
        let (lo, hi) = neighbours(x, DType::BF16);
        let mut sum = 0f64;
        for r in 0..1u64 << 16 {
            let y = f64::from(round_bf16(x, r).to_f32());
            assert!(y == lo || y == hi, "{x}: {y} is not {lo} or {hi}");
            sum += y;
        }
        assert_eq!(sum / 65536.0, f64::from(x), "bf16 mean of {x}");
    }
}

/// The same for f16, whose rounding reads 24 random bits: the draws that round away from zero
/// are the first ones (the test finds the boundary by bisection and checks both sides of it),
/// and their share is the value's fraction of the gap, exactly where that fraction has at most
/// 24 bits (all of f16's normal range), within 2^-24 of the gap below it.
#[test]
fn f16_rounding_is_unbiased() {
    let at = |x: f32, k: u64| f64::from(round_f16(x, k << 40).to_f32());
    for x in ordinary(DType::F16) {
        let (lo, hi) = neighbours(x, DType::F16);
        if lo == f64::from(x) {
            assert!((0..1u64 << 24).step_by(4099).all(|k| at(x, k) == lo), "{x}");
            continue;
        }
        // Draws 0..ups round to `hi`, ups.. to `lo`.
        let (mut a, mut b) = (0u64, 1u64 << 24);
        while a < b {
            let m = (a + b) / 2;
            if at(x, m) == hi {
                a = m + 1;
            } else {
                b = m;
            }
        }
        let ups = a;
        for k in [0, ups.saturating_sub(1), ups, ups + 1, (1 << 24) - 1] {
            let k = k.min((1 << 24) - 1);
            let want = if k < ups { hi } else { lo };
            assert_eq!(at(x, k), want, "{x}: draw {k} of boundary {ups}");
        }
        let mean = lo + (hi - lo) * ups as f64 / 16_777_216.0;
        let tolerance = if x.abs() < 6.103_515_6e-5 {
            (hi - lo).abs() / 16_777_216.0
        } else {
            0.0
        };
        assert!(
            (mean - f64::from(x)).abs() <= tolerance,
            "f16 mean of {x}: {mean} (neighbours {lo}, {hi})"
        );
    }
}

/// Infinities, NaN and values past f16's largest finite number round as a cast does.
#[test]
fn special_values_round_as_a_cast_does() {
    for r in [0, u64::MAX, 0x1234_5678_9abc_def0] {
        assert!(round_bf16(f32::NAN, r).is_nan() && round_f16(f32::NAN, r).is_nan());
        for x in [f32::INFINITY, f32::NEG_INFINITY, 65519.0, -65510.0, 70000.0] {
            assert_eq!(round_f16(x, r), half::f16::from_f32(x), "{x}");
        }
        assert_eq!(round_bf16(f32::INFINITY, r), half::bf16::INFINITY);
        assert_eq!(round_bf16(-0.0, r).to_bits(), 0x8000);
        assert_eq!(round_f16(-0.0, r).to_bits(), 0x8000);
    }
}

/// `round_into` writes, element by element, the scalar functions' result at that element's
/// draw, into the variable's own storage (a view of it sees the new values), across the host's
/// parallel chunks; anything but an f32 source of the same size, or a bf16/f16 parameter, is
/// refused. Catches a chunk that restarts its draws at index 0.
#[test]
fn round_into_writes_each_element_with_its_own_draw() -> candle_core::Result<()> {
    let base = ordinary(DType::F16);
    let n = 3 * (1 << 16) + 17;
    let xs: Vec<f32> = base.iter().copied().cycle().take(n).collect();
    let master = Tensor::from_slice(&xs, n, &Device::Cpu)?;
    for dtype in [DType::BF16, DType::F16] {
        let var = Var::zeros(n, dtype, &Device::Cpu)?;
        let view = var.as_tensor().clone();
        round_into(&var, &master, 99)?;
        let got = view.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (i, (&x, &y)) in xs.iter().zip(&got).enumerate() {
            let r = random_bits(99, i as u64);
            let want = match dtype {
                DType::BF16 => round_bf16(x, r).to_f32(),
                _ => round_f16(x, r).to_f32(),
            };
            assert_eq!(y.to_bits(), want.to_bits(), "{dtype:?} element {i}");
        }
    }
    let f32_var = Var::zeros(n, DType::F32, &Device::Cpu)?;
    assert!(round_into(&f32_var, &master, 1).is_err());
    let bf16 = Var::zeros(n + 1, DType::BF16, &Device::Cpu)?;
    assert!(round_into(&bf16, &master, 1).is_err());
    let half_master = master.to_dtype(DType::F16)?;
    let f16 = Var::zeros(n, DType::F16, &Device::Cpu)?;
    assert!(round_into(&f16, &half_master, 1).is_err());
    Ok(())
}

/// Over a tensor, the elements draw independent bits: 1.0003 rounds up 3.84% of the time, and
/// the mean of 65536 roundings is within four standard deviations of 1.0003. Catches draws
/// shared by every element (the mean would be 1 or 1.0078) or a seed that ignores the index.
#[test]
fn a_tensor_rounds_to_its_mean() -> candle_core::Result<()> {
    let x = 1.0003f32;
    let n = 1 << 16;
    let master = Tensor::full(x, n, &Device::Cpu)?;
    let var = Var::zeros(n, DType::BF16, &Device::Cpu)?;
    round_into(&var, &master, tensor_seed(5, "down.0.weight", 3))?;
    let got = var.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mean = got.iter().map(|&y| f64::from(y)).sum::<f64>() / n as f64;
    let gap = 0.0078125f64;
    let p = (f64::from(x) - 1.0) / gap;
    let sd = gap * (p * (1.0 - p) / n as f64).sqrt();
    assert!(
        (mean - f64::from(x)).abs() < 4.0 * sd,
        "mean {mean}, want {x} ± {}",
        4.0 * sd
    );
    Ok(())
}

/// The seed changes with the run's seed, the name and the step, and with nothing else.
#[test]
fn each_tensor_and_step_has_its_own_seed() {
    let s = tensor_seed(1, "a.weight", 1);
    assert_eq!(s, tensor_seed(1, "a.weight", 1));
    for other in [
        tensor_seed(2, "a.weight", 1),
        tensor_seed(1, "b.weight", 1),
        tensor_seed(1, "a.weight", 2),
    ] {
        assert_ne!(s, other);
    }
}

/// The CUDA kernels (src/optim/rounding.cu) under the host emulation give the host functions'
/// bits for every awkward value, with a grid that makes the grid-stride loop go round.
#[test]
fn the_cuda_kernels_match_the_host_bit_for_bit() {
    use crate::kernel_emu::{launch, Arg};
    let xs = awkward_values();
    let n = xs.len();
    let seed = 0xdead_beef_u64 << 32 | 17;
    for (entry, dtype) in [
        ("stochastic_round_bf16", DType::BF16),
        ("stochastic_round_f16", DType::F16),
    ] {
        let mut out = vec![0u16; n];
        let mut args = vec![
            Arg::out(&mut out),
            Arg::input(&xs),
            Arg::Int(seed as i64),
            Arg::Int(n as i64),
        ];
        launch(
            "src/optim/rounding.cu",
            entry,
            [2, 1, 1],
            [32, 1, 1],
            &mut args,
        );
        for (i, (&x, &got)) in xs.iter().zip(&out).enumerate() {
            let r = random_bits(seed, i as u64);
            let want = match dtype {
                DType::BF16 => round_bf16(x, r).to_bits(),
                _ => round_f16(x, r).to_bits(),
            };
            assert_eq!(got, want, "{entry}: element {i} = {x}");
        }
    }
}
