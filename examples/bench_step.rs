//! Training-step benchmark on the real UNet configs, on CUDA or the CPU: one forward, backward
//! and AdamW step per iteration, as the trainer runs it (the loss and gradient check fetched in
//! one copy, then `step_checked`). Random weights; the VAE and text encoders are replaced by
//! random latents and random text conditioning, which is what they feed the UNet.
//!
//! ```text
//! cargo run --release --example bench_step -- --family sd15 --mode lora --res 512 --batch 1 \
//!     --precision bf16 [--device cuda] [--steps 10] [--warmup 3] [--rank 16] \
//!     [--pool-cache on|off] [--event-tracking on|off] [--fused-ops on|off] \
//!     [--unet-config PATH] [--checkpointing on|off] [--profile-last-step] \
//!     [--weight-dtype f32|bf16] [--fused] [--fp8-base]
//! ```
//! - `--fp8-base` (`lora`): the frozen UNet's Linear and Conv2d weights stored as e4m3 codes with
//!   a scale per output channel (`base_weight_dtype: "fp8"`), dequantised where used.
//! - `--fused`: each parameter updated inside the backward pass as its gradient completes
//!   (`Tensor::backward_with` and the checkpointed segments' sink, the trainer's
//!   `fused_backward_pass`).
//! - `--heap-census` (CPU): the last step reports the host heap (a counting allocator): held
//!   before it, held by the forward graph once the loss exists, the step's peak, and the
//!   graph's largest tracked tensors by shape; what the activation-memory work measures.
//!   `--heap-peak-site` adds what the peak is made of: the allocations of 256 KiB or more live at
//!   it, grouped by the `BENCH_SITE_DEPTH` (3) innermost sdtrain frames that made them (a
//!   backtrace per large allocation, which slows the step; build with debug line tables).
//! - `--op-census` (feature `op-census`): the last step's candle storage ops counted by kind with
//!   the bytes each writes, and the `--op-census-top N` (25) call sites of the strided copies,
//!   casts and broadcast binaries, each named by its `--op-census-depth N` (1) innermost sdtrain
//!   frames (`op_census` in the report; a table on stderr). `--op-census-sites a,b` records the
//!   sites of the kinds containing `a` or `b` instead (`all`: every op). Counting slows that step.
//! - `--profile-last-step`: the CUDA profiler collects during the last step only
//!   (`ncu --profile-from-start off`; scripts/gpu-kernel-profile).
//! - `lora`: frozen base (bf16 under `--precision bf16`), LoRA rank/alpha `--rank` on kohya's
//!   UNet targets, f32 adapter Vars.
//! - `full`: every UNet weight an f32 Var; under `bf16` the activations are bf16 and each layer
//!   casts its f32 weight to bf16 (autocast's scheme; the casts' backward returns f32 grads).
//!   `--weight-dtype bf16` stores the weights in bf16 instead (the trainer's `weight_dtype`):
//!   bf16 gradients, and the optimizer rounds each update back stochastically.
//!
//! - `--fused-ops off`: the norms, masked softmax and GEGLU run their composed `*_reference`
//!   ops instead of the fused ones (`nn::set_fused_ops_enabled`), for before/after figures.
//! - `--checkpoint-blocks down_blocks.0,up_blocks.3`: checkpointing of those UNet blocks only,
//!   as `gradient_checkpointing: "auto"` may choose them (implies `--checkpointing on`).
//! - `--checkpointing on`: gradient checkpointing of every resnet and transformer block, as
//!   the trainer's `gradient_checkpointing` (the recomputed parameter gradients are merged into
//!   the store before the check and the optimizer step).
//! - `--unet-config PATH`: a diffusers UNet `config.json` instead of the family's (e.g. the tiny
//!   test fixture, for a CPU benchmark whose memory is dominated by activations); the text
//!   conditioning width follows its `cross_attention_dim`.
//!
//! Prints ONE JSON line: status (`ok`, `oom`, `error: …`), median step time and the phases
//! (forward, backward, check + optimizer; synchronised at each boundary), peak memory (the CUDA
//! pool's high-water mark since start, weights and optimizer state included; RSS on the CPU),
//! the card's memory in use, and the gradient-store census (entries vs trained Vars). It is run
//! by `scripts/gpu-check`, one process per shape, so one shape's OOM cannot affect the next.

#[path = "support/bench.rs"]
#[allow(dead_code)]
mod bench;
#[path = "support/counting_alloc.rs"]
mod counting_alloc;
#[path = "support/op_census.rs"]
mod op_census;

#[global_allocator]
static ALLOC: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bench::arg;
use candle_core::{DType, Device, Tensor, Var};
use sdtrain::adapter::{adapter_vars, attach_unet, AdapterMode, AdapterSpec};
use sdtrain::memory::{prepare_device, DeviceSettings, MemoryUsage};
use sdtrain::model::reference_configs::{SD15_UNET, SDXL_UNET};
use sdtrain::model::unet::{AddedConditions, UNet2DConditionModel, UnetConfig};
use sdtrain::model::weights::Weights;
use sdtrain::optim::{
    Adafactor, AdafactorParams, AdamW, AdamW8bit, AdamWParams, AdamWScheduleFree, Came, CameParams,
    GroupOptimizer, Lion, LionParams, Optimizer, Prodigy, ProdigyParams, ScheduleFreeParams,
    StepCheck, UpdateRule,
};
use serde_json::{json, Value};

struct Shape {
    family: String,
    mode: String,
    res: usize,
    batch: usize,
    precision: String,
    rank: usize,
    unet_config: Option<String>,
    /// adamw (default), adamw8bit, lion, lion8bit or adafactor.
    optimizer: String,
    /// `full`: the trained weights' dtype (f32 or bf16).
    weight_dtype: DType,
    /// `--fp8-base` (`lora`): the frozen base's layer weights in fp8 (`base_weight_dtype`).
    fp8_base: bool,
}

struct Model {
    unet: UNet2DConditionModel,
    vars: Vec<Var>,
    /// Shared with the fused backward's sink while it runs.
    optimizer: std::rc::Rc<std::cell::RefCell<GroupOptimizer>>,
    params_total: usize,
    /// Activation dtype.
    dtype: DType,
    /// Width of the text conditioning.
    ctx_dim: usize,
    checkpointing: Option<sdtrain::nn::Checkpointing>,
    /// `--fused`: update each parameter inside the backward pass.
    fused: bool,
}

struct Inputs {
    x: Tensor,
    t: Tensor,
    ctx: Tensor,
    added: Option<AddedConditions>,
    target: Tensor,
}

#[derive(Default)]
struct Times {
    total: Vec<f64>,
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    opt: Vec<f64>,
}

fn on_off(args: &[String], name: &str, default: &str) -> Result<bool> {
    match arg(args, name, default).as_str() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("{name} {other}: use on or off"),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mut report = json!({ "impl": "sdtrain" });
    let status = match run(&args, &mut report) {
        Ok(()) => "ok".to_string(),
        Err(e) => {
            // The cause chain without candle's backtrace (RUST_BACKTRACE=1 appends one).
            let text = format!("{e:#}")
                .lines()
                .next()
                .unwrap_or_default()
                .to_string();
            if is_oom(&text) {
                "oom".to_string()
            } else {
                format!("error: {text}")
            }
        }
    };
    report["status"] = Value::String(status);
    println!("{report}");
    ExitCode::SUCCESS
}

/// Out-of-memory from the driver, cuBLAS or the allocator. (The trainer's typed classifier is
/// the OOM-retry work; a benchmark only needs to label the row.)
fn is_oom(text: &str) -> bool {
    ["OUT_OF_MEMORY", "out of memory", "ALLOC_FAILED"]
        .iter()
        .any(|p| text.contains(p))
}

/// `--op-profile`: each op class of an SD1.5 step at 512 px, batch 1, alone, forward + backward,
/// synchronised: the 320-channel 3×3 conv as the trainer runs it (`conv3x3_fwd`,
/// `conv3x3_input_grad`, `conv3x3_weight_grad`: our kernels on CUDA and the CPU) beside candle's
/// conv and the older input-gradient forms (candle's conv_transpose2d, the flipped-kernel GEMM),
/// self-attention over 4096 tokens (chunked, and the composed reference), GroupNorm, and the
/// fused kernels and attention paths of [`fused_kernel_profile`]. Medians of 5 after 2 warm-ups,
/// in ms.
fn op_profile(device: &Device, dtype: DType, report: &mut Value) -> Result<()> {
    use sdtrain::nn::{
        attention, conv2d_input_grad_col2im, conv2d_input_grad_gemm, conv2d_input_grad_reference,
    };
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut t = Vec::new();
        for i in 0..7 {
            device.synchronize()?;
            let s = Instant::now();
            f()?;
            device.synchronize()?;
            if i >= 2 {
                t.push(s.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(round2(median(&mut t)))
    };
    let randn = |dims: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, dims, device)?.to_dtype(dtype)?)
    };
    let (x, w, g) = (
        randn(&[1, 320, 64, 64])?,
        randn(&[320, 320, 3, 3])?,
        randn(&[1, 320, 64, 64])?,
    );
    let mut ops = serde_json::Map::new();
    ops.insert(
        "conv3x3_fwd".into(),
        json!(time(&mut || {
            sdtrain::nn::conv2d_detached(&x, &w, 1, 1)?;
            Ok(())
        })?),
    );
    ops.insert(
        "conv3x3_fwd_candle".into(),
        json!(time(&mut || {
            x.conv2d(&w, 1, 1, 1, 1)?;
            Ok(())
        })?),
    );
    ops.insert(
        "conv3x3_input_grad".into(),
        json!(time(&mut || {
            sdtrain::nn::conv2d_input_grad(&g, &w, 1, 1, (64, 64))?;
            Ok(())
        })?),
    );
    ops.insert(
        "conv3x3_input_grad_conv_transpose".into(),
        json!(time(&mut || {
            conv2d_input_grad_reference(&g, &w, 1, 1, (64, 64))?;
            Ok(())
        })?),
    );
    ops.insert(
        "conv3x3_input_grad_gemm".into(),
        json!(time(&mut || {
            conv2d_input_grad_gemm(&g, &w, 1, 1, (64, 64))?;
            Ok(())
        })?),
    );
    if device.is_cpu() {
        ops.insert(
            "conv3x3_input_grad_col2im".into(),
            json!(time(&mut || {
                conv2d_input_grad_col2im(&g, &w, 1, 1, (64, 64))?;
                Ok(())
            })?),
        );
    }
    ops.insert(
        "conv3x3_weight_grad".into(),
        json!(time(&mut || {
            sdtrain::nn::conv2d_weight_grad(&x, &g, 1, 1, (3, 3))?;
            Ok(())
        })?),
    );
    let q = Var::from_tensor(&randn(&[1, 4096, 320])?)?;
    let (k, v) = (randn(&[1, 4096, 320])?, randn(&[1, 4096, 320])?);
    ops.insert(
        "self_attention_4096_fwd_bwd".into(),
        json!(time(&mut || {
            let o = attention(q.as_tensor(), &k, &v, 8, None)?;
            o.to_dtype(DType::F32)?.sum_all()?.backward()?;
            Ok(())
        })?),
    );
    ops.insert(
        "self_attention_4096_fwd_bwd_composed".into(),
        json!(time(&mut || {
            let o = sdtrain::nn::attention_reference(q.as_tensor(), &k, &v, 8, None)?;
            o.to_dtype(DType::F32)?.sum_all()?.backward()?;
            Ok(())
        })?),
    );
    let xn = Var::from_tensor(&randn(&[1, 320, 64, 64])?)?;
    let gn = sdtrain::nn::GroupNorm::new(
        &Weights::random(0, "gn", dtype, device, false),
        32,
        320,
        1e-5,
    )?;
    ops.insert(
        "group_norm_fwd_bwd".into(),
        json!(time(&mut || {
            gn.forward(xn.as_tensor())?
                .to_dtype(DType::F32)?
                .sum_all()?
                .backward()?;
            Ok(())
        })?),
    );
    fused_kernel_profile(device, dtype, &time, &mut ops)?;
    report["op_ms"] = Value::Object(ops);
    Ok(())
}

/// Times one op (forward + backward), synchronised: the median of 5 runs after 2, in ms.
type Timer<'a> = dyn Fn(&mut dyn FnMut() -> Result<()>) -> Result<f64> + 'a;

/// The fused kernels against their composed references, forward + backward at SD1.5's 512 px
/// shapes, and attention by path (flash, chunked) at each UNet level and for cross-attention.
fn fused_kernel_profile(
    device: &Device,
    dtype: DType,
    time: &Timer<'_>,
    ops: &mut serde_json::Map<String, Value>,
) -> Result<()> {
    use sdtrain::nn as n;
    let randn = |dims: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, dims, device)?.to_dtype(dtype)?)
    };
    let bwd = |t: Tensor| -> Result<()> {
        t.to_dtype(DType::F32)?.sum_all()?.backward()?;
        Ok(())
    };
    let x = Var::from_tensor(&randn(&[1, 320, 64, 64])?)?;
    let (w, b) = (randn(&[320])?, randn(&[320])?);
    let xl = Var::from_tensor(&randn(&[1, 4096, 320])?)?;
    let p = Var::from_tensor(&randn(&[1, 4096, 2560])?)?;
    type Op<'a> = (&'a str, Box<dyn Fn() -> Result<Tensor> + 'a>);
    let cases: Vec<Op> = vec![
        (
            "gn_fused",
            Box::new(|| Ok(n::group_norm(x.as_tensor(), &w, &b, 32, 1e-5)?)),
        ),
        (
            "gn_composed",
            Box::new(|| Ok(n::group_norm_reference(x.as_tensor(), &w, &b, 32, 1e-5)?)),
        ),
        (
            "gn_silu_fused",
            Box::new(|| Ok(n::group_norm_silu(x.as_tensor(), &w, &b, 32, 1e-5)?)),
        ),
        (
            "gn_silu_composed",
            Box::new(|| {
                Ok(n::group_norm_silu_reference(
                    x.as_tensor(),
                    &w,
                    &b,
                    32,
                    1e-5,
                )?)
            }),
        ),
        (
            "ln_fused",
            Box::new(|| Ok(n::layer_norm(xl.as_tensor(), &w, &b, 1e-5)?)),
        ),
        (
            "ln_composed",
            Box::new(|| Ok(n::layer_norm_reference(xl.as_tensor(), &w, &b, 1e-5)?)),
        ),
        ("geglu_fused", Box::new(|| Ok(n::geglu(p.as_tensor())?))),
        (
            "geglu_composed",
            Box::new(|| Ok(n::geglu_reference(p.as_tensor())?)),
        ),
    ];
    for (name, f) in &cases {
        ops.insert(name.to_string(), json!(time(&mut || bwd(f()?))?));
    }
    // (tokens, keys, heads·dim, label): SD1.5 self-attention at the three levels, cross-attention.
    for (lq, lk, inner, heads, label) in [
        (4096, 4096, 320, 8, "self_4096_d40"),
        (1024, 1024, 640, 8, "self_1024_d80"),
        (256, 256, 1280, 8, "self_256_d160"),
        (4096, 77, 320, 8, "cross_4096x77_d40"),
        (4096, 4096, 640, 10, "self_4096_d64"),
    ] {
        let q = Var::from_tensor(&randn(&[1, lq, inner])?)?;
        let (k, v) = (randn(&[1, lk, inner])?, randn(&[1, lk, inner])?);
        ops.insert(
            format!("attn_{label}_default"),
            json!(time(&mut || bwd(n::attention(
                q.as_tensor(),
                &k,
                &v,
                heads,
                None
            )?))?),
        );
        let d = inner / heads;
        let split = |t: &Tensor, l: usize| -> Result<Tensor> {
            Ok(t.reshape((1, l, heads, d))?.transpose(1, 2)?.contiguous()?)
        };
        let (qs, ks, vs) = (split(q.as_tensor(), lq)?, split(&k, lk)?, split(&v, lk)?);
        let qv = Var::from_tensor(&qs)?;
        let scale = 1.0 / (d as f64).sqrt();
        ops.insert(
            format!("attn_{label}_chunked"),
            json!(time(&mut || bwd(n::chunked_attention(
                qv.as_tensor(),
                &ks,
                &vs,
                scale,
                None
            )?))?),
        );
        // Flash (tensor cores for bf16/f16 where the card has them), and the same call on the
        // SIMT kernels.
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            type Flash = fn(&Tensor, &Tensor, &Tensor, f64, bool) -> candle_core::Result<Tensor>;
            let kernels: [(&str, Flash); 2] = [
                ("flash", n::flash_attention),
                ("flash_simt", n::flash_attention_simt),
            ];
            for (name, flash) in kernels {
                ops.insert(
                    format!("attn_{label}_{name}"),
                    json!(time(&mut || bwd(flash(
                        qv.as_tensor(),
                        &ks,
                        &vs,
                        scale,
                        false
                    )?))?),
                );
            }
        }
    }
    Ok(())
}

fn run(args: &[String], report: &mut Value) -> Result<()> {
    let shape = Shape {
        family: arg(args, "--family", "sd15"),
        mode: arg(args, "--mode", "lora"),
        res: arg(args, "--res", "512").parse().context("--res")?,
        batch: arg(args, "--batch", "1").parse().context("--batch")?,
        precision: arg(args, "--precision", "bf16"),
        rank: arg(args, "--rank", "16").parse().context("--rank")?,
        unet_config: args
            .iter()
            .position(|a| a == "--unet-config")
            .and_then(|i| args.get(i + 1).cloned()),
        optimizer: arg(args, "--optimizer", "adamw"),
        weight_dtype: match arg(args, "--weight-dtype", "f32").as_str() {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            other => bail!("--weight-dtype {other}: use f32 or bf16"),
        },
        fp8_base: args.iter().any(|a| a == "--fp8-base"),
    };
    report["fp8_base"] = json!(shape.fp8_base);
    report["optimizer"] = json!(shape.optimizer);
    report["weight_dtype"] = json!(format!("{:?}", shape.weight_dtype).to_lowercase());
    let blocks: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--checkpoint-blocks")
        .and_then(|i| args.get(i + 1))
        .map(|l| l.split(',').map(str::to_string).collect());
    let checkpointing = blocks.is_some() || on_off(args, "--checkpointing", "off")?;
    report["checkpointing"] = json!(checkpointing);
    report["checkpoint_blocks"] = json!(blocks);
    let fused_ops = on_off(args, "--fused-ops", "on")?;
    sdtrain::nn::set_fused_ops_enabled(fused_ops);
    report["fused_ops"] = json!(fused_ops);
    // SDTRAIN_FLASH_TC=0 keeps bf16/f16 flash attention on the SIMT kernels: the "before" row of
    // the tensor-core kernels in scripts/gpu-check.
    #[cfg(feature = "cuda")]
    if !sdtrain::nn::tensor_cores_enabled() {
        report["variant"] = json!("SIMT flash attention (SDTRAIN_FLASH_TC=0)");
    }
    let steps: usize = arg(args, "--steps", "10").parse().context("--steps")?;
    let warmup: usize = arg(args, "--warmup", "3").parse().context("--warmup")?;
    let settings = DeviceSettings {
        pool_cache: on_off(args, "--pool-cache", "on")?,
        event_tracking: on_off(args, "--event-tracking", "off")?,
    };
    for (k, v) in [
        ("family", json!(shape.family)),
        ("mode", json!(shape.mode)),
        ("res", json!(shape.res)),
        ("batch", json!(shape.batch)),
        ("precision", json!(shape.precision)),
        ("pool_cache", json!(settings.pool_cache)),
        ("event_tracking", json!(settings.event_tracking)),
    ] {
        report[k] = v;
    }
    let device = match arg(args, "--device", "cuda").as_str() {
        "cuda" => Device::new_cuda(0).context("no CUDA device")?,
        "cpu" => Device::Cpu,
        other => bail!("--device {other}: use cuda or cpu"),
    };
    prepare_device(&device, settings)?;
    if args.iter().any(|a| a == "--op-profile") {
        let dtype = if shape.precision == "bf16" {
            DType::BF16
        } else {
            DType::F32
        };
        return op_profile(&device, dtype, report);
    }
    let loaded = Instant::now();
    let mut model = build(&shape, &device)?;
    model.fused = args.iter().any(|a| a == "--fused");
    report["fused"] = json!(model.fused);
    if checkpointing {
        let ck = sdtrain::nn::Checkpointing::new(model.vars.clone(), &device)?;
        model.unet.checkpointing = Some(ck.clone());
        model.checkpointing = Some(ck);
        if let Some(names) = &blocks {
            model.unet.checkpointed = checkpointed_blocks(&model.unet.config, names)?;
        }
    }
    report["params_total"] = json!(model.params_total);
    report["params_trained"] = json!(model.vars.iter().map(|v| v.elem_count()).sum::<usize>());
    report["optimizer_state_bytes"] = json!(model.optimizer.borrow().state_bytes());
    let inputs = inputs(&shape, &device, model.dtype, model.ctx_dim)?;
    device.synchronize()?;
    report["load_s"] = json!(loaded.elapsed().as_secs_f64());

    let mut times = Times::default();
    let profile_last = args.iter().any(|a| a == "--profile-last-step");
    let census_wanted = args.iter().any(|a| a == "--heap-census");
    if census_wanted && !device.is_cpu() {
        bail!("--heap-census counts host memory: use --device cpu");
    }
    let ops_wanted = args.iter().any(|a| a == "--op-census");
    for i in 0..warmup + steps {
        let last = i + 1 == warmup + steps;
        if profile_last && last {
            profiler(true)?;
        }
        let heap = (last && census_wanted).then_some(&mut *report);
        if ops_wanted && last {
            op_census::start(args)?;
        }
        let (t, census) = step(&mut model, &inputs, &device, heap)?;
        if ops_wanted && last {
            report["op_census"] = op_census::finish(args)?;
        }
        if profile_last && last {
            profiler(false)?;
        }
        if i == 0 {
            report["grad_entries"] = json!(census.0);
            report["vars_with_grad"] = json!(census.1);
            report["vars"] = json!(model.vars.len());
            report["loss_first"] = json!(census.2);
        }
        if i >= warmup {
            times.total.push(t[0]);
            times.fwd.push(t[1]);
            times.bwd.push(t[2]);
            times.opt.push(t[3]);
        }
    }
    let ms = |v: &mut Vec<f64>| median(v) * 1e3;
    let step_ms = ms(&mut times.total);
    report["step_ms_median"] = json!(round2(step_ms));
    report["fwd_ms"] = json!(round2(ms(&mut times.fwd)));
    report["bwd_ms"] = json!(round2(ms(&mut times.bwd)));
    report["opt_ms"] = json!(round2(ms(&mut times.opt)));
    report["img_per_s"] = json!(round2(shape.batch as f64 * 1e3 / step_ms));
    if let Some(m) = MemoryUsage::read(&device)? {
        report["peak_gib"] = json!(round2(m.peak_gib()));
        report["memory_source"] = json!(m.source);
        if let (Some(free), Some(total)) = (m.device_free_bytes, m.device_total_bytes) {
            report["card_used_gib"] = json!(round2((total - free) as f64 / (1u64 << 30) as f64));
        }
    }
    Ok(())
}

fn build(shape: &Shape, device: &Device) -> Result<Model> {
    let cfg = match (&shape.unet_config, shape.family.as_str()) {
        (Some(path), _) => UnetConfig::from_file(std::path::Path::new(path))?,
        (None, "sd15") => UnetConfig::from_json(SD15_UNET, "SD1.5 unet config")?,
        (None, "sdxl") => UnetConfig::from_json(SDXL_UNET, "SDXL unet config")?,
        (None, other) => bail!("--family {other}: use sd15 or sdxl"),
    };
    let ctx_dim = cfg
        .down_blocks
        .first()
        .map_or(768, |b| b.cross_attention_dim);
    let dtype = match shape.precision.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => bail!("--precision {other}: use f32 or bf16"),
    };
    let (unet, vars, params_total) = match shape.mode.as_str() {
        "full" => {
            // f32 masters unless --weight-dtype (see the header).
            let w = Weights::random(0, "unet", shape.weight_dtype, device, true);
            let unet = UNet2DConditionModel::new(&w, &cfg)?;
            let vars: Vec<Var> = w.params().into_iter().map(|(_, v)| v).collect();
            let n = vars.iter().map(|v| v.elem_count()).sum();
            (unet, vars, n)
        }
        mode @ ("lora" | "locon" | "loha" | "lokr" | "dora") => {
            let w = Weights::random(0, "unet", dtype, device, false);
            w.set_fp8_base(shape.fp8_base);
            let mut unet = UNet2DConditionModel::new(&w, &cfg)?;
            let n = w.element_count();
            let spec = AdapterSpec {
                mode: match mode {
                    "locon" => AdapterMode::Locon,
                    "loha" => AdapterMode::Loha,
                    "lokr" => AdapterMode::Lokr,
                    "dora" => AdapterMode::Dora,
                    _ => AdapterMode::Lora,
                },
                rank: shape.rank,
                alpha: shape.rank as f64,
                conv_rank: shape.rank,
                conv_alpha: shape.rank as f64,
                dropout: 0.0,
                factor: -1,
                seed: 0,
            };
            let modules = attach_unet(&mut unet, &spec)?;
            (unet, adapter_vars(&modules), n)
        }
        other => bail!("--mode {other}: use lora, locon, loha, lokr, dora or full"),
    };
    let named = vars
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("p{i}"), v.clone()))
        .collect();
    let optimizer = GroupOptimizer::new(update_rule(&shape.optimizer)?, named, 1e-5)?
        .with_stochastic_rounding(0)?;
    Ok(Model {
        unet,
        vars,
        optimizer: std::rc::Rc::new(std::cell::RefCell::new(optimizer)),
        params_total,
        dtype,
        ctx_dim,
        checkpointing: None,
        fused: false,
    })
}

fn inputs(shape: &Shape, device: &Device, dtype: DType, ctx_dim: usize) -> Result<Inputs> {
    let (b, lat) = (shape.batch, shape.res / 8);
    let randn = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, device);
    let added = if shape.family == "sdxl" {
        let r = shape.res as f32;
        let ids: Vec<f32> = (0..b).flat_map(|_| [r, r, 0.0, 0.0, r, r]).collect();
        Some(AddedConditions {
            text_embeds: randn(&[b, 1280])?.to_dtype(dtype)?,
            time_ids: Tensor::from_vec(ids, (b, 6), device)?,
        })
    } else {
        None
    };
    let t: Vec<f32> = (0..b).map(|i| (97 + 389 * i) as f32 % 1000.0).collect();
    Ok(Inputs {
        x: randn(&[b, 4, lat, lat])?.to_dtype(dtype)?,
        t: Tensor::from_vec(t, b, device)?,
        ctx: randn(&[b, 77, ctx_dim])?.to_dtype(dtype)?,
        added,
        target: randn(&[b, 4, lat, lat])?,
    })
}

/// One training step; returns [total, forward, backward, optimizer] seconds and the census
/// (gradient-store entries, trained Vars with a gradient, loss). With `heap` (`--heap-census`,
/// CPU), the host heap's bytes are written into it: held before the step, held by the graph
/// after the forward, the step's peak, and the largest tracked tensors of the graph by shape.
fn step(
    m: &mut Model,
    i: &Inputs,
    device: &Device,
    mut heap: Option<&mut Value>,
) -> Result<([f64; 4], (usize, usize, f64))> {
    let before = counting_alloc::live_bytes();
    counting_alloc::reset_peak();
    if heap.is_some() && std::env::args().any(|a| a == "--heap-peak-site") {
        counting_alloc::trace_peaks(true);
    }
    let start = Instant::now();
    let out = m.unet.forward(&i.x, &i.t, &i.ctx, i.added.as_ref())?;
    // The trainer's loss: its target is a constant and gets no gradient entry.
    let loss = sdtrain::diffusion::objective::mse_loss(&out, &i.target, None)?;
    drop(out);
    device.synchronize()?;
    let fwd = start.elapsed().as_secs_f64();
    if let Some(r) = heap.as_deref_mut() {
        heap_census(r, &loss, before);
    }
    if m.fused {
        return fused_step(m, loss, device, heap, start, fwd, before);
    }
    // The trainer gives the graph up to the backward (`into_backward`), which frees it as the
    // walk passes; the loss value is kept apart.
    let value = loss.detach();
    let mut grads = loss.into_backward()?;
    let loss = value;
    if let Some(ck) = &m.checkpointing {
        grads.extend(ck.take_grads()?)?;
    }
    device.synchronize()?;
    let bwd = start.elapsed().as_secs_f64() - fwd;
    let present: Vec<&Tensor> = m.vars.iter().filter_map(|v| grads.get(v)).collect();
    let census = (grads.get_ids().count(), present.len());
    let check = StepCheck::fetch(&loss, &present)?;
    let Some(finite) = check.finite() else {
        bail!("non-finite loss or gradient (loss {})", check.loss);
    };
    m.optimizer.borrow_mut().step_checked(&grads, finite)?;
    drop(grads);
    drop(loss);
    let total = finish_step(device, start, heap, before)?;
    Ok((
        [total, fwd, bwd, total - fwd - bwd],
        (census.0, census.1, check.loss),
    ))
}

/// `--fused`: the backward pass updates each parameter as its gradient completes and drops the
/// gradient (the trainer's `fused_backward_pass`): the outer walk's parameters through
/// `Tensor::backward_with`, the checkpointed segments' from their recomputation through the
/// installed sink (each UNet parameter is used by one segment or by the outer graph, once).
fn fused_step(
    m: &mut Model,
    loss: Tensor,
    device: &Device,
    heap: Option<&mut Value>,
    start: Instant,
    fwd: f64,
    before: usize,
) -> Result<([f64; 4], (usize, usize, f64))> {
    use std::cell::Cell;
    use std::rc::Rc;
    struct Sink {
        optimizer: Rc<std::cell::RefCell<GroupOptimizer>>,
        by_id: std::collections::HashMap<candle_core::TensorId, Var>,
        updated: Rc<Cell<usize>>,
    }
    impl sdtrain::nn::grad_sink::GradSink for Sink {
        fn deliver(&mut self, param: &Tensor, g: Tensor) -> candle_core::Result<()> {
            if let Some(v) = self.by_id.get(&param.id()) {
                self.optimizer
                    .borrow_mut()
                    .update_one(v, &g)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                self.updated.set(self.updated.get() + 1);
            }
            Ok(())
        }
    }
    let updated = Rc::new(Cell::new(0));
    let by_id = m
        .vars
        .iter()
        .map(|v| (v.as_tensor().id(), v.clone()))
        .collect();
    sdtrain::nn::grad_sink::install(Box::new(Sink {
        optimizer: m.optimizer.clone(),
        by_id,
        updated: updated.clone(),
    }));
    let value = loss.detach();
    let backward = loss.into_backward_with(&mut |n, g| sdtrain::nn::grad_sink::deliver(n, g));
    drop(sdtrain::nn::grad_sink::take());
    backward?;
    let value = f64::from(value.to_dtype(DType::F32)?.to_scalar::<f32>()?);
    let total = finish_step(device, start, heap, before)?;
    // Backward and the updates are one phase here.
    Ok(([total, fwd, total - fwd, 0.0], (0, updated.get(), value)))
}

/// The step's end: the device synchronised, the step's time, and with `heap` the step's heap
/// peak and what it left held.
fn finish_step(
    device: &Device,
    start: Instant,
    heap: Option<&mut Value>,
    before: usize,
) -> Result<f64> {
    device.synchronize()?;
    let total = start.elapsed().as_secs_f64();
    if let Some(r) = heap {
        counting_alloc::trace_peaks(false);
        if let Some((held, sites)) = counting_alloc::peak_composition() {
            r["heap_peak_composition"] = peak_composition(held.saturating_sub(before), &sites);
        }
        r["heap_step_peak_mib"] = json!(mib(counting_alloc::peak_bytes() - before));
        r["heap_after_step_mib"] = json!(mib(counting_alloc::live_bytes()));
    }
    Ok(total)
}

/// `--heap-peak-site`: the large allocations live at the step's peak, grouped by their innermost
/// sdtrain frames (the site that made them), largest group first.
fn peak_composition(held_over_before: usize, sites: &[(usize, String)]) -> Value {
    let depth: usize = std::env::var("BENCH_SITE_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(3);
    let mut groups: Vec<(String, usize, usize)> = Vec::new();
    for (bytes, backtrace) in sites {
        let frames = sdtrain_frames(backtrace);
        let key = frames[..frames.len().min(depth)].join(" < ");
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => (g.1, g.2) = (g.1 + bytes, g.2 + 1),
            None => groups.push((key, *bytes, 1)),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.1));
    json!({
        "held_over_before_mib": mib(held_over_before),
        "traced_mib": mib(sites.iter().map(|s| s.0).sum()),
        "groups": groups
            .iter()
            .take(24)
            .map(|(k, b, n)| json!({"mib": mib(*b), "allocations": n, "site": k}))
            .collect::<Vec<_>>(),
    })
}

/// The frames of a formatted backtrace that lie in sdtrain's own sources (its library and this
/// example, not the allocator's), innermost first, each as `name (file:line)`.
fn sdtrain_frames(backtrace: &str) -> Vec<String> {
    let lines: Vec<&str> = backtrace.lines().map(str::trim).collect();
    let mut frames = Vec::new();
    for pair in lines.windows(2) {
        let (Some((_, name)), Some(at)) = (pair[0].split_once(": "), pair[1].strip_prefix("at "))
        else {
            continue;
        };
        let ours = (at.contains("/src/") || at.contains("/examples/"))
            && !(at.contains("/rustc/") || at.contains("/vendor/") || at.contains("/.cargo/"))
            && !at.contains("counting_alloc")
            && name != "__rust_alloc";
        if ours {
            let file = at.rsplit_once("src/").map_or(at, |(_, f)| f);
            frames.push(format!("{name} ({file})"));
        }
    }
    frames
}

fn mib(bytes: usize) -> f64 {
    round2(bytes as f64 / (1u64 << 20) as f64)
}

/// The heap held by the forward graph of `loss` (bytes now over `before`), and the tracked
/// tensors it keeps, summed by shape over distinct storages, largest first.
fn heap_census(report: &mut Value, loss: &Tensor, before: usize) {
    use std::collections::{HashMap, HashSet};
    report["heap_before_step_mib"] = json!(mib(before));
    report["heap_graph_mib"] = json!(mib(counting_alloc::live_bytes() - before));
    let mut seen = HashSet::new();
    let mut by_shape: HashMap<String, (usize, usize)> = HashMap::new();
    for t in loss.sorted_nodes() {
        if t.is_variable() {
            continue;
        }
        let (storage, _) = t.storage_and_layout();
        if !seen.insert(&*storage as *const _ as usize) {
            continue;
        }
        let e = by_shape.entry(format!("{:?}", t.dims())).or_default();
        e.0 += 1;
        e.1 += t.elem_count() * t.dtype().size_in_bytes();
    }
    let mut rows: Vec<_> = by_shape.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
    let tracked: usize = rows.iter().map(|r| r.1 .1).sum();
    report["heap_tracked_mib"] = json!(mib(tracked));
    report["heap_tracked_by_shape"] = json!(rows
        .iter()
        .take(16)
        .map(|(s, (n, b))| json!({"shape": s, "tensors": n, "mib": mib(*b)}))
        .collect::<Vec<_>>());
}

/// `--profile-last-step`: the CUDA profiler's collection on (`true`) or off around the last step,
/// for `ncu --profile-from-start off` (scripts/gpu-kernel-profile).
#[cfg(feature = "cuda")]
fn profiler(on: bool) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // SAFETY: no arguments; the driver is initialised (the device exists).
    let r = unsafe {
        if on {
            sys::cuProfilerStart()
        } else {
            sys::cuProfilerStop()
        }
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("cuProfiler{}: {r:?}", if on { "Start" } else { "Stop" });
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn profiler(_: bool) -> Result<()> {
    bail!("--profile-last-step needs the cuda feature")
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// `--checkpoint-blocks`: the named blocks (`down_blocks.N`, `mid_block`, `up_blocks.N`).
fn checkpointed_blocks(
    cfg: &sdtrain::model::unet::UnetConfig,
    names: &[String],
) -> Result<sdtrain::model::unet::CheckpointedBlocks> {
    use sdtrain::model::unet::{BlockRef, CheckpointedBlocks};
    let mut blocks = CheckpointedBlocks::none(cfg);
    for name in names {
        let index = |prefix: &str| name.strip_prefix(prefix).and_then(|i| i.parse().ok());
        match (index("down_blocks."), index("up_blocks.")) {
            _ if name == "mid_block" => blocks.mid = true,
            (Some(i), _) if i < blocks.down.len() => blocks.add(BlockRef::Down(i)),
            (_, Some(i)) if i < blocks.up.len() => blocks.add(BlockRef::Up(i)),
            _ => bail!("--checkpoint-blocks: no block `{name}` in this UNet"),
        }
    }
    Ok(blocks)
}

/// `--optimizer`: the rule with its default hyper-parameters (AdamW's weight decay for all).
fn update_rule(name: &str) -> Result<Box<dyn UpdateRule>> {
    let adam = AdamWParams::default();
    let lion = LionParams {
        weight_decay: 0.01,
        ..LionParams::default()
    };
    Ok(match name {
        "adamw" => Box::new(AdamW::rule(adam)?),
        "adamw8bit" => Box::new(AdamW8bit::rule(adam)?),
        "lion" => Box::new(Lion::rule(lion, false)?),
        "lion8bit" => Box::new(Lion::rule(lion, true)?),
        "adafactor" => Box::new(Adafactor::rule(AdafactorParams::default())?),
        "adamw_schedulefree" => Box::new(AdamWScheduleFree::rule(ScheduleFreeParams::default())?),
        "came" => Box::new(Came::rule(CameParams::default(), false)?),
        "came8bit" => Box::new(Came::rule(CameParams::default(), true)?),
        "prodigy" => Box::new(Prodigy::rule(ProdigyParams::default())?),
        other => bail!(
            "--optimizer {other}: use adamw, adamw8bit, lion, lion8bit, adafactor, \
             adamw_schedulefree, came, came8bit or prodigy"
        ),
    })
}
