//! im2col and its adjoint col2im, for convolution on the CPU as GEMM (`cpu_conv`).
//!
//! For `y = conv2d(x, w)` (groups 1, dilation 1) on one image, with the columns' rows ordered
//! `(c, u, v)` as the weight's `[c_out, c_in, k_h, k_w]` layout flattens:
//!
//! ```text
//! cols[(c, u, v), (oy, ox)] = x[c, oy·s + u − p, ox·s + v − p]   (0 outside the input)  im2col
//! y  = W · cols                    W: [c_out, c_in·k_h·k_w]
//! ∂L/∂W = G · colsᵀ                G: [c_out, g_h·g_w]
//! ∂L/∂x = col2im(Wᵀ · G)           col2im scatter-adds each entry back where im2col read it
//! ```
//!
//! Each input channel's rows (im2col) or plane (col2im) is handled by one task, so channels run
//! in parallel without atomics. For stride 1 every valid run of a row is one contiguous copy.

use rayon::prelude::*;

/// Geometry of one 2-D convolution, as the input gradient sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvGeometry {
    pub c_in: usize,
    pub x_hw: (usize, usize),
    pub k_hw: (usize, usize),
    pub g_hw: (usize, usize),
    pub padding: usize,
    pub stride: usize,
}

impl ConvGeometry {
    /// The output size of the forward conv for this input, kernel, padding and stride, or `None`
    /// if the kernel does not fit the padded input.
    pub fn output_len(x_len: usize, k: usize, padding: usize, stride: usize) -> Option<usize> {
        (x_len + 2 * padding)
            .checked_sub(k)
            .map(|span| span / stride + 1)
    }

    /// The geometry of a gradient `g_hw` for an `x_hw` input and `k_hw` kernel, or `None` when
    /// that is not the forward's output size.
    pub fn for_gradient(
        c_in: usize,
        x_hw: (usize, usize),
        k_hw: (usize, usize),
        g_hw: (usize, usize),
        padding: usize,
        stride: usize,
    ) -> Option<Self> {
        let fits =
            |x: usize, k: usize, g: usize| Self::output_len(x, k, padding, stride) == Some(g);
        (fits(x_hw.0, k_hw.0, g_hw.0) && fits(x_hw.1, k_hw.1, g_hw.1)).then_some(Self {
            c_in,
            x_hw,
            k_hw,
            g_hw,
            padding,
            stride,
        })
    }

    /// The output rows whose columns reach input rows `in_rows`: every `oy` with
    /// `oy·s + u − p` in `in_rows` for some tap `u` (empty for empty `in_rows`). The input
    /// gradient of those input rows needs these output rows' columns and no others.
    pub fn out_rows_reaching(&self, in_rows: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        let g_h = self.g_hw.0;
        if in_rows.is_empty() {
            return 0..0;
        }
        let s = self.stride;
        // oy·s ≥ in_rows.start + p − (k_h − 1)
        let lo = (in_rows.start + self.padding)
            .saturating_sub(self.k_hw.0 - 1)
            .div_ceil(s);
        // oy·s ≤ in_rows.end − 1 + p
        let hi = (in_rows.end - 1 + self.padding) / s + 1;
        lo.min(g_h)..hi.min(g_h)
    }

    fn plane_len(&self) -> usize {
        self.x_hw.0 * self.x_hw.1
    }

    /// The output positions `o` in `0..g_len` whose tap `t` lands inside the input,
    /// `0 ≤ o·s + t − p < x_len`, as a range.
    fn valid(&self, g_len: usize, x_len: usize, t: usize) -> std::ops::Range<usize> {
        let s = self.stride;
        // o·s ≥ p − t
        let lo = self.padding.saturating_sub(t).div_ceil(s);
        // o·s < x_len + p − t
        let hi = (x_len + self.padding)
            .checked_sub(t)
            .map_or(0, |lim| lim.div_ceil(s));
        lo.min(g_len)..hi.min(g_len)
    }
}

/// The columns of one `[c_in, x_h, x_w]` image: `[c_in·k_h·k_w, g_h·g_w]`, row-major (the
/// reference the kernels' tests compare with).
#[cfg(test)]
pub fn im2col(x: &[f32], geo: &ConvGeometry) -> Vec<f32> {
    im2col_rows(x, geo, 0..geo.g_hw.0)
}

/// The columns of output rows `out_rows` only: `[c_in·k_h·k_w, out_rows.len()·g_w]`, the
/// column block of [`im2col`] those rows cover.
pub fn im2col_rows(x: &[f32], geo: &ConvGeometry, out_rows: std::ops::Range<usize>) -> Vec<f32> {
    im2col_batch(x, geo, 1, out_rows)
}

/// The columns of output rows `out_rows` of `batch` images (`x`: `[batch, c_in, x_h, x_w]`),
/// side by side: `[c_in·k_h·k_w, batch·out_rows.len()·g_w]`, each row image after image (the
/// layout the CUDA kernels use).
pub fn im2col_batch(
    x: &[f32],
    geo: &ConvGeometry,
    batch: usize,
    out_rows: std::ops::Range<usize>,
) -> Vec<f32> {
    let (k_h, k_w) = geo.k_hw;
    let taps = k_h * k_w;
    let plane_len = geo.plane_len();
    assert_eq!(x.len(), batch * geo.c_in * plane_len, "im2col: input size");
    assert!(
        out_rows.end <= geo.g_hw.0,
        "im2col: output rows {out_rows:?}"
    );
    let len = out_rows.len() * geo.g_hw.1;
    let mut cols = vec![0f32; geo.c_in * taps * batch * len];
    if len == 0 {
        return cols;
    }
    cols.par_chunks_mut(taps * batch * len)
        .enumerate()
        .for_each(|(c, rows)| {
            for (r, row) in rows.chunks_mut(len).enumerate() {
                let (tap, b) = (r / batch, r % batch);
                let plane = &x[(b * geo.c_in + c) * plane_len..][..plane_len];
                gather_tap(row, plane, geo, (tap / k_w, tap % k_w), &out_rows);
            }
        });
    cols
}

/// Fills one kernel tap's row (`[out_rows.len()·g_w]`, zeroed) from one input plane.
fn gather_tap(
    row: &mut [f32],
    plane: &[f32],
    geo: &ConvGeometry,
    (u, v): (usize, usize),
    out_rows: &std::ops::Range<usize>,
) {
    let (x_h, x_w) = geo.x_hw;
    let (g_h, g_w) = geo.g_hw;
    let (s, p) = (geo.stride, geo.padding);
    let cols = geo.valid(g_w, x_w, v);
    if cols.is_empty() {
        return;
    }
    let valid = geo.valid(g_h, x_h, u);
    for oy in valid.start.max(out_rows.start)..valid.end.min(out_rows.end) {
        let iy = oy * s + u - p;
        let at = (oy - out_rows.start) * g_w;
        let dst = &mut row[at + cols.start..at + cols.end];
        let x0 = cols.start * s + v - p;
        let src = &plane[iy * x_w..(iy + 1) * x_w];
        if s == 1 {
            dst.copy_from_slice(&src[x0..x0 + dst.len()]);
        } else {
            for (d, x) in dst.iter_mut().zip(src[x0..].iter().step_by(s)) {
                *d = *x;
            }
        }
    }
}

/// Scatter-adds `cols` (`[c_in·k_h·k_w, g_h·g_w]`, row-major) onto a zeroed `[c_in, x_h, x_w]`
/// input gradient and returns it (one window of the whole; the reference of the tests).
#[cfg(test)]
pub fn col2im(cols: &[f32], geo: &ConvGeometry) -> Vec<f32> {
    let window = RowWindow {
        input: 0..geo.x_hw.0,
        output: 0..geo.g_hw.0,
    };
    col2im_window(cols, geo, 1, &window)
}

/// A band of input rows and the output rows whose columns reach it
/// ([`ConvGeometry::out_rows_reaching`]): the unit an input gradient is built in when all its
/// columns at once would not fit a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowWindow {
    pub input: std::ops::Range<usize>,
    pub output: std::ops::Range<usize>,
}

/// col2im of a window, for `batch` images side by side: `cols` holds the output rows
/// `window.output` (`[c_in·k_h·k_w, batch·output.len()·g_w]`, each row image after image, the
/// layout the CUDA kernels use), and the result is input rows `window.input` of the gradient,
/// `[batch, c_in, input.len(), x_w]`. Entries landing outside those input rows are skipped, so
/// with `output` reaching all of `input` each element is complete, summed in the order of
/// [`col2im`].
pub fn col2im_window(
    cols: &[f32],
    geo: &ConvGeometry,
    batch: usize,
    window: &RowWindow,
) -> Vec<f32> {
    let (k_h, k_w) = geo.k_hw;
    let taps = k_h * k_w;
    let n = window.output.len() * geo.g_hw.1;
    assert_eq!(cols.len(), geo.c_in * taps * batch * n, "col2im: cols size");
    assert!(
        window.output.end <= geo.g_hw.0 && window.input.end <= geo.x_hw.0,
        "col2im: window {window:?}"
    );
    let plane_len = window.input.len() * geo.x_hw.1;
    let mut out = vec![0f32; batch * geo.c_in * plane_len];
    if plane_len == 0 {
        return out;
    }
    out.par_chunks_mut(plane_len)
        .enumerate()
        .for_each(|(bc, plane)| {
            let (b, c) = (bc / geo.c_in, bc % geo.c_in);
            for tap in 0..taps {
                let at = ((c * taps + tap) * batch + b) * n;
                let row = &cols[at..at + n];
                scatter_tap(plane, row, geo, (tap / k_w, tap % k_w), window);
            }
        });
    out
}

/// Adds one kernel tap's row (`[output.len()·g_w]`) into one input plane's rows
/// `window.input`.
fn scatter_tap(
    plane: &mut [f32],
    row: &[f32],
    geo: &ConvGeometry,
    (u, v): (usize, usize),
    window: &RowWindow,
) {
    let (x_h, x_w) = geo.x_hw;
    let (g_h, g_w) = geo.g_hw;
    let (s, p) = (geo.stride, geo.padding);
    let cols = geo.valid(g_w, x_w, v);
    if cols.is_empty() {
        return;
    }
    let valid = geo.valid(g_h, x_h, u);
    for oy in valid.start.max(window.output.start)..valid.end.min(window.output.end) {
        let iy = oy * s + u - p;
        if !window.input.contains(&iy) {
            continue;
        }
        let at = (oy - window.output.start) * g_w;
        let src = &row[at + cols.start..at + cols.end];
        let x0 = cols.start * s + v - p;
        let y = iy - window.input.start;
        let dst = &mut plane[y * x_w..(y + 1) * x_w];
        if s == 1 {
            for (d, g) in dst[x0..x0 + src.len()].iter_mut().zip(src) {
                *d += g;
            }
        } else {
            for (d, g) in dst[x0..].iter_mut().step_by(s).zip(src) {
                *d += g;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one element at a time, with signed indices.
    fn col2im_naive(cols: &[f32], geo: &ConvGeometry) -> Vec<f32> {
        let ((x_h, x_w), (k_h, k_w), (g_h, g_w)) = (geo.x_hw, geo.k_hw, geo.g_hw);
        let mut out = vec![0f32; geo.c_in * x_h * x_w];
        for c in 0..geo.c_in {
            for u in 0..k_h {
                for v in 0..k_w {
                    for oy in 0..g_h {
                        for ox in 0..g_w {
                            let iy = (oy * geo.stride + u) as i64 - geo.padding as i64;
                            let ix = (ox * geo.stride + v) as i64 - geo.padding as i64;
                            if iy < 0 || ix < 0 || iy >= x_h as i64 || ix >= x_w as i64 {
                                continue;
                            }
                            let r = (c * k_h + u) * k_w + v;
                            out[(c * x_h + iy as usize) * x_w + ix as usize] +=
                                cols[r * g_h * g_w + oy * g_w + ox];
                        }
                    }
                }
            }
        }
        out
    }

    /// im2col by its definition, with signed indices.
    fn im2col_naive(x: &[f32], geo: &ConvGeometry) -> Vec<f32> {
        let ((x_h, x_w), (k_h, k_w), (g_h, g_w)) = (geo.x_hw, geo.k_hw, geo.g_hw);
        let mut cols = vec![0f32; geo.c_in * k_h * k_w * g_h * g_w];
        for c in 0..geo.c_in {
            for u in 0..k_h {
                for v in 0..k_w {
                    for oy in 0..g_h {
                        for ox in 0..g_w {
                            let iy = (oy * geo.stride + u) as i64 - geo.padding as i64;
                            let ix = (ox * geo.stride + v) as i64 - geo.padding as i64;
                            if iy < 0 || ix < 0 || iy >= x_h as i64 || ix >= x_w as i64 {
                                continue;
                            }
                            let r = (c * k_h + u) * k_w + v;
                            cols[r * g_h * g_w + oy * g_w + ox] =
                                x[(c * x_h + iy as usize) * x_w + ix as usize];
                        }
                    }
                }
            }
        }
        cols
    }

    #[test]
    fn matches_the_definition() {
        for (k, p, s) in [
            (3, 1, 1),
            (3, 1, 2),
            (1, 0, 1),
            (3, 0, 1),
            (3, 2, 1),
            (3, 0, 2),
        ] {
            for (x_h, x_w) in [(8, 8), (7, 9), (6, 5), (5, 12), (3, 3)] {
                let g_h = ConvGeometry::output_len(x_h, k, p, s).unwrap();
                let g_w = ConvGeometry::output_len(x_w, k, p, s).unwrap();
                let geo = ConvGeometry {
                    c_in: 3,
                    x_hw: (x_h, x_w),
                    k_hw: (k, k),
                    g_hw: (g_h, g_w),
                    padding: p,
                    stride: s,
                };
                let n = 3 * k * k * g_h * g_w;
                let cols: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
                assert_eq!(
                    col2im(&cols, &geo),
                    col2im_naive(&cols, &geo),
                    "col2im k{k} p{p} s{s} {x_h}x{x_w}"
                );
                let x: Vec<f32> = (0..3 * x_h * x_w).map(|i| (i * 13 % 29) as f32).collect();
                assert_eq!(
                    im2col(&x, &geo),
                    im2col_naive(&x, &geo),
                    "im2col k{k} p{p} s{s} {x_h}x{x_w}"
                );
            }
        }
    }
}
