//! One adapter module on a frozen Linear or Conv2d. LoRA / LoCon compute
//! `delta(x) = (alpha/rank) · up(dropout(down(x)))` (Hu et al., LoRA, arXiv 2106.09685), laid out
//! as kohya sd-scripts' `networks/lora.py` `LoRAModule`:
//!
//! - on a Linear: `down` `[r, in]`, `up` `[out, r]`, so `delta = s · x·downᵀ·upᵀ`;
//! - on a Conv2d (LoCon): `down` is a conv with the base's kernel, stride and padding
//!   `[r, in, kh, kw]`, `up` a 1×1 conv `[out, r, 1, 1]`.
//!
//! Init as kohya (and microsoft/LoRA): `down` kaiming-uniform with `a = √5`, i.e. uniform in
//! `±sqrt(6 / ((1 + a²)·fan_in)) = ±1/sqrt(fan_in)`, `up` zeros, so a fresh adapter is a no-op.
//! Dropout (kohya's `dropout`) acts on the `down` output, only while training.
//!
//! LoHa, LoKr and DoRA (LyCORIS's types, [`super::factors`]) rebuild the weight update `ΔW` from
//! their factors each forward and run the layer's own op on it, `op(x, ΔW)`, as LyCORIS's default
//! (non-bypass) forward does; DoRA normalises `W + ΔW` with the frozen weight it is handed
//! ([`LayerAdapter::delta_on`]). Their inits are LyCORIS's ([`factors::param_shapes`]). On a
//! frozen layer the layer and the update run as one op (`nn::rebuilt`) that keeps none of the
//! weight-sized tensors for the backward and rebuilds `ΔW` there instead.
//!
//! The Vars are f32 masters; `delta` casts them to the input's dtype, and the cast's backward
//! returns f32 gradients (the base layer stays in its loaded dtype).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::factors::{self, Algo, Init, DORA_SCALE, DOWN, LOKR_W1_A, LOKR_W2_A, UP};
use crate::nn::{
    add_maybe_const, cast_like, cpu_bf16, frozen_conv2d_low_rank, frozen_conv2d_rebuilt,
    frozen_linear_low_rank, frozen_linear_low_rank_on, frozen_linear_rebuilt, BaseWeight,
    DerivedInput, FrozenBase, LayerAdapter, LowRank, Rebuild, WeightUpdate,
};

/// Which model an adapter module belongs to (kohya prefixes `lora_unet`, `lora_te`/`lora_te1`,
/// `lora_te2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdapterComponent {
    Unet,
    TextEncoder,
    TextEncoder2,
}

/// The shape of the wrapped layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraKind {
    Linear,
    /// The base conv's geometry; `down` copies it, `up` is 1×1.
    Conv {
        kernel: usize,
        stride: usize,
        padding: usize,
    },
}

/// An adapter module (LoRA, LoCon, LoHa, LoKr, DoRA) attached to one Linear or Conv2d.
#[derive(Debug)]
pub struct LoraModule {
    /// The diffusers/transformers path of the wrapped layer, e.g.
    /// `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`.
    pub module_path: String,
    pub component: AdapterComponent,
    /// How the factors build the update ([`factors`]).
    pub algo: Algo,
    /// The trainable tensors by key suffix (`lora_down.weight`, `hada_w1_a`, `dora_scale`, …), in
    /// init and file order; f32.
    pub params: Vec<(&'static str, Var)>,
    pub alpha: f64,
    pub rank: usize,
    /// Probability of zeroing an element of `down(x)` while training (0 = off; LoRA/LoCon only).
    pub dropout: f64,
    pub kind: LoraKind,
    /// The wrapped layer's weight shape, `[out, in]` or `[out, in, k, k]`.
    pub weight_dims: Vec<usize>,
    training: AtomicBool,
    /// Off for a prior prediction: the layer computes its base alone.
    bypassed: AtomicBool,
    rng: Mutex<StdRng>,
    /// The dropout stream's seed: [`LoraModule::begin_step`] restarts the stream from it.
    dropout_seed: u64,
    /// kohya's `rank_dropout` and `module_dropout`, set once after attaching (off when unset).
    extra_dropout: std::sync::OnceLock<ExtraDropout>,
}

/// kohya's `network_args` `rank_dropout` and `module_dropout` (`networks/lora.py`'s
/// `LoRAModule.forward`), while training, LoRA/LoCon only:
/// - `rank`: each sample's rank channel of `down(x)` is zeroed with this probability, and the
///   update is scaled by `1/(1 − rank)` (kohya treats it as a smaller rank);
/// - `module`: with this probability the module adds nothing for a forward (one draw per
///   forward, so per micro-batch), and gets no gradient from it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExtraDropout {
    pub rank: f64,
    pub module: f64,
}

/// Where and how big one module is; see [`LoraModule::new`].
#[derive(Debug, Clone)]
pub struct LoraShape {
    pub module_path: String,
    pub component: AdapterComponent,
    pub kind: LoraKind,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl LoraShape {
    /// The wrapped layer's weight shape.
    pub fn weight_dims(&self) -> Vec<usize> {
        match self.kind {
            LoraKind::Linear => vec![self.out_dim, self.in_dim],
            LoraKind::Conv { kernel, .. } => vec![self.out_dim, self.in_dim, kernel, kernel],
        }
    }
}

/// Which adapter a module is: the factor layout, LoKr's `factor`, and whether DoRA's magnitude
/// is trained on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleAlgo {
    pub algo: Algo,
    /// LoKr's factorisation bound (LyCORIS `factor`, -1 = most balanced).
    pub factor: i64,
    pub dora: bool,
}

impl ModuleAlgo {
    pub const LORA: ModuleAlgo = ModuleAlgo {
        algo: Algo::LowRank,
        factor: -1,
        dora: false,
    };
}

/// Draws `n` values for `init` from `rng`.
fn draw(init: Init, dims: &[usize], base: Option<&Tensor>, rng: &mut StdRng) -> Result<Vec<f32>> {
    let n: usize = dims.iter().product();
    let fan_in: usize = dims.iter().skip(1).product();
    Ok(match init {
        Init::Zeros => vec![0.0; n],
        Init::KaimingUniform => {
            let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
            (0..n)
                .map(|_| rng.random_range(-bound..bound) as f32)
                .collect()
        }
        Init::Normal(std) => {
            let normal = rand_distr::Normal::new(0.0, std)
                .map_err(|e| candle_core::Error::Msg(format!("normal init: {e}")))?;
            (0..n).map(|_| rng.sample(normal) as f32).collect()
        }
        Init::BaseNorm => {
            let Some(w) = base else {
                candle_core::bail!("DoRA needs the base weight to initialise its magnitude");
            };
            factors::input_norm(w)?.flatten_all()?.to_vec1::<f32>()?
        }
    })
}

impl LoraModule {
    /// A fresh LoRA/LoCon module: `down` kaiming-uniform (a = √5) drawn from `rng`, `up` zeros.
    /// The dropout mask stream is seeded from `rng` too, so a run is reproducible.
    pub fn new(
        shape: LoraShape,
        rank: usize,
        alpha: f64,
        dropout: f64,
        rng: &mut StdRng,
        device: &Device,
    ) -> Result<Self> {
        Self::with_algo(
            shape,
            ModuleAlgo::LORA,
            rank,
            alpha,
            dropout,
            None,
            rng,
            device,
        )
    }

    /// A fresh module of any type, its tensors shaped and initialised as LyCORIS does
    /// ([`factors::param_shapes`]), drawn from `rng` in order. `base` is the wrapped layer's
    /// weight, needed for DoRA's magnitude.
    #[allow(clippy::too_many_arguments)]
    pub fn with_algo(
        shape: LoraShape,
        algo: ModuleAlgo,
        rank: usize,
        alpha: f64,
        dropout: f64,
        base: Option<&Tensor>,
        rng: &mut StdRng,
        device: &Device,
    ) -> Result<Self> {
        if rank == 0 {
            candle_core::bail!("{}: LoRA rank must be at least 1", shape.module_path);
        }
        if !(0.0..1.0).contains(&dropout) {
            candle_core::bail!("{}: dropout {dropout} is not in [0, 1)", shape.module_path);
        }
        if dropout > 0.0 && (algo.algo != Algo::LowRank || algo.dora) {
            candle_core::bail!("{}: dropout is only for LoRA/LoCon", shape.module_path);
        }
        let weight_dims = shape.weight_dims();
        let mut params = Vec::new();
        for ps in factors::param_shapes(algo.algo, &weight_dims, rank, algo.factor, algo.dora) {
            let values = draw(ps.init, &ps.dims, base, rng)?;
            params.push((ps.suffix, Var::from_vec(values, ps.dims, device)?));
        }
        let dropout_seed = rng.random::<u64>();
        Ok(Self {
            module_path: shape.module_path,
            component: shape.component,
            algo: algo.algo,
            params,
            alpha,
            rank,
            dropout,
            kind: shape.kind,
            weight_dims,
            training: AtomicBool::new(false),
            bypassed: AtomicBool::new(false),
            rng: Mutex::new(StdRng::seed_from_u64(dropout_seed)),
            dropout_seed,
            extra_dropout: std::sync::OnceLock::new(),
        })
    }

    /// Sets kohya's rank and module dropout ([`ExtraDropout`]) for the module's life; refused
    /// outside [0, 1), for LoHa, LoKr and DoRA, and a second time.
    pub fn set_extra_dropout(&self, e: ExtraDropout) -> Result<()> {
        if ![e.rank, e.module].iter().all(|p| (0.0..1.0).contains(p)) {
            candle_core::bail!(
                "{}: rank dropout {} and module dropout {} must be in [0, 1)",
                self.module_path,
                e.rank,
                e.module
            );
        }
        if (e.rank > 0.0 || e.module > 0.0) && (self.algo != Algo::LowRank || self.is_dora()) {
            candle_core::bail!(
                "{}: rank and module dropout are for LoRA/LoCon",
                self.module_path
            );
        }
        self.extra_dropout.set(e).map_err(|_| {
            candle_core::Error::Msg(format!("{}: dropout set twice", self.module_path))
        })
    }

    fn extra_dropout(&self) -> ExtraDropout {
        self.extra_dropout.get().copied().unwrap_or_default()
    }

    /// The scale this forward applies: [`LoraModule::scale`], or 0 when module dropout drops the
    /// module for this forward (one draw from the module's stream, replayed under gradient
    /// checkpointing).
    fn forward_scale(&self) -> Result<f64> {
        let p = self.extra_dropout().module;
        if p <= 0.0 || !self.is_training() {
            return Ok(self.scale());
        }
        let draw = {
            let mut rng = self
                .rng
                .lock()
                .map_err(|_| candle_core::Error::Msg("LoRA dropout: poisoned RNG lock".into()))?;
            crate::nn::replayable(&mut rng, |rng| rng.random::<f64>())
        };
        Ok(if draw < p { 0.0 } else { self.scale() })
    }

    /// The Var stored under `suffix`, if this module has one.
    pub fn var(&self, suffix: &str) -> Option<&Var> {
        self.params
            .iter()
            .find(|(s, _)| *s == suffix)
            .map(|(_, v)| v)
    }

    /// Every trainable Var, in init order.
    pub fn vars(&self) -> Vec<&Var> {
        self.params.iter().map(|(_, v)| v).collect()
    }

    /// Whether DoRA's magnitude is trained.
    pub fn is_dora(&self) -> bool {
        self.var(DORA_SCALE).is_some()
    }

    /// The device the module lives on.
    pub fn device(&self) -> Device {
        self.params
            .first()
            .map_or(Device::Cpu, |(_, v)| v.device().clone())
    }

    fn get(&self, suffix: &str) -> Option<Tensor> {
        self.var(suffix).map(|v| v.as_tensor().clone())
    }

    /// The update's scale ([`factors::scale`]): `alpha / rank`, or 1 for a LoKr whose halves are
    /// both full.
    pub fn scale(&self) -> f64 {
        factors::scale(self.algo, &|s| self.get(s), self.alpha).unwrap_or(1.0)
    }

    /// The alpha written to the file: LyCORIS writes the rank for a LoKr of two full halves
    /// (whose scale is 1 whatever alpha says).
    pub fn saved_alpha(&self) -> f64 {
        match self.algo {
            Algo::Kron if self.var(LOKR_W1_A).is_none() && self.var(LOKR_W2_A).is_none() => {
                self.rank as f64
            }
            Algo::LowRank | Algo::Hadamard | Algo::Kron => self.alpha,
        }
    }

    /// `ΔW` without DoRA, f32, shaped like the wrapped weight, tracked through the Vars.
    pub fn delta_weight(&self) -> Result<Tensor> {
        factors::delta_weight(self.algo, &|s| self.get(s), self.alpha, &self.weight_dims)
    }

    /// The whole update to the weight `w` (f32, a constant): `ΔW`, or DoRA's `W' − W`.
    pub fn weight_update(&self, w: Option<&Tensor>) -> Result<Tensor> {
        let delta = self.delta_weight()?;
        match (self.get(DORA_SCALE), w) {
            (None, _) => Ok(delta),
            (Some(m), Some(w)) => factors::dora_update(&w.to_dtype(DType::F32)?, &delta, &m),
            (Some(_), None) => candle_core::bail!(
                "{}: a DoRA module needs its layer's weight",
                self.module_path
            ),
        }
    }

    /// Restarts the dropout mask stream for optimizer step `step`: the masks of a step depend
    /// only on the module's seed and the step, so a resumed run draws what the uninterrupted one
    /// drew.
    pub fn begin_step(&self, step: usize) {
        let mix = (step as u64)
            .wrapping_add(1)
            .wrapping_mul(0xD1B5_4A32_D192_ED03);
        if let Ok(mut rng) = self.rng.lock() {
            *rng = StdRng::seed_from_u64(self.dropout_seed ^ mix);
        }
    }

    /// Turns dropout on (training) or off (evaluation, sampling). Off by default.
    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed)
    }

    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// Takes the module out of its layer's forward (`true`) or puts it back: OneTrainer's prior
    /// model, the base without its adapters.
    pub fn set_bypassed(&self, on: bool) {
        self.bypassed.store(on, Ordering::Relaxed)
    }

    /// The inverted-dropout mask for `h`: each element 0 with probability `p`, else `1/(1-p)`,
    /// times kohya's rank dropout (each of the `batch` samples' rank channels 0 with probability
    /// `rank`, else `1/(1-rank)`), in `h`'s shape, dtype and device; `None` when both are off or
    /// the module evaluates. `h` is the rank-r `down` output, `(rows, r)` for a linear (the
    /// samples' rows in order) or `[B, r, H, W]` for a conv. The mask comes from the module's
    /// seeded RNG on the CPU (the elements' draws, then the rank channels'), and is small.
    fn dropout_mask(&self, h: &Tensor, batch: usize) -> Result<Option<Tensor>> {
        let (p, rank_p) = (self.dropout, self.extra_dropout().rank);
        if (p <= 0.0 && rank_p <= 0.0) || !self.is_training() {
            return Ok(None);
        }
        let n = h.elem_count();
        let (r, inner) = match (self.kind, h.dims()) {
            (LoraKind::Conv { .. }, [_, r, hh, ww]) => (*r, hh * ww),
            (_, dims) => (dims.last().copied().unwrap_or(1), 1),
        };
        let batch = batch.max(1);
        let mask: Vec<f32> = {
            let mut rng = self
                .rng
                .lock()
                .map_err(|_| candle_core::Error::Msg("LoRA dropout: poisoned RNG lock".into()))?;
            // Recorded and replayed under gradient checkpointing: the recomputation draws the
            // same mask.
            crate::nn::replayable(&mut rng, |rng| {
                let mut mask = vec![1f32; n];
                if p > 0.0 {
                    let keep = (1.0 / (1.0 - p)) as f32;
                    for m in mask.iter_mut() {
                        *m = if rng.random::<f64>() < p { 0.0 } else { keep };
                    }
                }
                if rank_p > 0.0 {
                    let keep = (1.0 / (1.0 - rank_p)) as f32;
                    let channels: Vec<f32> = (0..batch * r)
                        .map(|_| {
                            if rng.random::<f64>() < rank_p {
                                0.0
                            } else {
                                keep
                            }
                        })
                        .collect();
                    let per_sample = (n / batch).max(1);
                    for (i, m) in mask.iter_mut().enumerate() {
                        let b = (i / per_sample).min(batch - 1);
                        let c = (i / inner) % r.max(1);
                        *m *= channels[b * r + c];
                    }
                }
                mask
            })
        };
        Ok(Some(
            Tensor::from_vec(mask, h.shape(), h.device())?.to_dtype(h.dtype())?,
        ))
    }

    /// Inverted dropout on `h` ([`LoraModule::dropout_mask`]).
    fn dropout(&self, h: &Tensor, batch: usize) -> Result<Tensor> {
        match self.dropout_mask(h, batch)? {
            Some(mask) => h * mask,
            None => Ok(h.clone()),
        }
    }

    fn lora_pair(&self) -> Result<(Tensor, Tensor)> {
        match (self.get(DOWN), self.get(UP)) {
            (Some(d), Some(u)) => Ok((d, u)),
            _ => candle_core::bail!("{}: not a LoRA module", self.module_path),
        }
    }

    /// LoRA/LoCon: `s · up(dropout(down(x)))` through the two small layers.
    fn low_rank_delta(&self, x: &Tensor) -> Result<Tensor> {
        let (down, up) = self.lora_pair()?;
        let down = cast_like(&down, x)?;
        let up = cast_like(&up, x)?;
        let scale = self.forward_scale()?;
        let batch = batch_of(x);
        let y = match self.kind {
            LoraKind::Linear => {
                let dims = x.dims().to_vec();
                let in_dim = dims[dims.len() - 1];
                let rows = x.elem_count() / in_dim.max(1);
                // A frozen layer's input is a constant: store no gradient for it.
                let h = crate::nn::matmul_const_lhs(&x.reshape((rows, in_dim))?, &down)?;
                let h = self.dropout(&h, batch)?;
                let y = h.matmul(&up.t()?)?;
                let mut out_dims = dims;
                let last = out_dims.len() - 1;
                out_dims[last] = up.dim(0)?;
                y.reshape(out_dims)?
            }
            LoraKind::Conv {
                stride, padding, ..
            } => {
                let h = crate::nn::conv2d_const_input(x, &down, padding, stride)?;
                let h = self.dropout(&h, batch)?;
                // Not candle's conv2d: its backward takes the input gradient through candle's
                // naive conv_transpose2d (248 µs per 320-channel 64×64 layer on an H100).
                crate::nn::conv2d_trainable(&h, &up, 0, 1)?
            }
        };
        y.affine(scale, 0.0)
    }

    /// LoHa, LoKr, DoRA: the layer's own op on the rebuilt update, `op(x, ΔW)` (LyCORIS's
    /// default, non-bypass forward). `base` is the frozen weight DoRA normalises.
    fn rebuilt_delta(&self, x: &Tensor, base: Option<&BaseWeight>) -> Result<Tensor> {
        let w = base.map(|b| b.get(DType::F32)).transpose()?;
        let update = cast_like(&self.weight_update(w.as_ref())?, x)?;
        match self.kind {
            LoraKind::Linear => {
                let dims = x.dims().to_vec();
                let in_dim = dims[dims.len() - 1];
                let rows = x.elem_count() / in_dim.max(1);
                let y = crate::nn::matmul_const_lhs(&x.reshape((rows, in_dim))?, &update)?;
                let mut out_dims = dims;
                let last = out_dims.len() - 1;
                out_dims[last] = update.dim(0)?;
                y.reshape(out_dims)
            }
            LoraKind::Conv {
                stride, padding, ..
            } => crate::nn::conv2d_const_input(x, &update, padding, stride),
        }
    }

    fn delta_in_dtype(&self, x: &Tensor, base: Option<&BaseWeight>) -> Result<Tensor> {
        if self.algo == Algo::LowRank && !self.is_dora() {
            self.low_rank_delta(x)
        } else {
            self.rebuilt_delta(x, base)
        }
    }

    fn delta_any(&self, x: &Tensor, base: Option<&BaseWeight>) -> Result<Tensor> {
        // No bf16 gemm/conv kernels on the CPU: compute in f32 and round once, like the base.
        if cpu_bf16(x) {
            return self
                .delta_in_dtype(&x.to_dtype(DType::F32)?, base)?
                .to_dtype(DType::BF16);
        }
        self.delta_in_dtype(x, base)
    }
}

impl LayerAdapter for LoraModule {
    fn active(&self) -> bool {
        !self.bypassed.load(Ordering::Relaxed)
    }

    fn delta(&self, x: &Tensor) -> Result<Tensor> {
        self.delta_any(x, None)
    }

    fn delta_on(&self, x: &Tensor, base: &BaseWeight) -> Result<Tensor> {
        self.delta_any(x, Some(base))
    }

    /// The frozen layer and this module as one op, which keeps less for the backward than the
    /// sum of the two. LoRA/LoCon (`nn::low_rank`): the input and the rank-r `down` output, not
    /// three layer-output-sized tensors. LoHa, LoKr, DoRA (`nn::rebuilt`): the input and the
    /// packed factors, none of the weight-sized tensors that rebuild `ΔW`.
    fn forward_frozen(
        &self,
        x: &Tensor,
        base: FrozenBase<'_>,
        residual: Option<&Tensor>,
    ) -> Option<Result<Tensor>> {
        if self.algo != Algo::LowRank || self.is_dora() {
            let y = self.rebuilt_forward(x, base);
            return Some(match residual {
                Some(r) => y.and_then(|y| add_maybe_const(&y, r)),
                None => y,
            });
        }
        Some(self.with_low_rank(batch_of(x), |lr| {
            self.fit(base).and_then(|layer| match layer {
                Fitted::Linear(w, b) => frozen_linear_low_rank(x, &w, b, lr, residual),
                Fitted::Conv(w, b, padding, stride) => {
                    frozen_conv2d_low_rank(x, &w, b, padding, stride, lr, residual)
                }
            })
        }))
    }

    fn derives_inputs(&self) -> bool {
        self.algo == Algo::LowRank && !self.is_dora()
    }

    /// LoRA on a linear after GEGLU (`ff.net.2`) or a frozen LayerNorm as one op with that
    /// input (`nn::low_rank_input`); the other algorithms and DoRA have no such form.
    fn forward_frozen_on(
        &self,
        a: &Tensor,
        input: &DerivedInput,
        value: Option<&Tensor>,
        base: FrozenBase<'_>,
        residual: Option<&Tensor>,
    ) -> Option<Result<Tensor>> {
        if !self.derives_inputs() {
            return None;
        }
        Some(self.with_low_rank(batch_of(a), |lr| match self.fit(base)? {
            Fitted::Linear(w, b) => frozen_linear_low_rank_on(a, input, value, &w, b, lr, residual),
            Fitted::Conv(..) => {
                candle_core::bail!("{}: a conv on a derived input", self.module_path)
            }
        }))
    }
}

impl LoraModule {
    /// `f` on this module's factors as the low-rank ops take them (`down`, `up`, the scale and
    /// the dropout mask).
    /// `batch`: the samples of the layer input, for rank dropout.
    fn with_low_rank(
        &self,
        batch: usize,
        f: impl FnOnce(LowRank<'_>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (down, up) = self.lora_pair()?;
        let scale = self.forward_scale()?;
        let mask = |h: &Tensor| self.dropout_mask(h, batch);
        f(LowRank {
            down: &down,
            up: &up,
            scale,
            dropout: &mask,
        })
    }
}

/// A frozen layer that fits its module: a linear's weight and bias, or a conv's with its padding
/// and stride.
enum Fitted<'a> {
    Linear(BaseWeight, Option<&'a Tensor>),
    Conv(BaseWeight, Option<&'a Tensor>, usize, usize),
}

impl LoraModule {
    /// The frozen layer as this module's kind expects it (a linear, or a conv with the module's
    /// padding and stride); an error naming the module when it does not fit.
    fn fit<'a>(&self, base: FrozenBase<'a>) -> Result<Fitted<'a>> {
        match (self.kind, base) {
            (LoraKind::Linear, FrozenBase::Linear { w, b }) => Ok(Fitted::Linear(w, b)),
            (
                LoraKind::Conv {
                    stride, padding, ..
                },
                FrozenBase::Conv {
                    w,
                    b,
                    padding: base_padding,
                    stride: base_stride,
                },
            ) if (stride, padding) == (base_stride, base_padding) => {
                Ok(Fitted::Conv(w, b, padding, stride))
            }
            (kind, base) => {
                let layer = match base {
                    FrozenBase::Linear { .. } => "a linear".to_string(),
                    FrozenBase::Conv {
                        padding, stride, ..
                    } => format!("a conv with padding {padding} and stride {stride}"),
                };
                candle_core::bail!(
                    "{}: a LoRA module of kind {kind:?} does not fit its layer, {layer}",
                    self.module_path
                )
            }
        }
    }

    /// The trainable tensors packed into one flat f32 vector (a tracked `cat`, so each Var gets
    /// its part of the gradient) and the function that rebuilds the whole update from it: `ΔW`,
    /// or DoRA's `W' − W` on the frozen weight `w`.
    fn packed_update(&self, w: &BaseWeight) -> Result<(Tensor, Rebuild)> {
        let parts = self
            .params
            .iter()
            .map(|(_, v)| v.as_tensor().flatten_all())
            .collect::<Result<Vec<_>>>()?;
        let packed = Tensor::cat(&parts, 0)?;
        let layout: Vec<(&'static str, Vec<usize>)> = self
            .params
            .iter()
            .map(|(s, v)| (*s, v.dims().to_vec()))
            .collect();
        let (algo, alpha, dims, w) = (self.algo, self.alpha, self.weight_dims.clone(), w.clone());
        let rebuild: Rebuild = Arc::new(move |theta: &Tensor| {
            let mut parts = Vec::with_capacity(layout.len());
            let mut at = 0;
            for (suffix, d) in &layout {
                let n: usize = d.iter().product();
                parts.push((*suffix, theta.narrow(0, at, n)?.reshape(d.as_slice())?));
                at += n;
            }
            let get = |s: &str| parts.iter().find(|(k, _)| *k == s).map(|(_, t)| t.clone());
            let delta = factors::delta_weight(algo, &get, alpha, &dims)?;
            match get(DORA_SCALE) {
                None => Ok(delta),
                Some(m) => factors::dora_update(&w.get(DType::F32)?, &delta, &m),
            }
        });
        Ok((packed, rebuild))
    }

    /// LoHa, LoKr, DoRA on a frozen layer: `op(x, W) + op(x, U) + b` as one op (`nn::rebuilt`).
    fn rebuilt_forward(&self, x: &Tensor, base: FrozenBase<'_>) -> Result<Tensor> {
        let w = match &base {
            FrozenBase::Linear { w, .. } | FrozenBase::Conv { w, .. } => w,
        };
        let (packed, rebuild) = self.packed_update(w)?;
        let up = WeightUpdate {
            packed: &packed,
            rebuild,
        };
        match self.fit(base)? {
            Fitted::Linear(w, b) => frozen_linear_rebuilt(x, &w, b, up),
            Fitted::Conv(w, b, padding, stride) => {
                frozen_conv2d_rebuilt(x, &w, b, padding, stride, up)
            }
        }
    }
}

/// The samples of a layer input: its first dimension (1 for a vector).
fn batch_of(x: &Tensor) -> usize {
    match x.dims() {
        [b, _, ..] => *b,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A LoRA of `rank` (alpha = rank) on a 4×4 linear.
    fn linear_module(rank: usize, dropout: f64, seed: u64) -> LoraModule {
        let shape = LoraShape {
            module_path: "t.to_q".into(),
            component: AdapterComponent::Unet,
            kind: LoraKind::Linear,
            in_dim: 4,
            out_dim: 4,
        };
        let mut rng = StdRng::seed_from_u64(seed);
        LoraModule::new(shape, rank, rank as f64, dropout, &mut rng, &Device::Cpu).unwrap()
    }

    fn module(dropout: f64) -> LoraModule {
        linear_module(2, dropout, 1)
    }

    /// A rank-4 LoRA on a 4×4 linear whose `down` and `up` are the identity (scale 1): its
    /// update is `x` times the dropout mask, which the tests read back.
    fn identity_module(extra: ExtraDropout) -> LoraModule {
        let m = linear_module(4, 0.0, 3);
        let eye = Tensor::eye(4, DType::F32, &Device::Cpu).unwrap();
        for (_, v) in &m.params {
            v.set(&eye).unwrap();
        }
        m.set_extra_dropout(extra).unwrap();
        m.set_training(true);
        m
    }

    /// The module's update for `x`, flattened.
    fn delta_values(m: &LoraModule, x: &Tensor) -> Vec<f32> {
        m.delta(x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// kohya's rank dropout: each sample's rank channel is zeroed or scaled by `1/(1−p)`, the
    /// same for every token of the sample; about `p` of them are zeroed; evaluation is exact.
    /// Catches a mask per token instead of per sample, a missing rescale, and dropout while
    /// sampling.
    #[test]
    fn rank_dropout_masks_each_samples_rank_channels() {
        let m = identity_module(ExtraDropout {
            rank: 0.5,
            module: 0.0,
        });
        let x = Tensor::ones((8, 5, 4), DType::F32, &Device::Cpu).unwrap();
        let (mut zeros, mut total) = (0, 0);
        for step in 0..10 {
            m.begin_step(step);
            let y: Vec<Vec<Vec<f32>>> = m.delta(&x).unwrap().to_vec3().unwrap();
            for sample in &y {
                for token in sample {
                    assert_eq!(token, &sample[0], "one mask per sample, not per token");
                }
                for &v in &sample[0] {
                    assert!(v == 0.0 || (v - 2.0).abs() < 1e-6, "{v}");
                    zeros += usize::from(v == 0.0);
                    total += 1;
                }
            }
        }
        let share = zeros as f64 / total as f64;
        assert!((share - 0.5).abs() < 0.1, "dropped share {share}");
        m.set_training(false);
        let y = delta_values(&m, &x);
        assert!(y.iter().all(|&v| v == 1.0));
    }

    /// kohya's module dropout: a forward adds nothing with probability `p` (all of its update
    /// zero, no gradient), else the whole update; never while evaluating.
    #[test]
    fn module_dropout_drops_whole_forwards() {
        let m = identity_module(ExtraDropout {
            rank: 0.0,
            module: 0.5,
        });
        let x = Tensor::ones((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let mut dropped = 0;
        for step in 0..200 {
            m.begin_step(step);
            let y = delta_values(&m, &x);
            let zero = y.iter().all(|&v| v == 0.0);
            assert!(zero || y.iter().all(|&v| v == 1.0));
            dropped += usize::from(zero);
        }
        assert!(
            (60..140).contains(&dropped),
            "{dropped} of 200 forwards dropped"
        );
        m.set_training(false);
        let y = delta_values(&m, &x);
        assert!(y.iter().all(|&v| v == 1.0));
        assert!(
            m.set_extra_dropout(ExtraDropout::default()).is_err(),
            "set twice"
        );
        let fresh = module(0.0);
        let out_of_range = ExtraDropout {
            rank: 1.0,
            module: 0.0,
        };
        assert!(fresh.set_extra_dropout(out_of_range).is_err());
    }

    /// The one-op forward on a frozen layer (`nn::low_rank`, what training runs) draws the masks
    /// and the module draw the composed `base + delta` form draws, for a linear (rows of several
    /// samples) and a conv: same output at the same step.
    #[test]
    fn rank_and_module_dropout_agree_between_the_one_op_and_composed_forms() {
        use crate::nn::test_util::randn;
        for dims in [vec![8usize, 12], vec![8, 6, 3, 3]] {
            let shape = LoraShape {
                module_path: "t.proj".into(),
                component: AdapterComponent::Unet,
                kind: match dims.len() {
                    2 => LoraKind::Linear,
                    _ => LoraKind::Conv {
                        kernel: 3,
                        stride: 1,
                        padding: 1,
                    },
                },
                in_dim: dims[1],
                out_dim: dims[0],
            };
            let m = LoraModule::new(
                shape,
                3,
                3.0,
                0.25,
                &mut StdRng::seed_from_u64(5),
                &Device::Cpu,
            )
            .unwrap();
            for (i, (_, v)) in m.params.iter().enumerate() {
                v.set(&randn(v.dims(), 10 + i as u64)).unwrap();
            }
            m.set_extra_dropout(ExtraDropout {
                rank: 0.5,
                module: 0.3,
            })
            .unwrap();
            m.set_training(true);
            let w = randn(&dims, 1);
            let x = match dims.len() {
                2 => randn(&[3, 5, 12], 3),
                _ => randn(&[3, 6, 5, 4], 3),
            };
            let base = BaseWeight::plain(&w);
            for step in 0..6 {
                m.begin_step(step);
                let frozen = match dims.len() {
                    2 => FrozenBase::Linear {
                        w: base.clone(),
                        b: None,
                    },
                    _ => FrozenBase::Conv {
                        w: base.clone(),
                        b: None,
                        padding: 1,
                        stride: 1,
                    },
                };
                let one = m.forward_frozen(&x, frozen, None).unwrap().unwrap();
                m.begin_step(step);
                let plain = match dims.len() {
                    2 => x.broadcast_matmul(&w.t().unwrap()).unwrap(),
                    _ => x.conv2d(&w, 1, 1, 1, 1).unwrap(),
                };
                let composed = (plain + m.delta_on(&x, &base).unwrap()).unwrap();
                let e = crate::nn::test_util::max_abs(&one, &composed);
                assert!(e < 1e-4, "{dims:?} step {step}: differs by {e}");
            }
        }
    }

    #[test]
    fn dropout_scales_kept_elements_by_inverse_keep_probability() {
        let m = module(0.25);
        m.set_training(true);
        let h = Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap();
        let v = m
            .dropout(&h, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let kept: Vec<f32> = v.iter().copied().filter(|&x| x != 0.0).collect();
        assert!(
            kept.iter().all(|&x| (x - 1.0 / 0.75).abs() < 1e-6),
            "{:?}",
            &kept[..4]
        );
        let dropped = (v.len() - kept.len()) as f64 / v.len() as f64;
        assert!((dropped - 0.25).abs() < 0.03, "dropped fraction {dropped}");
        // The mean is preserved in expectation (inverted dropout).
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn dropout_is_identity_when_evaluating() {
        let m = module(0.5);
        let h = Tensor::ones((8, 8), DType::F32, &Device::Cpu).unwrap();
        let v = m
            .dropout(&h, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(v.iter().all(|&x| x == 1.0));
    }

    /// A module of `algo` on a layer of `weight_dims` (linear or 3×3 conv, padding 1), every
    /// factor set to seeded non-zero draws (the inits leave some at zero).
    fn rebuilt_module(algo: ModuleAlgo, weight_dims: &[usize], base: &Tensor) -> LoraModule {
        let kind = match weight_dims.len() {
            2 => LoraKind::Linear,
            _ => LoraKind::Conv {
                kernel: 3,
                stride: 1,
                padding: 1,
            },
        };
        let shape = LoraShape {
            module_path: "t.layer".into(),
            component: AdapterComponent::Unet,
            kind,
            in_dim: weight_dims[1],
            out_dim: weight_dims[0],
        };
        let mut rng = StdRng::seed_from_u64(3);
        let m = LoraModule::with_algo(shape, algo, 2, 1.5, 0.0, Some(base), &mut rng, &Device::Cpu)
            .unwrap();
        for (i, v) in m.vars().into_iter().enumerate() {
            let t = crate::nn::test_util::randn(v.dims(), 10 + i as u64);
            v.set(&(t * 0.5).unwrap()).unwrap();
        }
        m
    }

    /// The one-op forward of LoHa, LoKr (both factorisations) and DoRA on a frozen linear and a
    /// 3×3 conv gives the output and every factor's gradient of the composed form, the base layer
    /// plus `op(x, ΔW)`. Catches factors unpacked in the wrong order or at the wrong offset.
    #[test]
    fn one_op_forward_matches_the_composed_form() {
        use crate::nn::test_util::randn;
        let lokr_full = ModuleAlgo {
            algo: Algo::Kron,
            factor: 2,
            dora: false,
        };
        let algos = [
            ModuleAlgo {
                algo: Algo::Hadamard,
                factor: -1,
                dora: false,
            },
            ModuleAlgo {
                algo: Algo::Kron,
                factor: -1,
                dora: false,
            },
            lokr_full,
            ModuleAlgo {
                dora: true,
                ..ModuleAlgo::LORA
            },
            ModuleAlgo {
                algo: Algo::Hadamard,
                factor: -1,
                dora: true,
            },
        ];
        for dims in [vec![8usize, 12], vec![8, 6, 3, 3]] {
            let w = randn(&dims, 1);
            let b = randn(&dims[..1], 2);
            let x = match dims.len() {
                2 => randn(&[5, 12], 3),
                _ => randn(&[2, 6, 5, 4], 3),
            };
            let r = |y: &Tensor| crate::nn::test_util::randn(y.dims(), 4);
            for algo in algos {
                let m = rebuilt_module(algo, &dims, &w);
                let base = BaseWeight::plain(&w);
                let frozen = match dims.len() {
                    2 => FrozenBase::Linear {
                        w: base.clone(),
                        b: Some(&b),
                    },
                    _ => FrozenBase::Conv {
                        w: base.clone(),
                        b: Some(&b),
                        padding: 1,
                        stride: 1,
                    },
                };
                let one = m.forward_frozen(&x, frozen, None).unwrap().unwrap();
                let plain = match dims.len() {
                    2 => x.matmul(&w.t().unwrap()).unwrap().broadcast_add(&b),
                    _ => x
                        .conv2d(&w, 1, 1, 1, 1)
                        .unwrap()
                        .broadcast_add(&b.reshape((8, 1, 1)).unwrap()),
                };
                let composed = (plain.unwrap() + m.delta_on(&x, &base).unwrap()).unwrap();
                let what = format!("{algo:?} on {dims:?}");
                let e = crate::nn::test_util::max_abs(&one, &composed);
                assert!(e < 1e-4, "{what}: output differs by {e}");
                let g1 = (&one * r(&one))
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let g2 = (&composed * r(&composed))
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                for (suffix, v) in &m.params {
                    let (a, c) = (
                        g1.get(v.as_tensor()).unwrap(),
                        g2.get(v.as_tensor()).unwrap(),
                    );
                    let e = crate::nn::test_util::max_abs(a, c);
                    let scale = crate::nn::test_util::max_abs(c, &c.zeros_like().unwrap());
                    assert!(
                        e <= 1e-4 * scale.max(1.0),
                        "{what}: {suffix} grad differs by {e}"
                    );
                }
            }
        }
    }
}
