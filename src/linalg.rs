//! Dense linear algebra in f64 that candle lacks: the eigendecomposition of a symmetric matrix
//! (Householder tridiagonalisation, then the implicit QL algorithm: EISPACK's `tred2` and
//! `tql2`, as JAMA writes them), the truncated SVD built on it, and torch's `quantile`.
//!
//! The SVD of an `m × n` matrix `A` takes the eigendecomposition of the Gram matrix of its
//! shorter side (`A·Aᵀ` when `m ≤ n`): its eigenvalues are the squared singular values and its
//! eigenvectors one side's singular vectors; the other side is `Aᵀ·u / σ`. In f64 this keeps
//! singular values down to ~1e-6 of the largest to 1e-9 relative, which low-rank extraction
//! (the top singular values only) needs.
//!
//! Signs: a singular pair `(u, v)` is defined up to a common sign. Each pair here is turned so
//! that the largest-magnitude entry of `u` is positive (the first such entry on a tie), so the
//! result does not depend on the algorithm's path.

use candle_core::{DType, Tensor};

/// The eigenvalues (descending) and unit eigenvectors (`vectors[i]` belongs to `values[i]`) of
/// the symmetric `n × n` matrix `a` (row-major; only its values are read, both triangles).
pub fn symmetric_eigen(a: &[f64], n: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    assert_eq!(
        a.len(),
        n * n,
        "symmetric_eigen: {n}×{n} needs {} values",
        n * n
    );
    if n == 0 {
        return (Vec::new(), Vec::new());
    }
    // The transformation is held transposed (w[col][row]), so that the inner loops of both
    // steps walk contiguous memory. `a` is symmetric: its transpose is itself.
    let mut w: Vec<Vec<f64>> = (0..n).map(|i| a[i * n..(i + 1) * n].to_vec()).collect();
    let mut d = vec![0.0; n];
    let mut e = vec![0.0; n];
    tred2(&mut w, &mut d, &mut e);
    tql2(&mut w, &mut d, &mut e);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| d[j].total_cmp(&d[i]));
    let values = order.iter().map(|&i| d[i]).collect();
    let vectors = order
        .into_iter()
        .map(|i| std::mem::take(&mut w[i]))
        .collect();
    (values, vectors)
}

/// Householder reduction of the symmetric `v` to tridiagonal form: `d` the diagonal, `e` the
/// subdiagonal (in `e[1..]`), `v` the orthogonal transformation, stored transposed (`v[j][i]`
/// is JAMA's `V[i][j]`: its inner loops walk columns, which are rows here).
fn tred2(v: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    for (j, dj) in d.iter_mut().enumerate() {
        *dj = v[j][n - 1];
    }
    for i in (1..n).rev() {
        let scale: f64 = d[..i].iter().map(|x| x.abs()).sum();
        let mut h = 0.0;
        if scale == 0.0 {
            e[i] = d[i - 1];
            for j in 0..i {
                d[j] = v[j][i - 1];
                v[j][i] = 0.0;
                v[i][j] = 0.0;
            }
        } else {
            for dk in d[..i].iter_mut() {
                *dk /= scale;
                h += *dk * *dk;
            }
            let mut f = d[i - 1];
            let mut g = h.sqrt();
            if f > 0.0 {
                g = -g;
            }
            e[i] = scale * g;
            h -= f * g;
            d[i - 1] = f - g;
            e[..i].fill(0.0);
            for j in 0..i {
                f = d[j];
                v[i][j] = f;
                let row = &v[j][j + 1..i];
                g = e[j] + v[j][j] * f + dot(row, &d[j + 1..i]);
                axpy(f, row, &mut e[j + 1..i]);
                e[j] = g;
            }
            f = 0.0;
            for j in 0..i {
                e[j] /= h;
                f += e[j] * d[j];
            }
            let hh = f / (h + h);
            for j in 0..i {
                e[j] -= hh * d[j];
            }
            for j in 0..i {
                f = d[j];
                g = e[j];
                let row = &mut v[j][j..i];
                axpy(-f, &e[j..i], row);
                axpy(-g, &d[j..i], row);
                d[j] = v[j][i - 1];
                v[j][i] = 0.0;
            }
        }
        d[i] = h;
    }
    for i in 0..n - 1 {
        v[i][n - 1] = v[i][i];
        v[i][i] = 1.0;
        let h = d[i + 1];
        if h != 0.0 {
            for k in 0..=i {
                d[k] = v[i + 1][k] / h;
            }
            let (head, tail) = v.split_at_mut(i + 1);
            let pivot = &tail[0][..=i];
            for row in head.iter_mut() {
                let g = dot(pivot, &row[..=i]);
                axpy(-g, &d[..=i], &mut row[..=i]);
            }
        }
        v[i + 1][..=i].fill(0.0);
    }
    for j in 0..n {
        d[j] = v[j][n - 1];
        v[j][n - 1] = 0.0;
    }
    v[n - 1][n - 1] = 1.0;
    e[0] = 0.0;
}

/// `Σ a·b` with four running sums, so that the compiler can keep them in vector lanes.
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// `y += alpha·x`.
fn axpy(alpha: f64, x: &[f64], y: &mut [f64]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// The implicit QL algorithm on the tridiagonal `(d, e)`, accumulating into `w` (transposed:
/// `w[j]` is column `j`). Leaves the eigenvalues in `d`, unsorted.
fn tql2(w: &mut [Vec<f64>], d: &mut [f64], e: &mut [f64]) {
    let n = d.len();
    for i in 1..n {
        e[i - 1] = e[i];
    }
    e[n - 1] = 0.0;
    let mut f = 0.0;
    let mut tst1: f64 = 0.0;
    let eps = f64::EPSILON;
    for l in 0..n {
        tst1 = tst1.max(d[l].abs() + e[l].abs());
        let mut m = l;
        while m < n - 1 && e[m].abs() > eps * tst1 {
            m += 1;
        }
        if m > l {
            // At most 60 sweeps: more means the input was not finite.
            for _ in 0..60 {
                let g = d[l];
                let mut p = (d[l + 1] - g) / (2.0 * e[l]);
                let mut r = p.hypot(1.0);
                if p < 0.0 {
                    r = -r;
                }
                d[l] = e[l] / (p + r);
                d[l + 1] = e[l] * (p + r);
                let dl1 = d[l + 1];
                let h = g - d[l];
                for di in d.iter_mut().skip(l + 2) {
                    *di -= h;
                }
                f += h;
                p = d[m];
                let (mut c, mut c2, mut c3) = (1.0, 1.0, 1.0);
                let el1 = e[l + 1];
                let (mut s, mut s2) = (0.0, 0.0);
                for i in (l..m).rev() {
                    c3 = c2;
                    c2 = c;
                    s2 = s;
                    let g = c * e[i];
                    let h = c * p;
                    r = p.hypot(e[i]);
                    e[i + 1] = s * r;
                    s = e[i] / r;
                    c = p / r;
                    p = c * d[i] - s * g;
                    d[i + 1] = h + s * (c * g + s * d[i]);
                    let (lo, hi) = w.split_at_mut(i + 1);
                    let (wi, wi1) = (&mut lo[i], &mut hi[0]);
                    for (a, b) in wi.iter_mut().zip(wi1.iter_mut()) {
                        let h = *b;
                        *b = s * *a + c * h;
                        *a = c * *a - s * h;
                    }
                }
                p = -s * s2 * c3 * el1 * e[l] / dl1;
                e[l] = s * p;
                d[l] = c * p;
                if e[l].abs() <= eps * tst1 {
                    break;
                }
            }
        }
        d[l] += f;
        e[l] = 0.0;
    }
}

/// The top `rank` singular triplets of the 2-D `a`: `u` (`m × rank`), the singular values
/// (descending) and `vt` (`rank × n`), f64 on `a`'s device, signs as the module header says.
/// `rank` is capped at `min(m, n)`.
pub fn truncated_svd(a: &Tensor, rank: usize) -> candle_core::Result<(Tensor, Vec<f64>, Tensor)> {
    let a = a.to_dtype(DType::F64)?;
    let (m, n) = a.dims2()?;
    let rank = rank.min(m).min(n);
    let rows_short = m <= n;
    // The Gram matrix of the shorter side, and its top eigenvectors: that side's singular
    // vectors.
    let gram = match rows_short {
        true => a.matmul(&a.t()?)?,
        false => a.t()?.matmul(&a)?,
    };
    let k = gram.dim(0)?;
    let flat: Vec<f64> = gram.flatten_all()?.to_vec1()?;
    if flat.iter().any(|x| !x.is_finite()) {
        candle_core::bail!("truncated_svd: the matrix holds NaN or infinite values");
    }
    let (values, vectors) = symmetric_eigen(&flat, k);
    let sigma: Vec<f64> = values[..rank].iter().map(|v| v.max(0.0).sqrt()).collect();
    let mut short: Vec<f64> = Vec::with_capacity(k * rank);
    for row in 0..k {
        short.extend(vectors[..rank].iter().map(|v| v[row]));
    }
    let short = Tensor::from_vec(short, (k, rank), a.device())?;
    // The other side: Aᵀu / σ (or Av / σ); a zero singular value leaves a zero vector.
    let inv: Vec<f64> = sigma
        .iter()
        .map(|&s| if s > 0.0 { 1.0 / s } else { 0.0 })
        .collect();
    let inv = Tensor::from_vec(inv, (1, rank), a.device())?;
    let (u, v) = match rows_short {
        true => {
            let v = a.t()?.matmul(&short)?.broadcast_mul(&inv)?;
            (short, v)
        }
        false => {
            let u = a.matmul(&short)?.broadcast_mul(&inv)?;
            (u, short)
        }
    };
    // The sign: each column's largest-magnitude entry of u positive.
    let uv: Vec<Vec<f64>> = u.to_vec2()?;
    let signs: Vec<f64> = (0..rank)
        .map(|c| {
            let mut best = 0;
            for (i, row) in uv.iter().enumerate() {
                if row[c].abs() > uv[best][c].abs() {
                    best = i;
                }
            }
            if uv[best][c] < 0.0 {
                -1.0
            } else {
                1.0
            }
        })
        .collect();
    let signs = Tensor::from_vec(signs, (1, rank), a.device())?;
    let u = u.broadcast_mul(&signs)?;
    let vt = v.broadcast_mul(&signs)?.t()?.contiguous()?;
    Ok((u, sigma, vt))
}

/// The singular value decomposition of a product `up · down` (`up` `m × r`, `down` `r × n`,
/// row-major) without forming it: the thin QR of each factor (`up = Qu·Ru`, `downᵀ = Qd·Rd`,
/// modified Gram–Schmidt, each column orthogonalised twice), then the SVD of the small
/// `Ru·Rdᵀ = Um·Σ·Vmᵀ` (one-sided Jacobi, which keeps small singular values to the f64 rounding
/// of the largest, where a Gram matrix's eigenvalues keep them to its square root), so that
/// `up·down = (Qu·Um)·Σ·(Qd·Vm)ᵀ`. It costs `O((m + n)·r²)` where the product's SVD would cost
/// `O(m·n·min(m, n))`: what resizing a LoRA needs for every module of a large model.
///
/// Returns all `r` triplets, singular values descending, signs as the module header says. A
/// factor of rank below `r` (a zero column, a repeated row) gives singular values of 0, whose
/// vectors may be zero.
pub fn factored_svd(up: &[f64], down: &[f64], m: usize, r: usize, n: usize) -> FactoredSvd {
    assert_eq!(up.len(), m * r, "factored_svd: up is not {m}×{r}");
    assert_eq!(down.len(), r * n, "factored_svd: down is not {r}×{n}");
    let up_cols: Vec<Vec<f64>> = (0..r)
        .map(|c| (0..m).map(|i| up[i * r + c]).collect())
        .collect();
    let down_rows: Vec<Vec<f64>> = (0..r).map(|c| down[c * n..(c + 1) * n].to_vec()).collect();
    let (qu, ru) = thin_qr(up_cols);
    let (qd, rd) = thin_qr(down_rows);
    // M = Ru·Rdᵀ, r × r.
    let mut small = vec![0.0; r * r];
    for i in 0..r {
        for j in 0..r {
            small[i * r + j] = (0..r).map(|k| ru[i * r + k] * rd[j * r + k]).sum();
        }
    }
    let (um, s, vm) = jacobi_svd(small, r);
    let mut u = vec![0.0; m * r];
    let mut vt = vec![0.0; r * n];
    for k in 0..r {
        if m > 0 {
            for (j, q) in qu.iter().enumerate() {
                axpy_strided(um[k][j], q, &mut u[k..], r);
            }
        }
        for (j, q) in qd.iter().enumerate() {
            axpy(vm[k][j], q, &mut vt[k * n..(k + 1) * n]);
        }
        // The sign: the column's largest-magnitude entry of u positive.
        let mut best = 0;
        for i in 0..m {
            if u[i * r + k].abs() > u[best * r + k].abs() {
                best = i;
            }
        }
        if m > 0 && u[best * r + k] < 0.0 {
            (0..m).for_each(|i| u[i * r + k] = -u[i * r + k]);
            vt[k * n..(k + 1) * n].iter_mut().for_each(|x| *x = -*x);
        }
    }
    FactoredSvd { u, s, vt }
}

/// [`factored_svd`]'s result: `u` (`m × r`), the singular values (descending) and `vt`
/// (`r × n`), row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct FactoredSvd {
    pub u: Vec<f64>,
    pub s: Vec<f64>,
    pub vt: Vec<f64>,
}

/// The SVD of the square `a` (`n × n`, row-major) by one-sided Jacobi rotations (Hestenes):
/// columns are rotated pairwise until orthogonal; their norms are the singular values, the
/// normalised columns `u`, the accumulated rotations `v`. Returns `u` and `v` as lists of
/// vectors (`u[k]` belongs to `s[k]`), singular values descending; a zero singular value has a
/// zero `u`.
fn jacobi_svd(a: Vec<f64>, n: usize) -> (Vec<Vec<f64>>, Vec<f64>, Vec<Vec<f64>>) {
    // Column-major: cols[j] is column j.
    let mut cols: Vec<Vec<f64>> = (0..n)
        .map(|j| (0..n).map(|i| a[i * n + j]).collect())
        .collect();
    let mut v: Vec<Vec<f64>> = (0..n)
        .map(|j| (0..n).map(|i| f64::from(u8::from(i == j))).collect())
        .collect();
    for _sweep in 0..80 {
        let mut rotated = false;
        for p in 0..n {
            for q in p + 1..n {
                let alpha = dot(&cols[p], &cols[p]);
                let beta = dot(&cols[q], &cols[q]);
                let gamma = dot(&cols[p], &cols[q]);
                if gamma == 0.0 || gamma.abs() <= f64::EPSILON * alpha.sqrt() * beta.sqrt() {
                    continue;
                }
                rotated = true;
                let zeta = (beta - alpha) / (2.0 * gamma);
                let t = zeta.signum() / (zeta.abs() + (1.0 + zeta * zeta).sqrt());
                let c = 1.0 / (1.0 + t * t).sqrt();
                let s = c * t;
                for m in [&mut cols, &mut v] {
                    let (lo, hi) = m.split_at_mut(q);
                    for (x, y) in lo[p].iter_mut().zip(hi[0].iter_mut()) {
                        let (xp, xq) = (*x, *y);
                        *x = c * xp - s * xq;
                        *y = s * xp + c * xq;
                    }
                }
            }
        }
        if !rotated {
            break;
        }
    }
    let norms: Vec<f64> = cols.iter().map(|c| dot(c, c).sqrt()).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| norms[j].total_cmp(&norms[i]));
    let s: Vec<f64> = order.iter().map(|&j| norms[j]).collect();
    let u = order
        .iter()
        .map(|&j| match norms[j] > 0.0 {
            true => cols[j].iter().map(|x| x / norms[j]).collect(),
            false => vec![0.0; n],
        })
        .collect();
    let v = order.iter().map(|&j| v[j].clone()).collect();
    (u, s, v)
}

/// `y[i·stride] += alpha·x[i]`.
fn axpy_strided(alpha: f64, x: &[f64], y: &mut [f64], stride: usize) {
    for (i, xi) in x.iter().enumerate() {
        y[i * stride] += alpha * xi;
    }
}

/// The thin QR of the matrix whose columns are `cols` (modified Gram–Schmidt, twice per column):
/// the orthonormal columns of `Q` and `R` (`r × r`, row-major, upper triangular). A column
/// within 1e-13 of the span of those before it (relative to the largest column) gets a zero `Q`
/// column and a zero diagonal entry.
fn thin_qr(mut cols: Vec<Vec<f64>>) -> (Vec<Vec<f64>>, Vec<f64>) {
    let r = cols.len();
    let scale = cols.iter().map(|c| dot(c, c).sqrt()).fold(0.0, f64::max);
    let mut rr = vec![0.0; r * r];
    for j in 0..r {
        let (done, rest) = cols.split_at_mut(j);
        let v = &mut rest[0];
        for _ in 0..2 {
            for (i, q) in done.iter().enumerate() {
                let c = dot(q, v);
                rr[i * r + j] += c;
                axpy(-c, q, v);
            }
        }
        let norm = dot(v, v).sqrt();
        if norm > 1e-13 * scale && norm > 0.0 {
            rr[j * r + j] = norm;
            v.iter_mut().for_each(|x| *x /= norm);
        } else {
            v.iter_mut().for_each(|x| *x = 0.0);
        }
    }
    (cols, rr)
}

/// torch's `quantile(values, q)` (linear interpolation between the two nearest ranks).
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    let t = pos - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * t
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn reference() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/reference/linalg.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// The reference script's matrix formula.
    fn matrix(m: usize, n: usize, seed: f64) -> Vec<f64> {
        let mut a = Vec::with_capacity(m * n);
        for i in 0..m {
            for j in 0..n {
                let x = seed + 0.37 * (i * (j + 1)) as f64 + 1.3 * j as f64;
                a.push(x.sin() * (1 + i % 3) as f64 / (1 + j % 5) as f64);
            }
        }
        a
    }

    fn rows(v: &serde_json::Value) -> Vec<Vec<f64>> {
        serde_json::from_value(v.clone()).unwrap()
    }

    fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Singular values and vectors equal torch's `linalg.svd` (signs fixed the same way) on a
    /// wide, a tall and a square matrix. Catches the wrong Gram side, a missing 1/σ, a square
    /// root left out, the vectors of the wrong eigenvalues, or the sign rule flipped.
    #[test]
    fn truncated_svd_matches_torch() {
        for case in reference()["svd"].as_array().unwrap() {
            let (m, n) = (
                case["m"].as_u64().unwrap() as usize,
                case["n"].as_u64().unwrap() as usize,
            );
            let rank = case["rank"].as_u64().unwrap() as usize;
            let a = Tensor::from_vec(
                matrix(m, n, case["seed"].as_f64().unwrap()),
                (m, n),
                &Device::Cpu,
            )
            .unwrap();
            let (u, s, vt) = truncated_svd(&a, rank).unwrap();
            let want_s: Vec<f64> = serde_json::from_value(case["s"].clone()).unwrap();
            for (x, y) in s.iter().zip(&want_s) {
                assert!((x - y).abs() < 1e-9 * want_s[0], "{m}×{n}: σ {x} vs {y}");
            }
            let du = max_diff(&u.to_vec2().unwrap(), &rows(&case["u"]));
            let dv = max_diff(&vt.to_vec2().unwrap(), &rows(&case["vt"]));
            assert!(du < 1e-8 && dv < 1e-8, "{m}×{n}: u off by {du}, vt by {dv}");
        }
    }

    #[test]
    fn symmetric_eigenvalues_match_torch() {
        let r = &reference()["eigen"];
        let n = r["n"].as_u64().unwrap() as usize;
        let a = matrix(n, n, r["seed"].as_f64().unwrap());
        let sym: Vec<f64> = (0..n * n).map(|k| a[k] + a[(k % n) * n + k / n]).collect();
        let (values, vectors) = symmetric_eigen(&sym, n);
        let want: Vec<f64> = serde_json::from_value(r["values"].clone()).unwrap();
        for (x, y) in values.iter().zip(&want) {
            assert!((x - y).abs() < 1e-10, "{x} vs {y}");
        }
        // A·v = λ·v for every pair.
        for (lambda, v) in values.iter().zip(&vectors) {
            for i in 0..n {
                let av: f64 = (0..n).map(|j| sym[i * n + j] * v[j]).sum();
                assert!((av - lambda * v[i]).abs() < 1e-10, "A·v ≠ λ·v");
            }
        }
    }

    /// The SVD of a product through its factors equals the SVD of the product formed (itself
    /// checked against torch above), for a tall and a wide product, and one whose `up` has a
    /// zero column and whose `down` repeats a row (rank 3 of 5). Catches `Rd` used untransposed,
    /// a column orthogonalised against itself, the vectors left unsigned, or a deficient column
    /// normalised into noise.
    #[test]
    fn factored_svd_equals_the_svd_of_the_product() {
        let cases: [(usize, usize, usize, bool); 3] =
            [(24, 5, 9, false), (7, 5, 30, false), (12, 5, 10, true)];
        for (m, r, n, deficient) in cases {
            let mut up = matrix(m, r, 0.3);
            let mut down = matrix(r, n, 1.7);
            if deficient {
                (0..m).for_each(|i| up[i * r + 1] = 0.0);
                let row: Vec<f64> = down[..n].to_vec();
                down[2 * n..3 * n].copy_from_slice(&row);
            }
            let got = factored_svd(&up, &down, m, r, n);
            let a = Tensor::from_vec(up.clone(), (m, r), &Device::Cpu).unwrap();
            let b = Tensor::from_vec(down.clone(), (r, n), &Device::Cpu).unwrap();
            let rank = if deficient { 3 } else { r };
            let (u, s, vt) = truncated_svd(&a.matmul(&b).unwrap(), rank).unwrap();
            for (k, want) in s.iter().enumerate() {
                assert!((got.s[k] - want).abs() < 1e-9 * s[0], "{m}×{n}: σ{k}");
            }
            assert!(
                got.s[rank..].iter().all(|x| *x < 1e-14 * s[0]),
                "{:?}",
                got.s
            );
            let (u, vt): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
                (u.to_vec2().unwrap(), vt.to_vec2().unwrap());
            for k in 0..rank {
                for (i, row) in u.iter().enumerate() {
                    let d = (got.u[i * r + k] - row[k]).abs();
                    assert!(d < 1e-8, "{m}×{n}: u[{i}][{k}]");
                }
                for (j, want) in vt[k].iter().enumerate() {
                    let d = (got.vt[k * n + j] - want).abs();
                    assert!(d < 1e-8, "{m}×{n}: vt[{k}][{j}]");
                }
            }
        }
    }

    /// An empty factor (a layer of no outputs or no inputs) gives zeros of the right sizes, not
    /// a panic.
    #[test]
    fn factored_svd_of_an_empty_factor_is_empty() {
        let got = factored_svd(&[], &[1.0; 8], 0, 2, 4);
        assert_eq!((got.u.len(), got.s, got.vt.len()), (0, vec![0.0, 0.0], 8));
        let got = factored_svd(&[1.0; 6], &[], 3, 2, 0);
        assert_eq!((got.u.len(), got.s, got.vt.len()), (6, vec![0.0, 0.0], 0));
    }

    #[test]
    fn quantile_matches_torch() {
        for case in reference()["quantile"].as_array().unwrap() {
            let values: Vec<f64> = serde_json::from_value(case["values"].clone()).unwrap();
            let q = case["q"].as_f64().unwrap();
            let want = case["expected"].as_f64().unwrap();
            assert!(
                (quantile(&values, q) - want).abs() < 1e-12,
                "{values:?} q {q}"
            );
        }
    }
}
