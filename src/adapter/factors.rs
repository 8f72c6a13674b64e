//! The weight update each adapter type encodes, as LyCORIS (lycoris-lora 4.1.3) and the UIs that
//! load its files (A1111 since PR #11821 and #15160, ComfyUI `comfy/weight_adapter`) rebuild it,
//! for a base layer with weight `W` of shape `[out, in]` or `[out, in, k, k]` and scale `s`:
//!
//! - LoRA / LoCon (`lora_down.weight`, `lora_up.weight`): `ΔW = s · up·down` over the flattened
//!   `[out, r]` and `[r, in·k·k]` (Hu et al., arXiv 2106.09685), `s = alpha / r`;
//! - LoHa (`hada_w1_a` `[out, r]`, `hada_w1_b` `[r, in·k·k]`, `hada_w2_a`, `hada_w2_b`):
//!   `ΔW = s · (w1a·w1b) ⊙ (w2a·w2b)` (FedPara, arXiv 2108.06098), `s = alpha / r`;
//! - LoKr (`lokr_w1` `[a, c]` or `lokr_w1_a`·`lokr_w1_b`; `lokr_w2` `[b, d(, k, k)]` or
//!   `lokr_w2_a` `[b, r]`·`lokr_w2_b` `[r, d·k·k]`): `ΔW = s · w1 ⊗ w2` (Kronecker product,
//!   arXiv 2108.06098 §3 / KronA), with `out = a·b`, `in = c·d`; `s = alpha / r` when a half is
//!   decomposed, else 1 (LyCORIS sets alpha = rank then, ComfyUI ignores the file's alpha);
//! - DoRA (any of the above plus `dora_scale`; Liu et al., arXiv 2402.09353), in the input-axis
//!   form A1111 and ComfyUI load (LyCORIS `wd_on_out=False`): `W' = m ⊙ (W + ΔW) / ‖W + ΔW‖`,
//!   the norm taken per input channel over the output and kernel axes, `m` = `dora_scale`
//!   `[1, in]` or `[1, in, 1, 1]`, plus LyCORIS's epsilon (f32's) on the norm. The update is
//!   `W' − W`.
//!
//! The shapes and inits of a fresh module follow LyCORIS's defaults: LoHa without Tucker, LoKr
//! with a full `w1` (`decompose_both=False`), `w2` decomposed only when
//! `rank < max(b, d) / 2`, and `factor` splitting `out` and `in` by [`factorization`].

use candle_core::{DType, Result, Tensor};

pub const DOWN: &str = "lora_down.weight";
pub const UP: &str = "lora_up.weight";
pub const HADA_W1_A: &str = "hada_w1_a";
pub const HADA_W1_B: &str = "hada_w1_b";
pub const HADA_W2_A: &str = "hada_w2_a";
pub const HADA_W2_B: &str = "hada_w2_b";
pub const LOKR_W1: &str = "lokr_w1";
pub const LOKR_W1_A: &str = "lokr_w1_a";
pub const LOKR_W1_B: &str = "lokr_w1_b";
pub const LOKR_W2: &str = "lokr_w2";
pub const LOKR_W2_A: &str = "lokr_w2_a";
pub const LOKR_W2_B: &str = "lokr_w2_b";
pub const DORA_SCALE: &str = "dora_scale";

/// Every weight suffix an adapter file may hold (besides `alpha`).
pub const ALL_SUFFIXES: [&str; 13] = [
    DOWN, UP, HADA_W1_A, HADA_W1_B, HADA_W2_A, HADA_W2_B, LOKR_W1, LOKR_W1_A, LOKR_W1_B, LOKR_W2,
    LOKR_W2_A, LOKR_W2_B, DORA_SCALE,
];

/// How `ΔW` is built from the factors (DoRA is a `dora_scale` on top of any of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// LoRA / LoCon: `up·down`.
    LowRank,
    /// LoHa: Hadamard product of two low-rank products.
    Hadamard,
    /// LoKr: Kronecker product.
    Kron,
}

impl Algo {
    /// The algorithm whose keys a module's suffixes are, or `None` when they mix or are
    /// incomplete.
    pub fn detect(suffixes: &[&str]) -> Option<Algo> {
        let has = |s: &str| suffixes.contains(&s);
        let lowrank = [DOWN, UP];
        let hada = [HADA_W1_A, HADA_W1_B, HADA_W2_A, HADA_W2_B];
        let kron = [LOKR_W1, LOKR_W1_A, LOKR_W1_B, LOKR_W2, LOKR_W2_A, LOKR_W2_B];
        let any = |set: &[&str]| set.iter().any(|s| has(s));
        match (any(&lowrank), any(&hada), any(&kron)) {
            (true, false, false) if lowrank.iter().all(|s| has(s)) => Some(Algo::LowRank),
            (false, true, false) if hada.iter().all(|s| has(s)) => Some(Algo::Hadamard),
            (false, false, true) => {
                let half = |full: &str, a: &str, b: &str| {
                    has(full) != (has(a) && has(b)) && !(has(full) && (has(a) || has(b)))
                };
                (half(LOKR_W1, LOKR_W1_A, LOKR_W1_B) && half(LOKR_W2, LOKR_W2_A, LOKR_W2_B))
                    .then_some(Algo::Kron)
            }
            _ => None,
        }
    }

    /// The keys a complete module of this algorithm holds, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Algo::LowRank => "lora_down.weight and lora_up.weight",
            Algo::Hadamard => "hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b",
            Algo::Kron => {
                "lokr_w1 (or lokr_w1_a and lokr_w1_b) and lokr_w2 (or lokr_w2_a and lokr_w2_b)"
            }
        }
    }
}

/// LyCORIS `lycoris.functional.factorization`: splits `dimension` into `(m, n)`, `m <= n`,
/// `m·n = dimension`. A positive `factor` that divides `dimension` is taken as is; otherwise the
/// most balanced split with `m <= factor` (`factor = -1`: no bound) is searched from `m = 1` up,
/// stopping at the first step that does not reduce `m + n`.
pub fn factorization(dimension: usize, factor: i64) -> (usize, usize) {
    if factor > 0 && dimension.is_multiple_of(factor as usize) {
        let m = factor as usize;
        let n = dimension / m;
        return (m.min(n), m.max(n));
    }
    let bound = if factor < 0 {
        dimension
    } else {
        factor as usize
    };
    let (mut m, mut n) = (1usize, dimension);
    let length = m + n;
    while m < n {
        let mut new_m = m + 1;
        while !dimension.is_multiple_of(new_m) {
            new_m += 1;
        }
        let new_n = dimension / new_m;
        if new_m + new_n > length || new_m > bound {
            break;
        }
        m = new_m;
        n = new_n;
    }
    (m.min(n), m.max(n))
}

/// How a fresh tensor is initialised (LyCORIS's choices per algorithm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// torch `kaiming_uniform_(a=√5)`: uniform in `±1/sqrt(fan_in)`, `fan_in` = the product of
    /// every dimension but the first.
    KaimingUniform,
    Zeros,
    /// Normal with this standard deviation.
    Normal(f64),
    /// DoRA's magnitude: the base weight's norm per input channel.
    BaseNorm,
}

/// One trainable tensor of a module: its key suffix, shape and init.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamShape {
    pub suffix: &'static str,
    pub dims: Vec<usize>,
    pub init: Init,
}

fn p(suffix: &'static str, dims: Vec<usize>, init: Init) -> ParamShape {
    ParamShape { suffix, dims, init }
}

/// The tensors of a fresh module on a layer of weight shape `w` (`[out, in]` or
/// `[out, in, k, k]`), in the order they are initialised and saved. LoRA's `down` is drawn first,
/// as before LoHa/LoKr existed, so a seed gives the same LoRA as it always did.
pub fn param_shapes(
    algo: Algo,
    w: &[usize],
    rank: usize,
    factor: i64,
    dora: bool,
) -> Vec<ParamShape> {
    let (out, inp) = (w[0], w.get(1).copied().unwrap_or(1));
    let kernel: Vec<usize> = w.get(2..).map(<[usize]>::to_vec).unwrap_or_default();
    let k: usize = kernel.iter().product();
    let mut v = match algo {
        Algo::LowRank => {
            let mut down = vec![rank, inp];
            down.extend(&kernel);
            let mut up = vec![out, rank];
            up.extend(kernel.iter().map(|_| 1));
            vec![p(DOWN, down, Init::KaimingUniform), p(UP, up, Init::Zeros)]
        }
        // LyCORIS LohaModule: w1b N(0, 1), w1a N(0, 0.1), w2b N(0, 1), w2a 0.
        Algo::Hadamard => vec![
            p(HADA_W1_A, vec![out, rank], Init::Normal(0.1)),
            p(HADA_W1_B, vec![rank, inp * k], Init::Normal(1.0)),
            p(HADA_W2_A, vec![out, rank], Init::Zeros),
            p(HADA_W2_B, vec![rank, inp * k], Init::Normal(1.0)),
        ],
        Algo::Kron => {
            let (in_m, in_n) = factorization(inp, factor);
            let (out_l, out_k) = factorization(out, factor);
            let mut v = vec![p(LOKR_W1, vec![out_l, in_m], Init::KaimingUniform)];
            if 2 * rank < out_k.max(in_n) {
                v.push(p(LOKR_W2_A, vec![out_k, rank], Init::KaimingUniform));
                v.push(p(LOKR_W2_B, vec![rank, in_n * k], Init::Zeros));
            } else {
                let mut w2 = vec![out_k, in_n];
                w2.extend(&kernel);
                v.push(p(LOKR_W2, w2, Init::Zeros));
            }
            v
        }
    };
    if dora {
        let mut m = vec![1, inp];
        m.extend(kernel.iter().map(|_| 1));
        v.push(p(DORA_SCALE, m, Init::BaseNorm));
    }
    v
}

/// The scale `s` of a module with these factors (see the header): `alpha / r` with `r` the
/// factors' rank, or 1 for a LoKr with both halves full.
pub fn scale(algo: Algo, get: &dyn Fn(&str) -> Option<Tensor>, alpha: f64) -> Result<f64> {
    let rank = match algo {
        Algo::LowRank => Some(need(get, DOWN)?.dim(0)?),
        Algo::Hadamard => Some(need(get, HADA_W1_B)?.dim(0)?),
        Algo::Kron => match (get(LOKR_W1_A), get(LOKR_W2_A)) {
            (_, Some(w2a)) => Some(w2a.dim(1)?),
            (Some(w1a), None) => Some(w1a.dim(1)?),
            (None, None) => None,
        },
    };
    Ok(rank.map_or(1.0, |r| alpha / r.max(1) as f64))
}

/// The suffix a change of scale can be folded into: `ΔW` is linear in it.
pub fn scale_carrier(algo: Algo, get: &dyn Fn(&str) -> Option<Tensor>) -> &'static str {
    match algo {
        Algo::LowRank => UP,
        Algo::Hadamard => HADA_W1_A,
        Algo::Kron if get(LOKR_W1).is_some() => LOKR_W1,
        Algo::Kron => LOKR_W1_A,
    }
}

fn need(get: &dyn Fn(&str) -> Option<Tensor>, suffix: &str) -> Result<Tensor> {
    get(suffix).ok_or_else(|| candle_core::Error::Msg(format!("no `{suffix}` tensor")))
}

/// `[rows, rest]`: the tensor with every dimension after the first flattened.
fn flat(t: &Tensor) -> Result<Tensor> {
    let rows = t.dim(0)?;
    t.reshape((rows, ()))
}

/// `a·b` over the flattened factors, checking that the inner dimensions agree.
fn product(get: &dyn Fn(&str) -> Option<Tensor>, a: &str, b: &str) -> Result<Tensor> {
    let (ta, tb) = (flat(&need(get, a)?)?, flat(&need(get, b)?)?);
    if ta.dim(1)? != tb.dim(0)? {
        candle_core::bail!(
            "`{a}` {:?} and `{b}` {:?} disagree on the rank",
            ta.dims(),
            tb.dims()
        );
    }
    ta.matmul(&tb)
}

/// `a ⊗ b` of two matrices: `[p·r, q·s]`.
pub fn kron(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (p, q) = a.dims2()?;
    let (r, s) = b.dims2()?;
    let a4 = a.reshape((p, 1, q, 1))?;
    let b4 = b.reshape((1, r, 1, s))?;
    a4.broadcast_mul(&b4)?.reshape((p * r, q * s))
}

/// `ΔW` (without DoRA), in the factors' dtype and shaped `w`. `alpha` is the module's; the
/// factors come from `get` by suffix. Errors name the tensors whose shapes do not fit.
pub fn delta_weight(
    algo: Algo,
    get: &dyn Fn(&str) -> Option<Tensor>,
    alpha: f64,
    w: &[usize],
) -> Result<Tensor> {
    let d = match algo {
        Algo::LowRank => product(get, UP, DOWN)?,
        Algo::Hadamard => {
            (product(get, HADA_W1_A, HADA_W1_B)? * product(get, HADA_W2_A, HADA_W2_B)?)?
        }
        Algo::Kron => {
            let w1 = match get(LOKR_W1) {
                Some(w1) => flat(&w1)?,
                None => product(get, LOKR_W1_A, LOKR_W1_B)?,
            };
            let w2 = match get(LOKR_W2) {
                Some(w2) => flat(&w2)?,
                None => product(get, LOKR_W2_A, LOKR_W2_B)?,
            };
            kron(&w1, &w2)?
        }
    };
    let want: usize = w.iter().product();
    if d.elem_count() != want || d.dim(0)? != w[0] {
        candle_core::bail!(
            "the factors rebuild a [{}, {}] update, which does not fit the weight {w:?}",
            d.dim(0)?,
            d.dim(1)?
        );
    }
    d.reshape(w)?.affine(scale(algo, get, alpha)?, 0.0)
}

/// DoRA's update `W' − W` for the base weight `w` (a constant), the update `delta` and the
/// magnitude `m` (`[1, in]` or `[1, in, 1, 1]`), all f32: `W' = m ⊙ (W + ΔW) / (‖W + ΔW‖ + ε)`,
/// the norm per input channel (the input-axis form; see the header).
pub fn dora_update(w: &Tensor, delta: &Tensor, m: &Tensor) -> Result<Tensor> {
    let merged = (w + delta)?;
    let mut norm = merged.sqr()?.sum_keepdim(0)?;
    for axis in 2..merged.rank() {
        norm = norm.sum_keepdim(axis)?;
    }
    if norm.dims() != m.dims() {
        candle_core::bail!(
            "`{DORA_SCALE}` {:?} does not fit the weight {:?} (want {:?}, one magnitude per \
             input channel)",
            m.dims(),
            w.dims(),
            norm.dims()
        );
    }
    let norm = (norm.sqrt()? + f64::from(f32::EPSILON))?;
    let scaled = merged.broadcast_mul(&m.broadcast_div(&norm)?)?;
    scaled - w
}

/// DoRA's initial magnitude: `‖W‖` per input channel, `[1, in]` or `[1, in, 1, 1]`, f32.
pub fn input_norm(w: &Tensor) -> Result<Tensor> {
    let w = w.to_dtype(DType::F32)?;
    let mut norm = w.sqr()?.sum_keepdim(0)?;
    for axis in 2..w.rank() {
        norm = norm.sum_keepdim(axis)?;
    }
    norm.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lycoris.functional.factorization` of lycoris-lora 4.1.3, run on these inputs (its
    /// docstring's table says 360 -> (8, 45) for factor -1; the function gives (18, 20)).
    #[test]
    fn factorization_matches_lycoris() {
        for (dim, factor, want) in [
            (127, -1, (1, 127)),
            (128, -1, (8, 16)),
            (250, -1, (10, 25)),
            (360, -1, (18, 20)),
            (512, -1, (16, 32)),
            (1024, -1, (32, 32)),
            (128, 2, (2, 64)),
            (250, 4, (2, 125)),
            (360, 8, (8, 45)),
            (1024, 16, (16, 64)),
            (250, 8, (5, 50)),
            (360, 16, (15, 24)),
            (127, 8, (1, 127)),
            (128, 16, (8, 16)),
            (512, 8, (8, 64)),
        ] {
            assert_eq!(factorization(dim, factor), want, "{dim} {factor}");
        }
    }

    #[test]
    fn detect_needs_a_complete_unmixed_set() {
        assert_eq!(Algo::detect(&[DOWN, UP]), Some(Algo::LowRank));
        assert_eq!(Algo::detect(&[DOWN, UP, DORA_SCALE]), Some(Algo::LowRank));
        assert_eq!(Algo::detect(&[DOWN]), None);
        assert_eq!(
            Algo::detect(&[LOKR_W1, LOKR_W2_A, LOKR_W2_B]),
            Some(Algo::Kron)
        );
        assert_eq!(Algo::detect(&[LOKR_W1, LOKR_W2_A]), None);
        assert_eq!(
            Algo::detect(&[LOKR_W1, LOKR_W1_A, LOKR_W1_B, LOKR_W2]),
            None
        );
        assert_eq!(Algo::detect(&[HADA_W1_A, HADA_W1_B, HADA_W2_A, DOWN]), None);
    }

    #[test]
    fn kron_is_the_kronecker_product() {
        let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &candle_core::Device::Cpu).unwrap();
        let b = Tensor::new(&[[0f32, 1.]], &candle_core::Device::Cpu).unwrap();
        let k = kron(&a, &b).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(k, vec![vec![0., 1., 0., 2.], vec![0., 3., 0., 4.]]);
    }
}
