//! The flash-attention kernels under the host emulation against the composed reference: the
//! SIMT kernels (kernels/flash_attention.cu) and the tensor-core ones (flash_attention_tc.cu, split
//! and merged heads), forward and every gradient, and the launch geometry.
#![cfg(test)]

use super::*;
use crate::kernel_emu::{self, Arg, Elem};
use crate::nn::test_util::{fill, output_and_grads, rel_err};
use candle_core::{Device, Tensor, WithDType, D};

const CU: &str = "src/nn/kernels/flash_attention.cu";
const CU_TC: &str = "src/nn/kernels/flash_attention_tc.cu";

/// One emulated case: `bh` heads of `lq` queries and `lk` keys of head dim `d`.
#[derive(Clone, Copy)]
struct Case {
    bh: usize,
    lq: usize,
    lk: usize,
    d: usize,
    causal: bool,
}

impl Case {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

fn host<T: WithDType>(t: &Tensor) -> Vec<T> {
    t.to_dtype(T::DTYPE)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn tensor<T: WithDType>(v: Vec<T>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Which kernels a case runs: the SIMT ones, the tensor-core ones on split heads, or the
/// tensor-core ones reading merged heads `[B, L, H·D]` in place (H heads per batch row).
#[derive(Clone, Copy)]
enum Mode {
    Simt,
    Tc,
    Merged(usize),
}

/// The geometry of `c` in dtype `T` under `mode`, and the .cu file of its kernels.
fn geometry<T: WithDType>(c: Case, mode: Mode) -> (Geometry, &'static str) {
    let g = Geometry::new(c.bh, c.lq, c.lk, c.d).unwrap();
    let g = match mode {
        Mode::Simt => return (g, CU),
        Mode::Tc => g.with_tensor_cores(T::DTYPE),
        Mode::Merged(h) => g
            .merged(h, T::DTYPE)
            .expect("a merged tensor-core geometry"),
    };
    assert!(
        g.tensor_cores(),
        "no tensor-core kernel for {:?}, d {}",
        T::DTYPE,
        c.d
    );
    (g, CU_TC)
}

/// The tensor-core kernels' layout arguments of `g` (none for the SIMT ones).
fn layout<'a>(g: &Geometry) -> Vec<Arg<'a>> {
    if !g.tensor_cores() {
        return Vec::new();
    }
    g.layout_args()
        .iter()
        .map(|&a| Arg::Int(i64::from(a)))
        .collect()
}

/// The output and L of the emulated forward.
fn emu_forward<T: WithDType + Elem>(
    c: Case,
    mode: Mode,
    q: &[T],
    k: &[T],
    v: &[T],
) -> (Vec<T>, Vec<f32>) {
    let (g, cu) = geometry::<T>(c, mode);
    let mut o = vec![T::zero(); g.q_len()];
    let mut lse = vec![0f32; c.bh * c.lq];
    let mut args = vec![
        Arg::input(q),
        Arg::input(k),
        Arg::input(v),
        Arg::out(&mut o),
        Arg::out(&mut lse),
        Arg::F32(c.scale()),
        Arg::Int(c.lq as i64),
        Arg::Int(c.lk as i64),
        Arg::Int(c.d as i64),
        Arg::Int(c.causal as i64),
    ];
    args.extend(layout(&g));
    kernel_emu::launch(
        cu,
        &g.entry("flash_fwd", T::DTYPE).unwrap(),
        g.fwd_grid(),
        [THREADS, 1, 1],
        &mut args,
    );
    drop(args);
    (o, lse)
}

/// dQ (f32), dK and dV of the emulated backward for output `o`, upstream gradient `go` and
/// log-sum-exp `lse`.
#[allow(clippy::too_many_arguments)]
fn emu_backward<T: WithDType + Elem>(
    c: Case,
    mode: Mode,
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    go: &[T],
    lse: &[f32],
) -> (Vec<f32>, Vec<T>, Vec<T>) {
    let (g, cu) = geometry::<T>(c, mode);
    let mut dr = vec![0f32; c.bh * c.lq];
    let mut args = vec![Arg::input(o), Arg::input(go), Arg::out(&mut dr)];
    if g.tensor_cores() {
        let [heads, q_rs, _] = g.layout_args();
        for x in [
            c.bh as i64,
            c.lq as i64,
            c.d as i64,
            heads.into(),
            q_rs.into(),
        ] {
            args.push(Arg::Int(x));
        }
    } else {
        args.extend([Arg::Int((c.bh * c.lq) as i64), Arg::Int(c.d as i64)]);
    }
    kernel_emu::launch(
        cu,
        &g.entry("flash_dot", T::DTYPE).unwrap(),
        g.dot_grid(),
        [THREADS, 1, 1],
        &mut args,
    );
    drop(args);
    let mut dq = vec![0f32; g.q_len()];
    let (mut dk, mut dv) = (vec![T::zero(); g.k_len()], vec![T::zero(); g.k_len()]);
    let mut args = vec![
        Arg::input(q),
        Arg::input(k),
        Arg::input(v),
        Arg::input(go),
        Arg::input(lse),
        Arg::input(&dr),
        Arg::out(&mut dq),
        Arg::out(&mut dk),
        Arg::out(&mut dv),
        Arg::F32(c.scale()),
        Arg::Int(c.lq as i64),
        Arg::Int(c.lk as i64),
        Arg::Int(c.d as i64),
        Arg::Int(c.causal as i64),
    ];
    args.extend(layout(&g));
    kernel_emu::launch(
        cu,
        &g.entry("flash_bwd", T::DTYPE).unwrap(),
        g.bwd_grid(),
        [THREADS, 1, 1],
        &mut args,
    );
    drop(args);
    (dq, dk, dv)
}

/// Split heads `[B·H, L, D]` as merged `[B, L, H·D]`, and back (`back`).
fn relayout<T: Copy>(x: &[T], h: usize, l: usize, d: usize, back: bool) -> Vec<T> {
    let mut out = x.to_vec();
    for (i, &val) in x.iter().enumerate() {
        let (bh, rest) = (i / (l * d), i % (l * d));
        let (t, c) = (rest / d, rest % d);
        let (b, head) = (bh / h, bh % h);
        let merged = (b * l + t) * h * d + head * d + c;
        if back {
            out[i] = x[merged];
        } else {
            out[merged] = val;
        }
    }
    out
}

/// The composed reference on `[BH, L, D]` inputs (one head each): output and L.
fn reference(c: Case, qkv: &[Tensor]) -> Result<(Tensor, Tensor)> {
    let mask = if c.causal {
        Some(super::super::attention::causal_mask(c.lq, &Device::Cpu)?)
    } else {
        None
    };
    let mask = mask.as_ref().map(|m| m.tensor());
    let o = super::super::attention_reference(&qkv[0], &qkv[1], &qkv[2], 1, mask)?;
    let mut s = (qkv[0].matmul(&qkv[1].t()?)? * c.scale() as f64)?;
    if let Some(m) = mask {
        s = s.broadcast_add(&m.squeeze(0)?)?;
    }
    let m = s.max_keepdim(D::Minus1)?;
    let lse = (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
    Ok((o, lse.flatten_all()?))
}

/// Runs `c` in dtype `T` through the emulated kernels and the composed reference (in f32, on
/// the inputs rounded to `T`) and returns the relative errors of O, L, dQ, dK, dV.
fn errors<T: WithDType + Elem>(c: Case) -> [f32; 5] {
    errors_on::<T>(c, plain_inputs(c))
}

/// `c`'s q, k, v: deterministic fills in [−2, 2).
fn plain_inputs(c: Case) -> [Tensor; 3] {
    [
        fill(&[c.bh, c.lq, c.d], 1, 2.0),
        fill(&[c.bh, c.lk, c.d], 2, 2.0),
        fill(&[c.bh, c.lk, c.d], 3, 2.0),
    ]
}

/// [`plain_inputs`] with keys that score higher the later they come (k scaled by a ramp
/// 0.25 → 2.25), so every row's running max moves from one key tile to the next.
fn rising_keys(c: Case) -> Result<[Tensor; 3]> {
    let ramp: Vec<f32> = (0..c.lk)
        .map(|j| 0.25 + 2.0 * j as f32 / c.lk as f32)
        .collect();
    let ramp = Tensor::from_vec(ramp, (1, c.lk, 1), &Device::Cpu)?;
    let [q, k, v] = plain_inputs(c);
    Ok([q, k.broadcast_mul(&ramp)?, v])
}

/// As [`errors`], on the given `q`, `k`, `v` (rounded to `T` first).
fn errors_on<T: WithDType + Elem>(c: Case, qkv: [Tensor; 3]) -> [f32; 5] {
    errors_with::<T>(c, Mode::Simt, qkv)
}

/// As [`errors_on`], on the kernels of `mode`.
fn errors_with<T: WithDType + Elem>(c: Case, mode: Mode, qkv: [Tensor; 3]) -> [f32; 5] {
    let round = |t: Tensor| t.to_dtype(T::DTYPE).unwrap().to_dtype(DType::F32).unwrap();
    let qkv = qkv.map(round);
    let (o_ref, grads) = output_and_grads(&qkv, &[true; 3], &|a| Ok(reference(c, a)?.0));
    let (_, lse_ref) = reference(c, &qkv).unwrap();
    // output_and_grads's upstream gradient.
    let go = round(fill(o_ref.dims(), 99, 1.0));
    // Merged heads: the kernels see [B, L, H·D]; their results go back to split heads.
    let heads = match mode {
        Mode::Merged(h) => h,
        _ => 1,
    };
    let to = |x: Vec<T>, l: usize| relayout(&x, heads, l, c.d, false);
    let (q, k, v) = (
        to(host::<T>(&qkv[0]), c.lq),
        to(host::<T>(&qkv[1]), c.lk),
        to(host::<T>(&qkv[2]), c.lk),
    );
    let (o, lse) = emu_forward(c, mode, &q, &k, &v);
    let go = to(host::<T>(&go), c.lq);
    let (dq, dk, dv) = emu_backward(c, mode, &q, &k, &v, &o, &go, &lse);
    let (o, dk, dv) = (
        relayout(&o, heads, c.lq, c.d, true),
        relayout(&dk, heads, c.lk, c.d, true),
        relayout(&dv, heads, c.lk, c.d, true),
    );
    let dq = relayout(&dq, heads, c.lq, c.d, true);
    let g = |i: usize| grads[i].clone().unwrap();
    [
        rel_err(&tensor(o, o_ref.dims()), &o_ref),
        rel_err(&tensor(lse, lse_ref.dims()), &lse_ref),
        rel_err(&tensor(dq, o_ref.dims()), &g(0)),
        rel_err(&tensor(dk, qkv[1].dims()), &g(1)),
        rel_err(&tensor(dv, qkv[1].dims()), &g(2)),
    ]
}

fn check<T: WithDType + Elem>(what: &str, c: Case, tol: f32) {
    check_each::<T>(what, c, [tol; 5]);
}

/// As [`check`], with a tolerance per result (O, L, dQ, dK, dV).
fn check_each<T: WithDType + Elem>(what: &str, c: Case, tol: [f32; 5]) {
    assert_within(what, errors::<T>(c), tol);
}

/// Each of the errors of O, L, dQ, dK, dV within its bound.
fn assert_within(what: &str, e: [f32; 5], tol: [f32; 5]) {
    for ((name, e), tol) in ["O", "L", "dQ", "dK", "dV"].iter().zip(e).zip(tol) {
        assert!(e <= tol, "{what}: {name} differs by {e:.2e} (relative)");
    }
}

/// Self-attention, f32, head dim 40, ragged in queries and keys (37 and 53: two query tiles
/// of the forward, three of the backward, two key tiles each). Catches the forward's K tile
/// loaded one row off (`k0 + 1`) and the forward's ragged key tail left unmasked
/// (`key >= lk` dropped: the zero rows of the last K tile then get probability mass).
#[test]
fn ragged_self_attention_d40_matches_reference() {
    let c = Case {
        bh: 3,
        lq: 37,
        lk: 53,
        d: 40,
        causal: false,
    };
    check::<f32>("d40 ragged", c, 1e-4);
}

/// Head dim 64 (SD2/SDXL), f32. Catches the scale dropped from dS (`p * (dp − Dr)`) and Dr
/// not subtracted (`p * dp * scale`), which leave the forward exact; also the missing
/// rescales below.
#[test]
fn ragged_d64_gradients_match_reference() {
    let c = Case {
        bh: 2,
        lq: 37,
        lk: 53,
        d: 64,
        causal: false,
    };
    check::<f32>("d64 ragged", c, 1e-4);
}

/// Keys that score higher the later they come (k scaled by a ramp 0.25 → 2.25), so every
/// row's max moves at the second K tile: catches the running sum (`l = l·α + p` → `l + p`) or
/// the accumulator (`acc *= α` dropped) not rescaled when the max moves. (On the plain fill
/// the d40 case's maxima barely move and miss it; d64, d48 and causal catch it too.)
#[test]
fn rising_key_scores_force_the_online_rescale() {
    let c = Case {
        bh: 2,
        lq: 37,
        lk: 53,
        d: 40,
        causal: false,
    };
    let qkv = rising_keys(c).unwrap();
    let e = errors_on::<f32>(c, qkv);
    for (name, e) in ["O", "L", "dQ", "dK", "dV"].iter().zip(e) {
        assert!(
            e <= 1e-4,
            "rising keys: {name} differs by {e:.2e} (relative)"
        );
    }
}

/// Cross-attention as SD's (77 text tokens), head dim 80 (SD1.5's middle blocks), f32.
#[test]
fn cross_attention_lk77_d80_matches_reference() {
    let c = Case {
        bh: 2,
        lq: 33,
        lk: 77,
        d: 80,
        causal: false,
    };
    check::<f32>("cross-attention", c, 1e-4);
}

/// CLIP's causal self-attention over 77 tokens, head dim 64. Catches the backward's causal
/// test dropped, and its skip of the query tiles before a key tile starting one tile late.
#[test]
fn causal_clip_shape_matches_reference() {
    let c = Case {
        bh: 2,
        lq: 77,
        lk: 77,
        d: 64,
        causal: true,
    };
    check::<f32>("causal", c, 1e-4);
}

/// Head dim 160 (SD1.5's deepest blocks): the bucket with 16-row backward tiles.
#[test]
fn ragged_d160_matches_reference() {
    let c = Case {
        bh: 1,
        lq: 37,
        lk: 21,
        d: 160,
        causal: false,
    };
    check::<f32>("d160", c, 1e-4);
}

/// A head dim between buckets (48 runs in the 64 bucket, zero-padded). Catches the padding
/// columns read from the next row (`c < d` dropped in the tile load).
#[test]
fn head_dim_between_buckets_is_padded() {
    let c = Case {
        bh: 2,
        lq: 20,
        lk: 35,
        d: 48,
        causal: false,
    };
    check::<f32>("d48", c, 1e-4);
}

/// bf16 inputs (f32 inside, bf16 O, dK, dV): close to the f32 reference on the same rounded
/// inputs, self-attention at head dim 40 and causal at 160. Checks that the bf16 entry points
/// load and store (a value read as the wrong type is off by far more).
///
/// dQ and dK get a looser bound: Dr = rowsum(dO ∘ O) is taken from the bf16 output (as in
/// FA2 and the chunked path), and dP − Dr cancels, so O's rounding (2⁻⁹) grows to 1–7 % of
/// dS's scale at these shapes. Measured: the f32 kernel given the bf16-rounded O has exactly
/// the bf16 kernel's dQ error.
#[test]
fn bf16_matches_f32_reference() {
    let c = Case {
        bh: 2,
        lq: 37,
        lk: 53,
        d: 40,
        causal: false,
    };
    let tol = [1e-2, 1e-5, 1e-1, 1e-1, 1e-2];
    check_each::<half::bf16>("bf16 d40", c, tol);
    let c = Case {
        bh: 1,
        lq: 35,
        lk: 35,
        d: 160,
        causal: true,
    };
    check_each::<half::bf16>("bf16 d160 causal", c, tol);
}

/// The tensor-core kernels' bounds against the f32 reference on the same rounded inputs (O,
/// L, dQ, dK, dV). P and dS are rounded to the input dtype before their products, as in
/// FlashAttention-2. Measured in bf16 over the cases below: O ≤ 3.1e-3, L ≤ 1e-7, dQ ≤ 2.2e-2,
/// dK ≤ 2.6e-2, dV ≤ 4.5e-3 (the SIMT kernels' bf16 dQ and dK reach 7e-2, from Dr's
/// cancellation; see [`bf16_matches_f32_reference`]).
const TC_TOL: [f32; 5] = [6e-3, 1e-6, 5e-2, 5e-2, 1e-2];

fn check_tc<T: WithDType + Elem>(what: &str, c: Case, qkv: Option<[Tensor; 3]>) {
    check_mode::<T>(what, c, Mode::Tc, qkv);
}

fn check_mode<T: WithDType + Elem>(what: &str, c: Case, mode: Mode, qkv: Option<[Tensor; 3]>) {
    let qkv = qkv.unwrap_or_else(|| plain_inputs(c));
    let e = errors_with::<T>(c, mode, qkv);
    eprintln!("{what}: O L dQ dK dV {e:?}");
    assert_within(what, e, TC_TOL);
}

/// Tensor cores, bf16, head dim 40 (SD1.5's 4096-token level; Q·Kᵀ padded to 48), ragged:
/// 93 queries (two forward tiles of 64, three backward steps of 32) against 75 keys (two
/// key tiles, two backward blocks).
#[test]
fn tc_ragged_self_attention_d40_matches_reference() {
    let c = Case {
        bh: 2,
        lq: 93,
        lk: 75,
        d: 40,
        causal: false,
    };
    check_tc::<half::bf16>("tc d40", c, None);
}

/// Tensor cores, bf16, head dim 64, keys that score higher the later they come over three
/// key tiles, so every row's max moves: the running sum and O must be rescaled.
#[test]
fn tc_rising_key_scores_force_the_online_rescale() {
    let c = Case {
        bh: 1,
        lq: 70,
        lk: 150,
        d: 64,
        causal: false,
    };
    let qkv = rising_keys(c).unwrap();
    check_tc::<half::bf16>("tc rising keys", c, Some(qkv));
}

/// Tensor cores, f16, cross-attention over 77 text tokens at head dim 80.
#[test]
fn tc_f16_cross_attention_lk77_d80_matches_reference() {
    let c = Case {
        bh: 2,
        lq: 67,
        lk: 77,
        d: 80,
        causal: false,
    };
    check_tc::<half::f16>("tc f16 cross d80", c, None);
}

/// Tensor cores, CLIP's causal self-attention over 77 tokens at head dim 64, bf16.
#[test]
fn tc_causal_clip_shape_matches_reference() {
    let c = Case {
        bh: 2,
        lq: 77,
        lk: 77,
        d: 64,
        causal: true,
    };
    check_tc::<half::bf16>("tc causal", c, None);
}

/// Tensor cores, head dims inside a bucket (36 in 40, 72 in 80): the padded columns.
#[test]
fn tc_head_dims_between_buckets_are_padded() {
    for d in [36, 72] {
        let c = Case {
            bh: 1,
            lq: 40,
            lk: 66,
            d,
            causal: false,
        };
        check_tc::<half::bf16>(&format!("tc d{d}"), c, None);
    }
}

/// Tensor cores reading merged heads `[B, L, H·D]` in place (what the attention layers pass,
/// without split copies): 2 batch rows × 3 heads at head dim 40 (bf16, ragged), and CLIP's
/// causal shape with 2 heads of 64 (f16). Catches a head's base taken as split (`bh·L·D`),
/// a row stride of D instead of H·D in any load or store, and Dr read in the wrong order.
#[test]
fn tc_merged_heads_are_read_in_place() {
    let c = Case {
        bh: 6,
        lq: 70,
        lk: 75,
        d: 40,
        causal: false,
    };
    check_mode::<half::bf16>("tc merged d40", c, Mode::Merged(3), None);
    let c = Case {
        bh: 2,
        lq: 77,
        lk: 77,
        d: 64,
        causal: true,
    };
    check_mode::<half::f16>("tc merged causal f16", c, Mode::Merged(2), None);
}

/// f32 and bucket 160 stay on the SIMT kernels; bf16/f16 at 40, 64 and 80 take the tensor-core
/// entry points and grids (64 rows per block).
#[test]
fn tensor_cores_take_bf16_and_f16_up_to_head_dim_80() {
    let g = Geometry::new(16, 4096, 77, 40).unwrap();
    assert!(!g.with_tensor_cores(DType::F32).tensor_cores());
    let tc = g.with_tensor_cores(DType::BF16);
    assert_eq!(
        tc.entry("flash_fwd", DType::BF16).unwrap(),
        "flash_fwd_tc_d40_bf16"
    );
    assert_eq!(
        tc.entry("flash_dot", DType::BF16).unwrap(),
        "flash_dot_tc_d40_bf16"
    );
    assert_eq!(tc.layout_args(), [1, 40, 40]);
    let merged = g.merged(8, DType::BF16).unwrap();
    assert_eq!(merged.layout_args(), [8, 320, 320]);
    assert!(g.merged(8, DType::F32).is_none());
    assert!(
        g.merged(3, DType::BF16).is_none(),
        "16 heads do not split by 3"
    );
    assert_eq!(tc.fwd_grid(), [64, 16, 1]);
    assert_eq!(tc.bwd_grid(), [2, 16, 1]);
    let big = Geometry::new(2, 256, 256, 160).unwrap();
    assert!(!big.with_tensor_cores(DType::F16).tensor_cores());
    let src = std::fs::read_to_string(CU_TC).unwrap();
    assert!(src.contains(&format!("#define TC_THREADS {THREADS}\n")));
    assert!(src.contains(&format!("constexpr int BQ = {TC_FWD_ROWS}, BK = 64,")));
    assert!(src.contains(&format!("constexpr int BK = {TC_BWD_ROWS}, BQ = 32,")));
    for b in TC_BUCKETS {
        for (ty, t) in [("bf16", "__nv_bfloat16"), ("f16", "__half")] {
            let line = format!("TC_ENTRY_POINTS(d{b}_{ty}, {t}, {b})");
            assert!(src.contains(&line), "no {line}");
        }
    }
}

#[test]
fn geometry_refuses_head_dims_over_160() {
    let e = Geometry::new(2, 10, 10, 161).unwrap_err().to_string();
    assert!(e.contains("head dim 161"), "{e}");
    assert!(Geometry::new(0, 10, 10, 64).is_err());
    // The kernels count query rows over all heads in i32.
    assert!(Geometry::new(32_768, 65_535, 77, 40).is_ok());
    let e = Geometry::new(32_768, 65_536, 77, 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overflows i32"), "{e}");
    let g = Geometry::new(16, 4096, 77, 40).unwrap();
    assert_eq!(
        g.entry("flash_bwd", DType::BF16).unwrap(),
        "flash_bwd_d40_bf16"
    );
    assert_eq!(g.fwd_grid(), [128, 16, 1]);
    assert_eq!(g.bwd_grid(), [3, 16, 1]);
}

/// Every bucket's entry points exist in the .cu file, for every dtype, and the launch
/// constants here are the kernels' (threads per block, forward query rows).
#[test]
fn every_bucket_has_entry_points() {
    let src = std::fs::read_to_string(CU).unwrap();
    assert!(src.contains(&format!("#define FA_THREADS {THREADS}\n")));
    assert!(src.contains(&format!("constexpr int BQ = {FWD_ROWS}, BK = 32,")));
    assert_eq!(DOT_ROWS, THREADS as usize / 32);
    for (b, bk) in BUCKETS {
        for ty in ["f32", "bf16", "f16"] {
            let line = format!("ENTRY_POINTS(d{b}_{ty}, ");
            let at = src.find(&line).unwrap_or_else(|| panic!("no {line}"));
            let rest = &src[at..src[at..].find(')').unwrap() + at];
            assert!(rest.ends_with(&format!("{b}, {bk}, 16")), "{rest}");
        }
    }
}
