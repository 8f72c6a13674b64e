#!/usr/bin/env python3
"""Peer for scripts/bench-sample: diffusers' StableDiffusionPipeline drawing images from a model
folder with the settings `sdtrain sample` gets.

    python3 scripts/peer_sample.py MODEL SIZE STEPS CFG SAMPLER PRECISION COUNT

SAMPLER ddim|euler_a (DDIMScheduler / EulerAncestralDiscreteScheduler from the model's scheduler
config), PRECISION fp32|bf16|fp16 (the pipeline's torch_dtype; fp16 upcasts the VAE as the
pipeline's `force_upcast` does), on CUDA when available, else the CPU with 2 threads. Each image
is one `pipe(...)` call (prompt encoding, the steps, the VAE decode), timed alone with a CUDA
sync. Prints one JSON line with every image's seconds; the first includes warm-up.
Made against torch 2.15.0, diffusers 0.42.1 (scripts/requirements-bench.txt).
"""
import json
import sys
import time

import torch
from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, StableDiffusionPipeline

model, size, steps, cfg, sampler, prec, count = sys.argv[1:8]
size, steps, cfg, count = int(size), int(steps), float(cfg), int(count)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":
    torch.set_num_threads(2)
pipe = StableDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, safety_checker=None,
                                               requires_safety_checker=False).to(device)
cls = DDIMScheduler if sampler == "ddim" else EulerAncestralDiscreteScheduler
pipe.scheduler = cls.from_config(pipe.scheduler.config)
pipe.set_progress_bar_config(disable=True)
times = []
for i in range(count):
    g = torch.Generator(device).manual_seed(555 + i)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    pipe(prompt="a photo of a cat", guidance_scale=cfg, num_inference_steps=steps, height=size,
         width=size, generator=g, output_type="np")
    if device == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
print(json.dumps({"device": device, "image_s": times, "peak_alloc_gib": peak}))
