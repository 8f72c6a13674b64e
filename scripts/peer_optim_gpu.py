#!/usr/bin/env python3
"""Peer for the optimizer step on a GPU: torch's AdamW over SD1.5's UNet parameters.

What it measures
    The SD1.5 UNet (diffusers' UNet2DConditionModel from the real config, random weights, f32,
    859,520,964 parameters) on the GPU, every parameter given a random f32 gradient once. Then for
    each optimizer: 2 warm-up steps (the first creates the state), 10 steps each timed with CUDA
    events; the median is reported with the bytes of optimizer state per parameter.
      adamw-fused     torch.optim.AdamW(fused=True)   (the peer sdtrain's adamw is compared with)
      adamw-foreach   torch.optim.AdamW(foreach=True) (torch's default on CUDA)
      adamw8bit-bnb   bitsandbytes.optim.AdamW8bit, when bitsandbytes imports
    lr 1e-5, weight decay 1e-2, torch's other defaults. sdtrain's side is examples/bench_step
    --mode full --optimizer NAME (its opt_ms), run by scripts/gpu-check in the same call.

Usage
    python3 scripts/peer_optim_gpu.py
Output
    One JSON line per optimizer on stdout: impl, optimizer, status, opt_ms_median, opt_ms_min,
    state_bytes_per_param, params, torch, device. Exit status 0, also without a GPU ("skipped").
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def emit(rec):
    print(json.dumps(rec), flush=True)


def main():
    try:
        import torch
        from diffusers import UNet2DConditionModel
        from peer_bench_gpu import SD15_CONFIG
    except Exception as e:  # noqa: BLE001 - reported in the line
        emit({"impl": "torch", "optimizer": "adamw-fused", "status": f"error: {e}"})
        return 0
    if not torch.cuda.is_available():
        emit({"impl": "torch", "optimizer": "adamw-fused", "status": "skipped: no CUDA device"})
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD15_CONFIG).to(dev, torch.float32)
    params = list(unet.parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    makers = [
        ("adamw-fused", lambda: torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-2, fused=True)),
        ("adamw-foreach", lambda: torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-2, foreach=True)),
    ]
    try:
        import bitsandbytes as bnb

        makers.append(("adamw8bit-bnb", lambda: bnb.optim.AdamW8bit(params, lr=1e-5, weight_decay=1e-2)))
    except Exception:  # noqa: BLE001 - bitsandbytes is optional on the GPU machine
        pass
    base = {"impl": "torch", "params": n, "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    for name, make in makers:
        rec = dict(base, optimizer=name)
        try:
            opt = make()
            for _ in range(2):
                opt.step()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                opt.step()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                        if torch.is_tensor(t) and t.device.type == "cuda")
            rec.update(status="ok", opt_ms_median=round(statistics.median(times), 3),
                       opt_ms_min=round(min(times), 3), state_bytes_per_param=round(state / n, 4))
            del opt
        except Exception as e:  # noqa: BLE001 - reported in the line
            rec.update(status=f"error: {type(e).__name__}: {e}"[:200])
        torch.cuda.empty_cache()
        emit(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
