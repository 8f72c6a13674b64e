#!/usr/bin/env python3
"""What autograd keeps for backward in diffusers + PEFT: the peer side of
`bench_step --heap-census` (the activation-memory comparison in docs/BENCHMARKS.md).

    python scripts/peer_activation_census.py sd15:lora:256:1:f32 [more shapes]

Same model and LoRA as scripts/peer_bench_gpu.py (the real SD1.5/SDXL UNet configs, random
weights, rank 16 on kohya's targets), on the CPU. One forward under
`torch.autograd.graph.saved_tensors_hooks` records every tensor saved for backward; the bytes of
their distinct storages, parameters left out, are what the graph keeps (the forward's output is
added). On a GPU, torch's caching allocator holds exactly these between forward and backward.
Prints one JSON line per shape, with the largest saved shapes.
"""
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench_gpu import FAMILIES, LORA_ALPHA, LORA_RANK, LORA_TARGETS, parse_shape  # noqa: E402


def census(spec):
    import torch
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    shape = parse_shape(spec)
    cfg, ctx_dim, _ = FAMILIES[shape["family"]]
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**cfg)
    unet.train()
    dtype = torch.bfloat16 if shape["prec"] == "bf16" else torch.float32
    if shape["gc"]:
        unet.enable_gradient_checkpointing()
    if shape["mode"] == "lora":
        unet.requires_grad_(False)
        unet.to(dtype)
        unet.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights="gaussian",
                                    target_modules=LORA_TARGETS))
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    params = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    bs, lat = shape["batch"], shape["res"] // 8
    x = torch.randn(bs, 4, lat, lat)
    ctx = torch.randn(bs, 77, ctx_dim)
    t = torch.randint(0, 1000, (bs,))
    kw = {}
    if cfg.get("addition_embed_type") == "text_time":
        r = shape["res"]
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(bs, 1280),
                                   "time_ids": torch.tensor([[r, r, 0, 0, r, r]] * bs, dtype=torch.float32)}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.device.type == "cpu":
            saved[s.data_ptr()] = (s.nbytes(), tuple(t.shape))
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape["prec"] == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = unet(x, t, ctx, **kw).sample
    s = out.untyped_storage()
    saved.setdefault(s.data_ptr(), (s.nbytes(), tuple(out.shape)))
    by_shape = defaultdict(lambda: [0, 0])
    for nbytes, shp in saved.values():
        by_shape[str(list(shp))][0] += 1
        by_shape[str(list(shp))][1] += nbytes
    rows = sorted(by_shape.items(), key=lambda kv: -kv[1][1])[:16]
    mib = lambda b: round(b / 2**20, 2)  # noqa: E731
    return {"impl": "diffusers+peft", "spec": spec, "saved_mib": mib(sum(v[0] for v in saved.values())),
            "saved_by_shape": [{"shape": k, "tensors": n, "mib": mib(b)} for k, (n, b) in rows]}


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["sd15:lora:256:1:f32"]:
        print(json.dumps(census(spec)), flush=True)
