//! The im2col and col2im CUDA kernels (src/nn/kernels/conv.cu) run under the host emulation
//! ([`crate::kernel_emu`]) against the CPU's [`super::im2col`] (tested against candle's conv and
//! its gradients), image by image: the kernels lay the images side by side in the columns
//! (`[C·k_h·k_w, B·N]`). Shapes with odd sizes, stride 2 on mixed parity, padding 0 and 1, 1×1 and
//! 3×3 kernels, two images, and a grid too small for the work (the grid-stride loop goes round).
//! Outputs start as NaN, so an element a kernel forgets to write fails.

use half::bf16;

use super::conv_windows::input_windows;
use super::im2col::{col2im, im2col, ConvGeometry, RowWindow};
use crate::kernel_emu::{self, Arg, Elem};

const CU: &str = "src/nn/kernels/conv.cu";

/// (batch, channels, (h, w), kernel, padding, stride)
type Case = (usize, usize, (usize, usize), usize, usize, usize);

const CASES: [Case; 4] = [
    (2, 3, (7, 5), 3, 1, 1),
    (2, 2, (7, 6), 3, 1, 2),
    (1, 4, (5, 5), 1, 0, 1),
    (2, 2, (6, 4), 3, 0, 1),
];

fn geometry(&(_, c, (h, w), k, p, s): &Case) -> ConvGeometry {
    let out = |len| ConvGeometry::output_len(len, k, p, s).unwrap();
    ConvGeometry {
        c_in: c,
        x_hw: (h, w),
        k_hw: (k, k),
        g_hw: (out(h), out(w)),
        padding: p,
        stride: s,
    }
}

fn ints<'a>(case: &Case, geo: &ConvGeometry) -> Vec<Arg<'a>> {
    let (b, c, (h, w), k, p, s) = *case;
    [b, c, h, w, k, k, geo.g_hw.0, geo.g_hw.1, p, s]
        .iter()
        .map(|&v| Arg::Int(v as i64))
        .collect()
}

fn launch<T: Elem>(entry: &str, out: &mut [T], input: &[T], case: &Case, geo: &ConvGeometry) {
    let rows = geo.g_hw.0;
    launch_rows(entry, out, input, case, geo, 0..rows);
}

/// im2col of output rows `rows` only, or col2im of all input rows from all output rows.
fn launch_rows<T: Elem>(
    entry: &str,
    out: &mut [T],
    input: &[T],
    case: &Case,
    geo: &ConvGeometry,
    rows: std::ops::Range<usize>,
) {
    if entry.starts_with("conv_col2im") {
        let whole = RowWindow {
            input: 0..geo.x_hw.0,
            output: rows,
        };
        return launch_band(entry, out, input, case, geo, &whole);
    }
    let mut args = vec![Arg::out(out), Arg::input(input)];
    args.extend(ints(case, geo));
    args.push(Arg::Int(rows.start as i64));
    args.push(Arg::Int(rows.len() as i64));
    kernel_emu::launch(CU, entry, [3, 1, 1], [32, 1, 1], &mut args);
}

/// col2im of one band: input rows `window.input` from the columns of `window.output`.
fn launch_band<T: Elem>(
    entry: &str,
    out: &mut [T],
    cols: &[T],
    case: &Case,
    geo: &ConvGeometry,
    window: &RowWindow,
) {
    let mut args = vec![Arg::out(out), Arg::input(cols)];
    args.extend(ints(case, geo));
    for v in [
        window.input.start,
        window.input.len(),
        window.output.start,
        window.output.len(),
    ] {
        args.push(Arg::Int(v as i64));
    }
    kernel_emu::launch(CU, entry, [3, 1, 1], [32, 1, 1], &mut args);
}

/// Deterministic values in [−1, 1).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104729) % 2000) as f32 / 1000.0) - 1.0)
        .collect()
}

/// The kernels' column layout from the CPU's per-image columns.
fn side_by_side(per_image: &[Vec<f32>], rows: usize) -> Vec<f32> {
    let n = per_image[0].len() / rows;
    let mut out = Vec::with_capacity(rows * n * per_image.len());
    for r in 0..rows {
        for img in per_image {
            out.extend_from_slice(&img[r * n..(r + 1) * n]);
        }
    }
    out
}

/// One image's columns out of the side-by-side layout.
fn image_cols(cols: &[f32], rows: usize, batch: usize, b: usize) -> Vec<f32> {
    let n = cols.len() / rows / batch;
    (0..rows)
        .flat_map(|r| cols[(r * batch + b) * n..(r * batch + b + 1) * n].to_vec())
        .collect()
}

fn sizes(case: &Case, geo: &ConvGeometry) -> (usize, usize, usize) {
    let (b, c, (h, w), k, _, _) = *case;
    let rows = c * k * k;
    (rows, b * geo.g_hw.0 * geo.g_hw.1, b * c * h * w)
}

fn im2col_reference(x: &[f32], case: &Case, geo: &ConvGeometry) -> Vec<f32> {
    let (rows, _, x_len) = sizes(case, geo);
    let per: Vec<Vec<f32>> = x
        .chunks(x_len / case.0)
        .map(|img| im2col(img, geo))
        .collect();
    side_by_side(&per, rows)
}

fn col2im_reference(cols: &[f32], case: &Case, geo: &ConvGeometry) -> Vec<f32> {
    let (rows, _, _) = sizes(case, geo);
    (0..case.0)
        .flat_map(|b| col2im(&image_cols(cols, rows, case.0, b), geo))
        .collect()
}

#[test]
fn im2col_kernel_matches_the_cpu_columns_in_f32() {
    for case in &CASES {
        let geo = geometry(case);
        let (rows, bn, x_len) = sizes(case, &geo);
        let x = values(x_len, 1);
        let mut got = vec![f32::NAN; rows * bn];
        launch("conv_im2col_f32", &mut got, &x, case, &geo);
        assert_eq!(got, im2col_reference(&x, case, &geo), "{case:?}");
    }
}

/// A chunk of output rows (not starting at 0, the last one ragged) gives the chunk's columns of
/// the CPU's per-image `im2col_rows`, the images side by side.
#[test]
fn im2col_kernel_takes_a_chunk_of_output_rows() {
    for case in &CASES {
        let geo = geometry(case);
        let (rows, _, x_len) = sizes(case, &geo);
        let x = values(x_len, 5);
        let g_h = geo.g_hw.0;
        for chunk in [1..g_h.min(3), (g_h / 2)..g_h] {
            let n = chunk.len() * geo.g_hw.1;
            let mut got = vec![f32::NAN; rows * case.0 * n];
            launch_rows("conv_im2col_f32", &mut got, &x, case, &geo, chunk.clone());
            let per: Vec<Vec<f32>> = x
                .chunks(x_len / case.0)
                .map(|img| super::im2col::im2col_rows(img, &geo, chunk.clone()))
                .collect();
            assert_eq!(got, side_by_side(&per, rows), "{case:?} rows {chunk:?}");
        }
    }
}

#[test]
fn col2im_kernel_matches_the_cpu_scatter_add_in_f32() {
    for case in &CASES {
        let geo = geometry(case);
        let (rows, bn, x_len) = sizes(case, &geo);
        let cols = values(rows * bn, 2);
        let mut got = vec![f32::NAN; x_len];
        launch("conv_col2im_f32", &mut got, &cols, case, &geo);
        let want = col2im_reference(&cols, case, &geo);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        assert!(worst <= 1e-6, "{case:?}: worst {worst}");
    }
}

/// col2im band by band (bands of one input row and of a few, each from the columns of the
/// output rows reaching it, cut out of the whole columns) equals col2im in one launch, bit for
/// bit: a band that reads the columns from the wrong output row (a missing `− oy0`), writes the
/// wrong input rows, or drops the contributions of output rows at its edges fails. The whole
/// launch starts from NaN, so a band that leaves an element unwritten fails too.
#[test]
fn col2im_kernel_builds_the_gradient_band_by_band() {
    for case in &CASES {
        let geo = geometry(case);
        let (rows, bn, x_len) = sizes(case, &geo);
        let (batch, (x_h, x_w), g_w) = (case.0, case.2, geo.g_hw.1);
        let n = bn / batch;
        let cols = values(rows * bn, 4);
        let mut whole = vec![f32::NAN; x_len];
        launch("conv_col2im_f32", &mut whole, &cols, case, &geo);
        let row_bytes = rows * batch * g_w * 4;
        for budget in [0, 3 * row_bytes] {
            let mut got = vec![f32::NAN; x_len];
            for w in input_windows(&geo, batch, 4, budget) {
                let on = w.output.len() * g_w;
                let band_cols: Vec<f32> = (0..rows * batch)
                    .flat_map(|rb| cols[rb * n + w.output.start * g_w..][..on].to_vec())
                    .collect();
                let plane = w.input.len() * x_w;
                let mut band = vec![f32::NAN; batch * case.1 * plane];
                launch_band("conv_col2im_f32", &mut band, &band_cols, case, &geo, &w);
                for (bc, p) in band.chunks(plane).enumerate() {
                    got[bc * x_h * x_w + w.input.start * x_w..][..plane].copy_from_slice(p);
                }
            }
            assert_eq!(got, whole, "{case:?} budget {budget}");
        }
    }
}

/// bf16 in and out: im2col copies exactly; col2im sums in f32 and rounds once.
#[test]
fn kernels_run_in_bf16() {
    let case = CASES[1];
    let geo = geometry(&case);
    let (rows, bn, x_len) = sizes(&case, &geo);
    let x: Vec<bf16> = values(x_len, 3).into_iter().map(bf16::from_f32).collect();
    let mut cols = vec![bf16::NAN; rows * bn];
    launch("conv_im2col_bf16", &mut cols, &x, &case, &geo);
    let x32: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let want: Vec<bf16> = im2col_reference(&x32, &case, &geo)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    assert_eq!(cols, want);
    let mut gx = vec![bf16::NAN; x_len];
    launch("conv_col2im_bf16", &mut gx, &cols, &case, &geo);
    let cols32: Vec<f32> = cols.iter().map(|v| v.to_f32()).collect();
    let want: Vec<bf16> = col2im_reference(&cols32, &case, &geo)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    assert_eq!(gx, want);
}
