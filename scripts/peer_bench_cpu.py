#!/usr/bin/env python3
"""Peer benchmark on the CPU: one diffusers (+ PEFT) SD1.5 UNet training step, to run beside
`examples/bench_step --device cpu` (scripts/cpu-bench runs both, one process per case).

    python3 scripts/peer_bench_cpu.py MODE LATENT PRECISION GC [STEPS] [WARMUP]
      MODE full|lora, LATENT 32|64 (latent side; 64 is 512 px), PRECISION f32|bf16, GC on|off

The step: diffusers UNet2DConditionModel from the real SD1.5 config, random weights
(torch.manual_seed(0)), batch 1, latents/context/target random, timestep 500, an f32 MSE loss,
backward, and torch AdamW (lr 1e-5, foreach). LoRA: PEFT rank 4, alpha 4 on kohya's UNet targets
(to_q, to_k, to_v, to_out.0, proj_in, proj_out, ff.net.0.proj, ff.net.2), base frozen. bf16: the
forward runs under torch.autocast("cpu", bfloat16) with f32 trainable parameters; a LoRA's frozen
base is stored in bf16. GC on: unet.enable_gradient_checkpointing(). 2 threads, as this machine.
Prints one JSON line: step_s_median over the timed steps and peak_rss_gib (ru_maxrss, the whole
process: weights, optimizer state and the peak step).
Made against torch 2.15.0, diffusers 0.42.1, peft 0.21.2 (scripts/requirements-bench.txt).
"""
import json, resource, sys, time

import torch
from diffusers import UNet2DConditionModel

mode, lat, prec, gc = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "on"
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 2
warmup = int(sys.argv[6]) if len(sys.argv) > 6 else 1
torch.set_num_threads(2)
torch.manual_seed(0)
cfg = dict(sample_size=64, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280, 1280),
           layers_per_block=2, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
           up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768,
           attention_head_dim=8, norm_num_groups=32)
u = UNet2DConditionModel(**cfg)
if gc:
    u.enable_gradient_checkpointing()
if mode == "lora":
    from peft import LoraConfig
    u.requires_grad_(False)
    if prec == "bf16":
        u.to(torch.bfloat16)
    u.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                             target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in",
                                             "proj_out", "ff.net.0.proj", "ff.net.2"]))
    for p in u.parameters():
        if p.requires_grad:
            p.data = p.data.float()
u.train()
params = [p for p in u.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
x = torch.randn(1, 4, lat, lat)
t = torch.tensor([500])
c = torch.randn(1, 77, 768)
target = torch.randn(1, 4, lat, lat)
times = []
for i in range(warmup + steps):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16"):
        out = u(x, t, c).sample
    loss = torch.nn.functional.mse_loss(out.float(), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i >= warmup:
        times.append(time.perf_counter() - t0)
times.sort()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024
print(json.dumps({
    "impl": "diffusers", "mode": mode, "latent": lat, "precision": prec, "gc": gc,
    "step_s_median": round(times[len(times) // 2] if len(times) % 2 else sum(times[len(times) // 2 - 1:len(times) // 2 + 1]) / 2, 3),
    "peak_rss_gib": round(rss, 3), "params_trained": sum(p.numel() for p in params),
    "loss": round(loss.item(), 5), "torch": torch.__version__,
}), flush=True)
