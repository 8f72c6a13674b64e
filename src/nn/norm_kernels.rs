//! The norm and GEGLU CUDA kernels (src/nn/kernels/norm.cu) run under the host emulation
//! ([`crate::kernel_emu`]) against the composed `*_reference` ops on the CPU: forward, the saved
//! statistics and every gradient, in f32 and bf16, launched with the geometry of
//! [`super::norm_launch`] at small block and chunk sizes so that a group spans several blocks,
//! each thread loops over several elements, and rows are not a multiple of a block.
//!
//! The formulas are in the headers of group_norm.rs, layer_norm.rs and geglu.rs. Gradients are
//! those of `L = Σ out·r` with `r` the fixed fill of [`super::test_util::output_and_grads`], so
//! the kernels' backward gets `r` (in the output dtype) as the upstream gradient. Every output
//! buffer starts as NaN, so an element a kernel forgets to write fails the comparison.

use candle_core::{DType, Tensor, WithDType};

use super::norm_launch::{entry, geglu_grid, GnGeometry, LnGeometry, Tuning};
use super::test_util::{fill, output_and_grads, rel_err};
use crate::kernel_emu::{self, Arg, Elem};

const CU: &str = "src/nn/kernels/norm.cu";

/// One warp per block and 24-element chunks: a 70-element group takes 3 blocks (the last one
/// ragged), layer-norm tiles of 3 rows, and a one-block GEGLU grid whose grid-stride loop goes
/// round.
const ONE_WARP: Tuning = Tuning {
    threads: 32,
    gn_chunk: 24,
    gn_max_chunks: 1024,
    ln_rows_per_chunk: 3,
    ln_tile_rows: 2,
    geglu_max_blocks: 1,
};

/// Two warps per block (the cross-warp reduction) and chunks longer than a block, so each
/// thread sums several elements of its chunk.
const TWO_WARPS: Tuning = Tuning {
    threads: 64,
    gn_chunk: 100,
    gn_max_chunks: 1024,
    ln_rows_per_chunk: 4,
    ln_tile_rows: 3,
    geglu_max_blocks: 65535,
};

fn launch(stem: &str, dtype: DType, grid: [u32; 3], block: [u32; 3], args: &mut [Arg]) {
    let name = entry(stem, dtype).unwrap();
    kernel_emu::launch(CU, &name, grid, block, args)
}

fn host<T: WithDType>(t: &Tensor) -> Vec<T> {
    t.to_dtype(T::DTYPE)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<T>()
        .unwrap()
}

fn nan<T: WithDType>(n: usize) -> Vec<T> {
    vec![T::from_f64(f64::NAN); n]
}

fn tensor<T: WithDType>(v: Vec<T>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &candle_core::Device::Cpu).unwrap()
}

/// `got` within `tol` of `want` relative to `want`'s largest magnitude, every element written
/// (finite: the outputs start as NaN, which a max-reduction would skip), and for bf16 rounded
/// once to nearest even, as the reference is ([`assert_rounded_once`]).
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let unwritten = host::<f32>(got).iter().filter(|v| !v.is_finite()).count();
    assert_eq!(
        unwritten, 0,
        "{what}: {unwritten} elements not written (or not finite)"
    );
    let e = rel_err(got, want);
    assert!(
        e <= tol,
        "{what}: differs by {e:.2e} (relative), tolerance {tol:.0e}"
    );
    assert_rounded_once(what, got, want);
}

/// For bf16 and f16: at least 90% of the elements bit-identical to the reference. Both round nearly
/// equal f32 values once to nearest even, so they differ only where an f32 value sits near a
/// rounding boundary; truncation (or rounding twice) changes about half of them, which the
/// relative tolerance, a bf16 ulp wide, does not see.
fn assert_rounded_once(what: &str, got: &Tensor, want: &Tensor) {
    // Both half types compared as their bits.
    let bits = |t: &Tensor| -> Vec<u16> {
        match t.dtype() {
            DType::BF16 => host::<half::bf16>(t).iter().map(|v| v.to_bits()).collect(),
            DType::F16 => host::<half::f16>(t).iter().map(|v| v.to_bits()).collect(),
            _ => Vec::new(),
        }
    };
    let (g, w) = (bits(got), bits(want));
    if g.is_empty() {
        return;
    }
    let same = g.iter().zip(&w).filter(|(a, b)| a == b).count();
    let share = same as f64 / g.len() as f64;
    assert!(
        share >= 0.9,
        "{what}: only {:.0}% of half-precision elements match the reference's rounding",
        share * 100.0
    );
}

/// Per-(sample, group) mean and 1/σ of `x` `[B, C, ...]` in f64, for the saved statistics.
fn group_stats(x: &Tensor, groups: usize, eps: f64) -> (Vec<f32>, Vec<f32>) {
    let v: Vec<f32> = host(x);
    let n = v.len() / (x.dim(0).unwrap() * groups);
    let (mut mean, mut rstd) = (Vec::new(), Vec::new());
    for g in v.chunks(n) {
        let m = g.iter().map(|&a| a as f64).sum::<f64>() / n as f64;
        let var = g.iter().map(|&a| (a as f64 - m).powi(2)).sum::<f64>() / n as f64;
        mean.push(m as f32);
        rstd.push((1.0 / (var + eps).sqrt()) as f32);
    }
    (mean, rstd)
}

fn assert_stats(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let scale = want.iter().fold(1e-12f32, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (g - w).abs() / scale;
        assert!(e <= tol, "{what}[{i}]: {g} vs {w}");
    }
}

mod geglu {
    use super::*;
    use crate::nn::geglu_reference;

    /// The kernels' output and `dp` for `p` `[.., 2I]` and upstream `g` `[.., I]`.
    fn run<T: Elem + WithDType>(p: &Tensor, g: &Tensor, t: Tuning) -> (Tensor, Tensor) {
        let dims = p.dims().to_vec();
        let inner = dims[dims.len() - 1] / 2;
        let n = p.elem_count() / 2;
        let (ps, gs): (Vec<T>, Vec<T>) = (host(p), host(g));
        let (mut out, mut dp) = (nan::<T>(n), nan::<T>(2 * n));
        let (grid, block) = (geglu_grid(n, t), [t.threads, 1, 1]);
        launch(
            "geglu_fwd",
            T::DTYPE,
            grid,
            block,
            &mut [
                Arg::out(&mut out),
                Arg::input(&ps),
                Arg::Int(n as i64),
                Arg::Int(inner as i64),
            ],
        );
        launch(
            "geglu_bwd",
            T::DTYPE,
            grid,
            block,
            &mut [
                Arg::out(&mut dp),
                Arg::input(&ps),
                Arg::input(&gs),
                Arg::Int(n as i64),
                Arg::Int(inner as i64),
            ],
        );
        let mut out_dims = dims.clone();
        *out_dims.last_mut().unwrap() = inner;
        (tensor(out, &out_dims), tensor(dp, &dims))
    }

    fn check<T: Elem + WithDType>(dims: &[usize], t: Tuning, tol: f32) {
        let p = fill(dims, 11, 3.0).to_dtype(T::DTYPE).unwrap();
        // The f32 reference on the same (rounded) values, rounded once at the end.
        let reference =
            |a: &[Tensor]| geglu_reference(&a[0].to_dtype(DType::F32)?)?.to_dtype(T::DTYPE);
        let (want, grads) = output_and_grads(std::slice::from_ref(&p), &[true], &reference);
        let g = fill(want.dims(), 99, 1.0).to_dtype(T::DTYPE).unwrap();
        let (out, dp) = run::<T>(&p, &g, t);
        let what = format!("geglu {dims:?} {:?}", T::DTYPE);
        assert_close(&format!("{what} forward"), &out, &want, tol);
        assert_close(&format!("{what} dp"), &dp, grads[0].as_ref().unwrap(), tol);
    }

    /// Odd I (7 features per half, 5 rows: 35 outputs over one 32-thread block, so the
    /// grid-stride loop goes round). Catches `a` and `z` read from the wrong halves (a row
    /// stride of I instead of 2I), `Φ(z)` where `gelu'(z) = Φ(z) + z·φ(z)` belongs, a wrong
    /// `φ` normalisation, `da`/`dz` written to the wrong half, and a grid-stride loop that stops
    /// after one pass.
    #[test]
    fn geglu_kernels_match_the_reference_in_f32() {
        check::<f32>(&[5, 14], ONE_WARP, 1e-5);
        check::<f32>(&[2, 3, 22], TWO_WARPS, 1e-5);
    }

    /// bf16 and f16 reads and writes with f32 math: catches math in half precision (an error of
    /// 1e-2 and more where `a·gelu(z)` is rounded twice), an entry point that stores in the
    /// wrong format, and a store that truncates instead of rounding to nearest even.
    #[test]
    fn geglu_kernels_match_the_reference_in_bf16_and_f16() {
        check::<half::bf16>(&[5, 14], ONE_WARP, 1e-2);
        check::<half::f16>(&[5, 14], ONE_WARP, 2e-3);
    }
}

mod group_norm {
    use super::*;
    use crate::nn::{group_norm_reference, group_norm_silu_reference};

    /// Large enough that `1/sqrt(var) + eps` or `1/sqrt(var + eps²)` shows at f32 tolerance.
    const EPS: f64 = 0.05;

    /// What the kernels produce for one input.
    struct Run {
        y: Tensor,
        mean: Vec<f32>,
        rstd: Vec<f32>,
        dx: Tensor,
        dgamma: Tensor,
        dbeta: Tensor,
    }

    fn ints<'a>(v: &[u32]) -> Vec<Arg<'a>> {
        v.iter().map(|&v| Arg::Int(v as i64)).collect()
    }

    /// The forward (`gn_stats`, `gn_fwd`) and backward (`gn_bwd_sums`, `gn_bwd_dx`,
    /// `gn_bwd_params`) as the CUDA path launches them; `a` = `[x, γ, β]`, `g` the upstream
    /// gradient.
    fn run<T: Elem + WithDType>(
        a: &[Tensor],
        g: &Tensor,
        groups: usize,
        silu: bool,
        t: Tuning,
    ) -> Run {
        let geo = GnGeometry::new(a[0].dims(), groups, t).unwrap();
        let (xs, gs): (Vec<T>, Vec<T>) = (host(&a[0]), host(g));
        let (gamma, beta): (Vec<f32>, Vec<f32>) = (host(&a[1]), host(&a[2]));
        let (grid, block) = (geo.grid(), [t.threads, 1, 1]);
        let shape = [geo.groups, geo.cpg, geo.hw, geo.chunk];
        let silu = silu as u32;
        let (n, c) = (xs.len(), geo.channels as usize);

        let mut part = nan::<f32>(geo.fwd_partials());
        let mut args = vec![Arg::out(&mut part), Arg::input(&xs)];
        args.extend(ints(&shape));
        launch("gn_stats", T::DTYPE, grid, block, &mut args);

        let (mut y, mut mean, mut rstd) = (nan::<T>(n), nan(geo.stats_len()), nan(geo.stats_len()));
        let mut args = vec![Arg::out(&mut y), Arg::out(&mut mean), Arg::out(&mut rstd)];
        args.extend([
            Arg::input(&xs),
            Arg::input(&gamma),
            Arg::input(&beta),
            Arg::input(&part),
        ]);
        args.extend(ints(&shape));
        args.extend([Arg::F32(EPS as f32), Arg::Int(silu as i64)]);
        launch("gn_fwd", T::DTYPE, grid, block, &mut args);

        // Every backward kernel reads x, g, γ, β and the statistics, in that order.
        let inputs = || {
            [Arg::input(&xs), Arg::input(&gs)]
                .into_iter()
                .chain([&gamma, &beta, &mean, &rstd].map(|v| Arg::input(v)))
        };
        let mut part = nan::<f32>(geo.bwd_partials());
        let mut args = vec![Arg::out(&mut part)];
        args.extend(inputs());
        args.extend(ints(&shape));
        args.extend(ints(&[silu]));
        launch("gn_bwd_sums", T::DTYPE, grid, block, &mut args);

        let mut dx = nan::<T>(n);
        let mut args = vec![Arg::out(&mut dx)];
        args.extend(inputs());
        args.push(Arg::input(&part));
        args.extend(ints(&shape));
        args.extend(ints(&[silu]));
        launch("gn_bwd_dx", T::DTYPE, grid, block, &mut args);

        let mut dparams = nan::<f32>(2 * c);
        let mut args = vec![Arg::out(&mut dparams)];
        args.extend(inputs());
        args.extend(ints(&[geo.batch, geo.channels, geo.groups, geo.hw, silu]));
        launch(
            "gn_bwd_params",
            T::DTYPE,
            geo.params_grid(),
            block,
            &mut args,
        );

        let dims = a[0].dims();
        Run {
            y: tensor(y, dims),
            mean,
            rstd,
            dx: tensor(dx, dims),
            dgamma: tensor(dparams[..c].to_vec(), &[c]),
            dbeta: tensor(dparams[c..].to_vec(), &[c]),
        }
    }

    /// `x` with a per-channel offset (so chunk means differ and a dropped mean term or a wrong
    /// channel shows), `γ`, `β` far from 1 and 0; `x` in `T`, `γ`, `β` f32 (autocast).
    fn inputs<T: WithDType>(dims: &[usize]) -> Vec<Tensor> {
        let c = dims[1];
        let mut offset_shape = vec![1; dims.len()];
        offset_shape[1] = c;
        let offset = Tensor::arange(0f32, c as f32, &candle_core::Device::Cpu)
            .unwrap()
            .reshape(offset_shape)
            .unwrap();
        let x = fill(dims, 1, 2.0).broadcast_add(&offset).unwrap();
        let w = (fill(&[c], 2, 1.0) + 1.5).unwrap();
        let b = fill(&[c], 3, 0.8);
        vec![x.to_dtype(T::DTYPE).unwrap(), w, b]
    }

    fn check<T: Elem + WithDType>(dims: &[usize], groups: usize, silu: bool, t: Tuning, tol: f32) {
        let a = inputs::<T>(dims);
        // The f32 reference on the same (rounded) values, rounded once at the end (the bf16
        // reference would round the norm's output before the SiLU).
        let reference = |a: &[Tensor]| {
            let x = a[0].to_dtype(DType::F32)?;
            if silu {
                group_norm_silu_reference(&x, &a[1], &a[2], groups, EPS)
            } else {
                group_norm_reference(&x, &a[1], &a[2], groups, EPS)
            }?
            .to_dtype(T::DTYPE)
        };
        let (want, grads) = output_and_grads(&a, &[true; 3], &reference);
        let g = fill(want.dims(), 99, 1.0).to_dtype(T::DTYPE).unwrap();
        let got = run::<T>(&a, &g, groups, silu, t);
        let what = format!(
            "group norm {dims:?}/{groups} silu {silu} {:?} {t:?}",
            T::DTYPE
        );
        let (mean, rstd) = group_stats(&a[0], groups, EPS);
        assert_stats(&format!("{what} mean"), &got.mean, &mean, 1e-5);
        assert_stats(&format!("{what} rstd"), &got.rstd, &rstd, 1e-5);
        assert_close(&format!("{what} forward"), &got.y, &want, tol);
        let grad = |i: usize| grads[i].as_ref().unwrap();
        assert_close(&format!("{what} dx"), &got.dx, grad(0), tol);
        assert_close(&format!("{what} dγ"), &got.dgamma, grad(1), tol);
        assert_close(&format!("{what} dβ"), &got.dbeta, grad(2), tol);
    }

    /// `[2, 6, 5, 7]` in 3 groups (70-element groups of 2 channels, odd spatial) over 3 ragged
    /// one-warp chunks, and over one 64-thread chunk where threads take 2 elements each; a
    /// larger `[3, 8, 9, 11]` in 2 groups (396 elements: 4 chunks of 100) besides. Catches a
    /// chunk's partials merged without the `n_c·(μ_c − μ)²` term, a chunk index or count that
    /// skips or repeats elements, a channel taken as `i % hw` or without the group's offset
    /// (γ, β of the wrong channel, or reads past the end under ASan), `eps` added outside the
    /// square root, a dropped `mean dŷ` or `x̂·mean(dŷ·x̂)` term, `γ` left out of `dŷ`, and `dγ`
    /// or `dβ` overwritten per sample instead of summed over the batch.
    #[test]
    fn group_norm_kernels_match_the_reference_in_f32() {
        for t in [ONE_WARP, TWO_WARPS] {
            check::<f32>(&[2, 6, 5, 7], 3, false, t, 1e-5);
        }
        check::<f32>(&[3, 8, 9, 11], 2, false, TWO_WARPS, 1e-5);
    }

    /// The fused SiLU: catches the SiLU left out of the forward, its derivative dropped from
    /// `g_y` (or only its `σ(y)` factor kept), and `y` recomputed without `β`.
    #[test]
    fn group_norm_silu_kernels_match_the_reference_in_f32() {
        check::<f32>(&[2, 6, 5, 7], 3, true, ONE_WARP, 1e-5);
        check::<f32>(&[3, 8, 9, 11], 2, true, TWO_WARPS, 1e-5);
    }

    /// bf16 and f16 activations, f32 statistics and parameter gradients: catches the half
    /// entry points reading or writing another format, and statistics accumulated in half
    /// precision.
    #[test]
    fn group_norm_kernels_match_the_reference_in_bf16_and_f16() {
        for silu in [false, true] {
            check::<half::bf16>(&[2, 6, 5, 7], 3, silu, ONE_WARP, 1e-2);
            check::<half::f16>(&[2, 6, 5, 7], 3, silu, ONE_WARP, 2e-3);
        }
    }
}

mod layer_norm {
    use super::*;
    use crate::nn::layer_norm_reference;

    const EPS: f64 = 0.05;

    struct Run {
        y: Tensor,
        mean: Vec<f32>,
        rstd: Vec<f32>,
        dx: Tensor,
        dgamma: Tensor,
        dbeta: Tensor,
    }

    /// `ln_fwd`, `ln_bwd_dx`, `ln_bwd_params_part` and `ln_bwd_params_finish` as the CUDA path
    /// launches them; `a` = `[x, γ, β]`, `g` the upstream gradient.
    fn run<T: Elem + WithDType>(a: &[Tensor], g: &Tensor, t: Tuning) -> Run {
        let dims = a[0].dims();
        let d = dims[dims.len() - 1];
        let rows = a[0].elem_count() / d;
        let geo = LnGeometry::new(rows, d, t).unwrap();
        let (xs, gs): (Vec<T>, Vec<T>) = (host(&a[0]), host(g));
        let (gamma, beta): (Vec<f32>, Vec<f32>) = (host(&a[1]), host(&a[2]));
        let block = [t.threads, 1, 1];
        let size = || [Arg::Int(rows as i64), Arg::Int(d as i64)];

        let (mut y, mut mean, mut rstd) = (nan::<T>(xs.len()), nan(rows), nan(rows));
        let mut args = vec![Arg::out(&mut y), Arg::out(&mut mean), Arg::out(&mut rstd)];
        args.extend([Arg::input(&xs), Arg::input(&gamma), Arg::input(&beta)]);
        args.extend(size());
        args.push(Arg::F32(EPS as f32));
        launch("ln_fwd", T::DTYPE, geo.rows_grid(), block, &mut args);

        let mut dx = nan::<T>(xs.len());
        let mut args = vec![Arg::out(&mut dx), Arg::input(&xs), Arg::input(&gs)];
        args.extend([Arg::input(&gamma), Arg::input(&mean), Arg::input(&rstd)]);
        args.extend(size());
        launch("ln_bwd_dx", T::DTYPE, geo.rows_grid(), block, &mut args);

        let mut part = nan::<f32>(geo.partials());
        let mut args = vec![Arg::out(&mut part), Arg::input(&xs), Arg::input(&gs)];
        args.extend([Arg::input(&mean), Arg::input(&rstd)]);
        args.extend(size());
        args.push(Arg::Int(geo.rows_per_chunk as i64));
        let (grid, tile) = geo.part_grid();
        launch("ln_bwd_params_part", T::DTYPE, grid, tile, &mut args);

        let mut dparams = nan::<f32>(2 * d);
        let mut args = vec![Arg::out(&mut dparams), Arg::input(&part)];
        args.extend([Arg::Int(geo.chunks as i64), Arg::Int(d as i64)]);
        kernel_emu::launch(
            CU,
            "ln_bwd_params_finish",
            geo.finish_grid(),
            block,
            &mut args,
        );

        Run {
            y: tensor(y, dims),
            mean,
            rstd,
            dx: tensor(dx, dims),
            dgamma: tensor(dparams[..d].to_vec(), &[d]),
            dbeta: tensor(dparams[d..].to_vec(), &[d]),
        }
    }

    /// Per-row offsets, `γ`, `β` far from 1 and 0.
    fn inputs<T: WithDType>(dims: &[usize]) -> Vec<Tensor> {
        let d = dims[dims.len() - 1];
        let rows = dims.iter().product::<usize>() / d;
        let offset = Tensor::arange(0f32, rows as f32, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((rows, 1))
            .unwrap();
        let x = fill(&[rows, d], 4, 2.0)
            .broadcast_add(&offset)
            .unwrap()
            .reshape(dims)
            .unwrap();
        let w = (fill(&[d], 5, 1.0) + 1.5).unwrap();
        let b = fill(&[d], 6, 0.8);
        vec![x.to_dtype(T::DTYPE).unwrap(), w, b]
    }

    fn check<T: Elem + WithDType>(dims: &[usize], t: Tuning, tol: f32) {
        let a = inputs::<T>(dims);
        let reference = |a: &[Tensor]| {
            layer_norm_reference(&a[0].to_dtype(DType::F32)?, &a[1], &a[2], EPS)?.to_dtype(T::DTYPE)
        };
        let (want, grads) = output_and_grads(&a, &[true; 3], &reference);
        let g = fill(want.dims(), 99, 1.0).to_dtype(T::DTYPE).unwrap();
        let got = run::<T>(&a, &g, t);
        let what = format!("layer norm {dims:?} {:?} {t:?}", T::DTYPE);
        let d = dims[dims.len() - 1];
        let (mean, rstd) = group_stats(&a[0].reshape(((), d, 1)).unwrap(), 1, EPS);
        assert_stats(&format!("{what} mean"), &got.mean, &mean, 1e-5);
        assert_stats(&format!("{what} rstd"), &got.rstd, &rstd, 1e-5);
        assert_close(&format!("{what} forward"), &got.y, &want, tol);
        let grad = |i: usize| grads[i].as_ref().unwrap();
        assert_close(&format!("{what} dx"), &got.dx, grad(0), tol);
        assert_close(&format!("{what} dγ"), &got.dgamma, grad(1), tol);
        assert_close(&format!("{what} dβ"), &got.dbeta, grad(2), tol);
    }

    /// Rows of 45 (one warp loops one and a half times; 2 column tiles, the second ragged) and
    /// 10 or 11 rows (not a multiple of the warps per block, and 3 or 4 row chunks in
    /// the parameter-gradient tiles). Catches a row's mean or variance over 32 instead of `d`,
    /// `eps` outside the square root, a dropped `mean dŷ` or `x̂·mean(dŷ·x̂)` term, a tile that
    /// sums only its first row, the finishing pass keeping the last chunk instead of summing
    /// (`=` for `+=`), and columns past `d` read or written (ASan, guard bytes).
    #[test]
    fn layer_norm_kernels_match_the_reference_in_f32() {
        check::<f32>(&[2, 5, 45], ONE_WARP, 1e-5);
        check::<f32>(&[11, 45], TWO_WARPS, 1e-5);
    }

    /// bf16 and f16 activations: catches a half entry point reading or writing another format.
    #[test]
    fn layer_norm_kernels_match_the_reference_in_bf16_and_f16() {
        check::<half::bf16>(&[2, 5, 45], ONE_WARP, 1e-2);
        check::<half::f16>(&[2, 5, 45], ONE_WARP, 2e-3);
    }
}
