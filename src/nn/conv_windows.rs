//! Convolution gradients in bands of rows, so that their columns never pass a budget: the plan of
//! the bands and the two drivers, shared by the CPU (`cpu_conv`) and CUDA (`conv_cuda`) paths,
//! which supply the column kernels.
//!
//! The columns of a conv's input gradient (`Wᵀ·G`, `[C_in·k_h·k_w, B·N]`) are `k_h·k_w` times the
//! size of the gradient they sum to: for SDXL's 960-channel 3×3 conv at 1024 px, 270 MiB of bf16
//! (540 MiB of f32 on the CPU) for a 30 MiB result, live at once inside the backward of the
//! segment that holds the step's peak. Built band by band, a band of input rows at a time from
//! the output rows that reach it ([`ConvGeometry::out_rows_reaching`]), they take at most the
//! budget, for a few rows of the GEMM done twice where bands meet (`⌈(k_h − 1)/s⌉` output rows per
//! band). Each input element still sums every contribution at once, in one place, so the result
//! is the one-band result (up to the GEMM's own rounding).
//!
//! A weight gradient `G · colsᵀ` sums over the pixels, so its bands are bands of output rows with
//! no overlap; their partial products are summed in f32 and rounded once to the gradient's dtype.

use std::ops::Range;

use candle_core::{DType, Result, Tensor};

use super::im2col::ConvGeometry;
pub use super::im2col::RowWindow;

/// The bands of input rows an input gradient is built in: each band's columns (the output rows
/// reaching it, `batch` images, `elem_bytes` per entry) take about `budget` bytes at most, and at
/// least one output row's worth; one band when all the columns fit.
pub fn input_windows(
    geo: &ConvGeometry,
    batch: usize,
    elem_bytes: usize,
    budget: usize,
) -> Vec<RowWindow> {
    let x_h = geo.x_hw.0;
    let (k_h, k_w) = geo.k_hw;
    let whole = 0..x_h;
    let reach = geo.out_rows_reaching(&whole);
    let row_bytes = (geo.c_in * k_h * k_w * batch * geo.g_hw.1 * elem_bytes).max(1);
    if reach.len() * row_bytes <= budget || x_h <= 1 {
        return vec![RowWindow {
            input: whole,
            output: reach,
        }];
    }
    let s = geo.stride.max(1);
    let out_rows = budget / row_bytes;
    // A band of m·s input rows is reached by about m + ⌈(k_h − 1)/s⌉ output rows.
    let m = out_rows.saturating_sub((k_h - 1).div_ceil(s)).max(1);
    let band = m * s;
    (0..x_h)
        .step_by(band)
        .map(|y0| {
            let input = y0..(y0 + band).min(x_h);
            RowWindow {
                output: geo.out_rows_reaching(&input),
                input,
            }
        })
        .collect()
}

/// The bands of output rows a weight gradient is built in: each band's columns (`row_bytes` per
/// output row) take at most `budget` bytes, and at least one row.
pub fn output_windows(g_h: usize, row_bytes: usize, budget: usize) -> Vec<Range<usize>> {
    let rows = (budget / row_bytes.max(1)).clamp(1, g_h.max(1));
    (0..g_h)
        .step_by(rows)
        .map(|r0| r0..(r0 + rows).min(g_h))
        .collect()
}

/// `∂L/∂x = col2im(Wᵀ · G)` band by band, for `geo`. `w_t` is `Wᵀ`, `[C_in·k_h·k_w, C_out]`;
/// `grad` is `[B, C_out, g_h, g_w]` in `w_t`'s dtype; `col2im` turns one band's columns
/// (`[C_in·k_h·k_w, B·rows·g_w]`, the images side by side) into that band's input rows,
/// `[B, C_in, rows, x_w]`, in `out_dtype` (the bands are joined in it).
pub fn input_grad_in_windows(
    grad: &Tensor,
    w_t: &Tensor,
    geo: &ConvGeometry,
    windows: &[RowWindow],
    out_dtype: DType,
    col2im: impl Fn(&Tensor, &RowWindow) -> Result<Tensor>,
) -> Result<Tensor> {
    let (batch, _, _, _) = grad.dims4()?;
    let mut parts = Vec::with_capacity(windows.len());
    for window in windows {
        if window.output.is_empty() {
            // Input rows no output row reads (a 1×1 conv of stride 2 with padding skips some):
            // a zero gradient.
            let shape = (batch, geo.c_in, window.input.len(), geo.x_hw.1);
            parts.push(Tensor::zeros(shape, out_dtype, grad.device())?);
            continue;
        }
        let g = grad.narrow(2, window.output.start, window.output.len())?;
        let cols = w_t.matmul(&channels_first(&g)?)?;
        parts.push(col2im(&cols, window)?);
    }
    if parts.len() == 1 {
        if let Some(only) = parts.pop() {
            return Ok(only);
        }
    }
    Tensor::cat(&parts, 2)
}

/// `∂L/∂W = Σ_bands G_band · cols_bandᵀ`, `[C_out, C_in·k_h·k_w]` in `grad`'s dtype. `columns`
/// gives the columns of a band of output rows (`[C_in·k_h·k_w, B·rows·g_w]`, the images side by
/// side, in `grad`'s dtype). One band is one GEMM; more are summed in f32 and rounded once.
pub fn weight_grad_in_windows(
    grad: &Tensor,
    windows: &[Range<usize>],
    columns: impl Fn(Range<usize>) -> Result<Tensor>,
) -> Result<Tensor> {
    let band = |rows: &Range<usize>| -> Result<Tensor> {
        let g = grad.narrow(2, rows.start, rows.len())?;
        channels_first(&g)?.matmul(&columns(rows.clone())?.t()?)
    };
    match windows {
        [] => candle_core::bail!("conv2d weight grad: no output rows"),
        [only] => band(only),
        [first, rest @ ..] => {
            let mut sum = band(first)?.to_dtype(DType::F32)?;
            for rows in rest {
                sum = (sum + band(rows)?.to_dtype(DType::F32)?)?;
            }
            sum.to_dtype(grad.dtype())
        }
    }
}

/// `[B, C, H, W]` → `[C, B·H·W]`, contiguous (the images side by side in each row).
pub fn channels_first(t: &Tensor) -> Result<Tensor> {
    let (b, c, h, w) = t.dims4()?;
    if b == 1 {
        return t.contiguous()?.reshape((c, h * w));
    }
    t.reshape((b, c, h * w))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((c, b * h * w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::im2col::{col2im, col2im_window};

    /// (kernel, padding, stride): every one SD models use, and two they do not.
    const CASES: [(usize, usize, usize); 6] = [
        (3, 1, 1),
        (3, 1, 2),
        (1, 0, 1),
        (3, 0, 1),
        (1, 0, 2),
        (3, 2, 1),
    ];
    const SIZES: [(usize, usize); 4] = [(8, 8), (7, 9), (6, 5), (13, 4)];

    fn geometry((k, p, s): (usize, usize, usize), (h, w): (usize, usize)) -> ConvGeometry {
        let out = |len| ConvGeometry::output_len(len, k, p, s).unwrap_or(0);
        ConvGeometry {
            c_in: 3,
            x_hw: (h, w),
            k_hw: (k, k),
            g_hw: (out(h), out(w)),
            padding: p,
            stride: s,
        }
    }

    /// The output rows reaching a band are exactly those with a tap inside it, by brute force
    /// over every band of every size: one more or one fewer row (an off-by-one in either bound,
    /// a floor for a ceiling) fails.
    #[test]
    fn the_output_rows_reaching_a_band_are_those_with_a_tap_in_it() {
        for case in CASES {
            for size in SIZES {
                let geo = geometry(case, size);
                let (k, p, s) = case;
                for y0 in 0..size.0 {
                    for y1 in y0..=size.0 {
                        let want: Vec<usize> = (0..geo.g_hw.0)
                            .filter(|oy| {
                                (0..k).any(|u| {
                                    let iy = (oy * s + u) as i64 - p as i64;
                                    iy >= y0 as i64 && iy < y1 as i64
                                })
                            })
                            .collect();
                        let got: Vec<usize> = geo.out_rows_reaching(&(y0..y1)).collect();
                        assert_eq!(got, want, "{case:?} {size:?} rows {y0}..{y1}");
                    }
                }
            }
        }
    }

    /// The bands cover every input row once, in order, each with the output rows reaching it,
    /// and each band's columns stay within the budget once it holds the rows a band needs.
    #[test]
    fn the_bands_cover_the_input_once_within_the_budget() {
        for case in CASES {
            for size in SIZES {
                let geo = geometry(case, size);
                let row_bytes = 3 * case.0 * case.0 * 2 * geo.g_hw.1 * 4;
                for rows in [0, 1, 2, 3, 5, usize::MAX / row_bytes] {
                    let budget = rows * row_bytes;
                    let windows = input_windows(&geo, 2, 4, budget);
                    let covered: Vec<usize> =
                        windows.iter().flat_map(|w| w.input.clone()).collect();
                    assert_eq!(
                        covered,
                        (0..size.0).collect::<Vec<_>>(),
                        "{case:?} {size:?}"
                    );
                    for w in &windows {
                        assert_eq!(w.output, geo.out_rows_reaching(&w.input));
                        let reach = case.0.div_ceil(case.2) + 1;
                        if rows > reach {
                            assert!(w.output.len() * row_bytes <= budget, "{case:?} {w:?}");
                        }
                    }
                    if rows >= geo.g_hw.0 {
                        assert_eq!(windows.len(), 1, "{case:?} {size:?}: fits in one band");
                    }
                }
            }
        }
        let sdxl = ConvGeometry {
            c_in: 960,
            x_hw: (128, 128),
            k_hw: (3, 3),
            g_hw: (128, 128),
            padding: 1,
            stride: 1,
        };
        // SDXL's largest input gradient at 1024 px, 270 MiB of bf16 columns in one band.
        assert_eq!(input_windows(&sdxl, 1, 2, 64 << 20).len(), 5);
        assert_eq!(input_windows(&sdxl, 1, 2, 512 << 20).len(), 1);
    }

    /// Two images side by side, col2im band by band equals col2im of each whole image, bit for
    /// bit (each element sums the same entries in the same order): a band that drops an edge
    /// row's contribution, reads the wrong image's block or writes a row off by one fails.
    #[test]
    fn col2im_band_by_band_equals_the_whole() {
        for case in CASES {
            for size in SIZES {
                let geo = geometry(case, size);
                if geo.g_hw.0 == 0 {
                    continue;
                }
                let (taps, n) = (case.0 * case.0, geo.g_hw.0 * geo.g_hw.1);
                let cols: Vec<f32> = (0..3 * taps * 2 * n)
                    .map(|i| ((i * 37 % 101) as f32) * 0.37 - 17.0)
                    .collect();
                // The whole, image by image, from the side-by-side layout.
                let want: Vec<f32> = (0..2)
                    .flat_map(|b| {
                        let image: Vec<f32> = (0..3 * taps)
                            .flat_map(|r| cols[(r * 2 + b) * n..(r * 2 + b + 1) * n].to_vec())
                            .collect();
                        col2im(&image, &geo)
                    })
                    .collect();
                let row_bytes = 3 * taps * 2 * geo.g_hw.1 * 4;
                for budget in [0, 2 * row_bytes, 4 * row_bytes] {
                    let mut got = vec![f32::NAN; want.len()];
                    for w in input_windows(&geo, 2, 4, budget) {
                        let band_cols: Vec<f32> = (0..3 * taps * 2)
                            .flat_map(|rb| {
                                let at = rb * n + w.output.start * geo.g_hw.1;
                                cols[at..at + w.output.len() * geo.g_hw.1].to_vec()
                            })
                            .collect();
                        let band = col2im_window(&band_cols, &geo, 2, &w);
                        let rows = w.input.len() * size.1;
                        for (bc, plane) in band.chunks(rows.max(1)).enumerate().take(6) {
                            let at = bc * size.0 * size.1 + w.input.start * size.1;
                            got[at..at + rows].copy_from_slice(&plane[..rows]);
                        }
                    }
                    assert_eq!(got, want, "{case:?} {size:?} budget {budget}");
                }
            }
        }
    }

    #[test]
    fn output_bands_cover_the_rows_once() {
        assert_eq!(output_windows(5, 10, 25), vec![0..2, 2..4, 4..5]);
        assert_eq!(output_windows(5, 10, 0), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(output_windows(5, 10, 1000), vec![0..5]);
    }
}
