//! A bounds-checked single-threaded f32 GEMM on slices, over the `gemm` crate candle's CPU matmul
//! uses (same microkernels, picked at run time for the CPU), for kernels that keep their
//! operands in reused, cache-sized buffers instead of fresh candle tensors.
//!
//! `C = α·C + β·A·B` (`accumulate`: α = 1, else α = 0), with `A` `m×k`, `B` `k×n`, `C` `m×n`,
//! each given as a slice and its row and column strides (in elements), so a transpose is a swap
//! of strides.

/// A strided matrix view: `at(i, j) = data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn rows_t(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Whether every element of an `r×c` view lies inside `data`.
    fn fits(&self, r: usize, c: usize) -> bool {
        r == 0 || c == 0 || (r - 1) * self.rs + (c - 1) * self.cs < self.data.len()
    }
}

/// `c[m×n] (row-major, row stride ldc) = [c +] beta·a·b`, single-threaded. Panics when a view
/// does not fit its slice (a programming error, not user data).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.fits(m, k) && b.fits(k, n) && (m - 1) * ldc + n <= c.len(),
        "cpu gemm: a view exceeds its buffer ({m}×{n}×{k})"
    );
    // SAFETY: every element the kernel reads or writes lies inside the slices (checked above);
    // `c` is borrowed mutably, so it aliases neither `a` nor `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, n: usize, k: usize, a: Mat, b: Mat) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|l| a.data[i * a.rs + l * a.cs] * b.data[l * b.rs + j * b.cs])
                    .sum();
            }
        }
        c
    }

    /// Catches swapped row/column strides (a transpose lost) and a dropped accumulate.
    #[test]
    fn matches_naive_product_with_transposes_and_accumulation() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let (am, bm) = (Mat::rows(&a, k), Mat::rows_t(&bt, k));
        let want = naive(m, n, k, am, bm);
        let mut c = vec![1f32; m * n];
        gemm(m, n, k, &mut c, n, false, am, bm, 1.0);
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5);
        }
        gemm(m, n, k, &mut c, n, true, am, bm, 0.5);
        for (x, y) in c.iter().zip(&want) {
            assert!((x - 1.5 * y).abs() < 1e-5);
        }
    }
}
