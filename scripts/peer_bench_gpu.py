#!/usr/bin/env python3
"""Peer benchmark on a GPU: one diffusers (+ PEFT) UNet training step, to compare sdtrain against.

What it measures
    For each shape given on the command line, in one process: a diffusers UNet2DConditionModel
    built from the real SD1.5 or SDXL-base UNet config with random weights (torch.manual_seed(0)
    before each shape), trained on random inputs (latents [B,4,res/8,res/8], context [B,77,768|2048],
    random integer timesteps in [0,1000), and for SDXL text_embeds [B,1280] and time_ids
    [res,res,0,0,res,res]) with an f32 MSE loss against a fixed random target, and fused torch AdamW
    (lr 1e-5). No gradient checkpointing unless the shape ends in ":gc".
      mode full: every UNet parameter is trained (fp32 parameters, fp32 AdamW state).
      mode lora: PEFT LoRA rank 16, alpha 16 (init "gaussian") on to_q, to_k, to_v, to_out.0,
                 proj_in, proj_out, ff.net.0.proj, ff.net.2 (kohya's UNet targets); the base is frozen.
      precision bf16 ("bf16-autocast"): forward under torch.autocast("cuda", bfloat16) with fp32
                 trainable parameters; for LoRA the frozen base is cast to bf16 and the LoRA
                 parameters are fp32. TF32 is left at torch's defaults (it hardly matters there).
      precision f32: no autocast, everything fp32 (a LoRA's frozen base too), and TF32 OFF for both
                 matmul and cuDNN (torch.backends.cuda.matmul.allow_tf32 = False and
                 torch.backends.cudnn.allow_tf32 = False, or fp32_precision = "ieee" on torch
                 versions that have the new API), because we compare against strict f32.
    Timing: 3 warm-up steps, then 10 steps each timed with CUDA events (synchronised); the median is
    reported. Peak memory (torch.cuda.max_memory_allocated / max_memory_reserved) is over the whole
    shape: the stats are reset before the model is built, so the peak includes the weights, the
    first step's optimizer-state creation and the warm-up. Between shapes the model and optimizer
    are dropped, gc.collect() and torch.cuda.empty_cache() run, and the peak stats are reset.
    Attention is diffusers' default processor (torch scaled_dot_product_attention);
    cudnn.benchmark is left off (torch's default).

Usage
    python3 scripts/peer_bench_gpu.py [SHAPE ...]
    SHAPE = family:mode:res:batch:precision[:gc]
      family sd15|sdxl, mode lora|full, res in pixels, batch, precision bf16|f32, optional gc.
      e.g. sd15:lora:512:1:bf16  sd15:lora:512:4:f32  sd15:full:512:1:bf16  sdxl:lora:1024:1:bf16:gc
    With no SHAPE: sd15 lora 512 b1 and b4, sd15 full 512 b1, sdxl lora 1024 b1, each in bf16 and f32.

Output
    One JSON line per shape on stdout (flushed as soon as that shape ends) with keys: impl, family,
    mode, res, batch, precision, gc, status ("ok" | "oom" | "error: <msg>" | "skipped: no CUDA
    device"), step_ms_median, step_ms_min, step_ms_max, img_per_s, peak_alloc_gib,
    peak_reserved_gib, params_trained, params_total, params_check, loss_last, tf32, torch,
    diffusers, peft, device, spec. Progress and tracebacks go to stderr.
    params_check compares params_total with the real UNets (SD1.5 859,520,964; SDXL 2,567,463,684)
    and, for LoRA, params_trained with sum(rank * (in + out)) over the targeted modules.
    An OOM or any other error in a shape is reported in that shape's line and the next shape runs.
    The exit status is 0 (also when there is no CUDA device: every shape is then "skipped").

It is run by scripts/gpu-check on the GPU machine, where diffusers comes from the wheels in .whl/
(installed with pip --no-index --no-deps --target into a temp dir put on PYTHONPATH); torch, peft,
transformers and the rest are already installed there. Made against diffusers 0.42.1.
"""
import gc
import json
import math
import statistics
import sys
import time
import traceback
from contextlib import nullcontext

WARMUP_STEPS = 3
TIMED_STEPS = 10
LR = 1e-5
LORA_RANK = 16
LORA_ALPHA = 16
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]

# diffusers' runwayml/stable-diffusion-v1-5 unet/config.json (non-default keys; the rest are
# UNet2DConditionModel's defaults, which are SD1.5's).
SD15_CONFIG = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
)
# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json. Note: diffusers' "attention_head_dim"
# is really the number of heads (5/10/20 heads of 64 channels).
SDXL_CONFIG = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    cross_attention_dim=2048,
)
FAMILIES = {
    # family: (config, context dim, expected total UNet parameters)
    "sd15": (SD15_CONFIG, 768, 859_520_964),
    "sdxl": (SDXL_CONFIG, 2048, 2_567_463_684),
}
PRECISIONS = {"bf16": "bf16-autocast", "f32": "f32"}
DEFAULT_SHAPES = [
    f"{base}:{prec}"
    for base in ("sd15:lora:512:1", "sd15:lora:512:4", "sd15:full:512:1", "sdxl:lora:1024:1")
    for prec in ("bf16", "f32")
]


def parse_shape(spec):
    parts = spec.strip().split(":")
    gc_on = False
    if len(parts) == 6 and parts[5] == "gc":
        gc_on = True
        parts = parts[:5]
    if len(parts) != 5:
        raise ValueError(f"want family:mode:res:batch:precision[:gc], got {spec!r}")
    fam, mode, res, batch, prec = parts
    prec = {"fp32": "f32", "float32": "f32", "bfloat16": "bf16"}.get(prec, prec)
    if fam not in FAMILIES:
        raise ValueError(f"family {fam!r} is not one of {sorted(FAMILIES)}")
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r} is not lora or full")
    if prec not in PRECISIONS:
        raise ValueError(f"precision {prec!r} is not bf16 or f32")
    res, batch = int(res), int(batch)
    if res <= 0 or res % 8 or batch <= 0:
        raise ValueError(f"res must be a positive multiple of 8 and batch positive: {spec!r}")
    return dict(family=fam, mode=mode, res=res, batch=batch, prec=prec, gc=gc_on)


def base_record(spec, shape, versions):
    rec = dict(impl="diffusers", spec=spec)
    if shape is not None:
        rec.update(family=shape["family"], mode=shape["mode"], res=shape["res"], batch=shape["batch"],
                   precision=PRECISIONS[shape["prec"]], gc=shape["gc"])
    rec.update(status=None, step_ms_median=None, step_ms_min=None, step_ms_max=None, img_per_s=None,
               peak_alloc_gib=None, peak_reserved_gib=None, params_trained=None, params_total=None,
               params_check=None, loss_last=None, tf32=None)
    rec.update(versions)
    return rec


def emit(rec):
    print(json.dumps(rec), flush=True)


def log(msg):
    print(f"[peer_bench_gpu] {msg}", file=sys.stderr, flush=True)


class Tf32:
    """Switches TF32 off for strict-f32 shapes and back to torch's start-up state for the others."""

    def __init__(self, torch):
        self.torch = torch
        b = torch.backends
        self.new_api = hasattr(b.cuda.matmul, "fp32_precision") and hasattr(getattr(b.cudnn, "conv", None), "fp32_precision")
        if self.new_api:
            self.saved = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision)
        else:
            self.saved = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)

    def set(self, strict):
        b = self.torch.backends
        if self.new_api:
            mm, conv = ("ieee", "ieee") if strict else self.saved
            b.cuda.matmul.fp32_precision = mm
            b.cudnn.conv.fp32_precision = conv
            return f"matmul={mm},conv={conv}"
        mm, conv = (False, False) if strict else self.saved
        b.cuda.matmul.allow_tf32 = mm
        b.cudnn.allow_tf32 = conv
        return f"matmul_allow_tf32={mm},cudnn_allow_tf32={conv}"


def lora_expected_params(unet, torch):
    """sum(rank * (in + out)) over the modules the LoRA targets (Linear, or Conv2d proj_in/out)."""
    total, n = 0, 0
    for name, mod in unet.named_modules():
        if not any(name == t or name.endswith("." + t) for t in LORA_TARGETS):
            continue
        if isinstance(mod, torch.nn.Linear):
            total += LORA_RANK * (mod.in_features + mod.out_features)
        elif isinstance(mod, torch.nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1]
            total += LORA_RANK * (mod.in_channels * k + mod.out_channels)
        else:
            continue
        n += 1
    return total, n


def run_shape(shape, rec, torch, UNet2DConditionModel, tf32):
    dev = "cuda"
    cfg, ctx_dim, expected_total = FAMILIES[shape["family"]]
    bs, res = shape["batch"], shape["res"]
    bf16 = shape["prec"] == "bf16"
    rec["tf32"] = tf32.set(strict=not bf16)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    with torch.device(dev):
        unet = UNet2DConditionModel(**cfg)
    unet.train()
    params_total = sum(p.numel() for p in unet.parameters())
    rec["params_total"] = params_total
    checks = []
    if params_total != expected_total:
        checks.append(f"params_total {params_total} != expected {expected_total}")
    if shape["gc"]:
        unet.enable_gradient_checkpointing()
    if shape["mode"] == "lora":
        from peft import LoraConfig

        lora_expected, n_targets = lora_expected_params(unet, torch)
        unet.requires_grad_(False)
        if bf16:
            unet.to(torch.bfloat16)
        unet.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights="gaussian",
                                    target_modules=LORA_TARGETS))
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    params = [p for p in unet.parameters() if p.requires_grad]
    params_trained = sum(p.numel() for p in params)
    rec["params_trained"] = params_trained
    if shape["mode"] == "lora":
        if params_trained != lora_expected:
            checks.append(f"params_trained {params_trained} != expected {lora_expected} ({n_targets} target modules)")
        if any(p.dtype != torch.float32 for p in params):
            checks.append("some trainable params are not fp32")
    elif params_trained != params_total:
        checks.append(f"params_trained {params_trained} != params_total {params_total}")
    rec["params_check"] = "ok" if not checks else "mismatch: " + "; ".join(checks)
    opt = torch.optim.AdamW(params, lr=LR, fused=True)

    lat = res // 8
    x = torch.randn(bs, 4, lat, lat, device=dev)
    ctx = torch.randn(bs, 77, ctx_dim, device=dev)
    t = torch.randint(0, 1000, (bs,), device=dev)
    kw = {}
    if cfg.get("addition_embed_type") == "text_time":
        kw["added_cond_kwargs"] = {
            "text_embeds": torch.randn(bs, 1280, device=dev),
            "time_ids": torch.tensor([[res, res, 0, 0, res, res]] * bs, device=dev, dtype=torch.float32),
        }
    target = torch.randn(bs, 4, lat, lat, device=dev)
    torch.cuda.synchronize()
    log(f"{rec['spec']}: built in {time.perf_counter() - t0:.1f}s, params_total={params_total:,} "
        f"params_trained={params_trained:,} check={rec['params_check']} tf32={rec['tf32']}")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext():
            out = unet(x, t, ctx, **kw).sample
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARMUP_STEPS):
        loss = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_STEPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    med = statistics.median(times)
    loss_last = float(loss.item())
    rec.update(status="ok", step_ms_median=round(med, 3), step_ms_min=round(min(times), 3),
               step_ms_max=round(max(times), 3), img_per_s=round(bs * 1000.0 / med, 3),
               loss_last=loss_last if math.isfinite(loss_last) else str(loss_last))


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    specs = argv or DEFAULT_SHAPES
    versions = dict(torch=None, diffusers=None, peft=None, device=None)
    import_error = None
    try:
        import torch

        versions["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        torch = None
        import_error = f"import torch: {type(e).__name__}: {e}"
    UNet2DConditionModel = None
    if torch is not None:
        try:
            import diffusers
            from diffusers import UNet2DConditionModel

            versions["diffusers"] = diffusers.__version__
        except Exception as e:  # noqa: BLE001
            import_error = f"import diffusers: {type(e).__name__}: {e}"
        try:
            import peft

            versions["peft"] = peft.__version__
        except Exception as e:  # noqa: BLE001
            log(f"peft is not importable ({type(e).__name__}: {e}); lora shapes will fail")

    have_cuda = torch is not None and torch.cuda.is_available()
    if have_cuda:
        versions["device"] = torch.cuda.get_device_name()
    tf32 = Tf32(torch) if have_cuda else None

    for spec in specs:
        try:
            shape = parse_shape(spec)
        except ValueError as e:
            rec = base_record(spec, None, versions)
            rec["status"] = f"error: bad shape: {e}"
            emit(rec)
            continue
        rec = base_record(spec, shape, versions)
        if torch is None:
            rec["status"] = f"error: {import_error}"
            emit(rec)
            continue
        if not have_cuda:
            rec["status"] = "skipped: no CUDA device"
            emit(rec)
            continue
        if UNet2DConditionModel is None:
            rec["status"] = f"error: {import_error}"
            emit(rec)
            continue

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            run_shape(shape, rec, torch, UNet2DConditionModel, tf32)
        except torch.cuda.OutOfMemoryError as e:
            rec["status"] = "oom"
            log(f"{spec}: OOM: {str(e).splitlines()[0] if str(e) else ''}")
        except Exception as e:  # noqa: BLE001
            msg = " ".join(f"{type(e).__name__}: {e}".split())
            rec["status"] = "error: " + (msg[:300] + "..." if len(msg) > 300 else msg)
            traceback.print_exc(file=sys.stderr)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        rec["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        rec["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        emit(rec)
        log(f"{spec}: {rec['status']} step_ms_median={rec['step_ms_median']} peak_alloc_gib={rec['peak_alloc_gib']} "
            f"({time.perf_counter() - t0:.1f}s)")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
