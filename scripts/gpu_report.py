#!/usr/bin/env python3
"""Markdown report of one scripts/gpu-check run: python3 scripts/gpu_report.py OUT_DIR.

Reads OUT_DIR/{device.txt, cuda-tests.log, bench.jsonl, peer.jsonl, optim.jsonl, vram.jsonl,
profile.md} and prints the
table docs/BENCHMARKS.md keeps: each shape's median step time and peak device memory for sdtrain
beside diffusers + PEFT, the CUDA test results with every parity error, and the kernel profile.
Peak memory: sdtrain's is the CUDA pool's high-water mark (tensors), the peer's is
torch.cuda.max_memory_allocated; both include the weights and the optimizer state.
"""
import json
import os
import re
import sys


def read_jsonl(path):
    rows = []
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows


def key(r):
    prec = "bf16" if str(r.get("precision", "")).startswith("bf16") else "f32"
    gc = bool(r.get("gc", r.get("checkpointing", False)))
    return (r.get("family"), r.get("mode"), int(r.get("res", 0)), int(r.get("batch", 0)), prec, gc)


def label(k):
    """A shape key as a table's row label: `sd15 lora 512px b1 bf16 checkpointing`."""
    return f"{k[0]} {k[1]} {k[2]}px b{k[3]} {k[4]}" + (" checkpointing" if k[5] else "")


def cell(r, field, fmt):
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "?")[:60]
    v = r.get(field)
    return fmt.format(v) if isinstance(v, (int, float)) else "—"


def print_vram(rows):
    """The vram_limit_gb rehearsal: plan vs measured peak, and the OOM retries."""
    print("\n### vram_limit_gb rehearsal: random SD1.5 LoRA cases, then the presets at their "
          "budgets (full-size random models), 4 steps each\n")
    print("| case | status | plan peak | plan pool | measured pool peak | plan pool vs measured | OOM retries | micro-batch at the end |")
    print("|---|---|---|---|---|---|---|---|")
    decodes = [r for r in rows if str(r.get("case", "")).startswith("vae-decode")]
    rows = [r for r in rows if r not in decodes]
    for r in rows:
        p, m = r.get("plan_gib"), r.get("measured_gib")
        pool = r.get("plan_pool_gib")
        ratio = f"{(pool / m - 1) * 100:+.1f}%" if pool and m else "—"
        fmt = lambda v: f"{v:.2f} GiB" if isinstance(v, (int, float)) else "—"
        case = r.get("case")
        if r.get("budget_gib"):
            case = f"{case} (budget {r['budget_gib']:g} GiB)"
        print(f"| {case} | {r.get('status')} | {fmt(p)} | {fmt(pool)} | {fmt(m)} | {ratio} "
              f"| {r.get('oom_retries', '—')} | {r.get('micro_batch', '—')} |")
    for r in rows:
        for line in r.get("retry_lines", []):
            print(f"\n`{line}`")
    if decodes:
        print("\n### The VAE decode alone (bench_vae_decode, bf16): the plan takes 1,024 elements "
              "per output pixel\n")
        print("| image | status | decode peak above the weights | elements per pixel | vs the plan | median |")
        print("|---|---|---|---|---|---|")
        for r in decodes:
            d = r.get("result") or {}
            nu = d.get("nu")
            vs = f"{(1024 / nu - 1) * 100:+.1f}%" if nu else "—"
            mib = d.get("decode_peak_mib")
            print(f"| {d.get('res', r.get('case'))} px | {r.get('status') or 'failed'} "
                  f"| {f'{mib:.0f} MiB' if mib else '—'} | {f'{nu:.0f}' if nu else '—'} | {vs} "
                  f"| {d.get('median_s', '—')} s |")


def print_optimizers(rows):
    """One optimizer step over SD1.5's parameters: sdtrain's optimizers and torch's."""
    print("\n### One optimizer step over SD1.5's 860M parameters (f32 parameters)\n")
    peer = next((r for r in rows if r.get("optimizer") == "adamw-fused" and r.get("status") == "ok"), None)
    print("| implementation | optimizer | step | vs torch fused AdamW | state bytes/param |")
    print("|---|---|---|---|---|")
    for r in rows:
        ok = r.get("status") == "ok"
        ms = r.get("opt_ms_median", r.get("opt_ms"))
        ratio = f"{ms / peer['opt_ms_median']:.2f}×" if ok and peer and ms else "—"
        if r.get("impl") == "sdtrain":
            per = r.get("optimizer_state_bytes", 0) / max(r.get("params_trained", 1), 1)
        else:
            per = r.get("state_bytes_per_param", 0)
        step = f"{ms:.1f} ms" if ok and ms is not None else r.get("status", "?")[:60]
        print(f"| {r.get('impl')} | {r.get('optimizer')} | {step} | {ratio} | {per:.2f} |")


# Issue 19's targets on the H100 (bf16, batch 1, LoRA rank 16): SimpleTuner's published sweep
# (documentation/experimental/SEGMENTED_CHECKPOINTING.md) as (step s, peak GiB), None where it
# sets no memory target; every shape must also be at most 1.0x diffusers' step and 0.8x its peak.
TARGETS = {
    ("sd15", "lora", 512, 1, "bf16", False): (0.18, 2.9),
    ("sd15", "lora", 512, 1, "bf16", True): (0.30, 2.0),
    ("sdxl", "lora", 1024, 1, "bf16", False): (0.60, None),
    ("sdxl", "lora", 1024, 1, "bf16", True): (1.10, 6.5),
}


def print_targets(default, peer):
    """One row per target shape: the measured figures, the targets, and whether each is met."""
    print("\n### Issue 19 targets (SimpleTuner's H100 figures; ≤ 1.0× diffusers' step, ≤ 0.8× its peak)\n")
    print("| shape | step | target | peak | target | vs diffusers step / peak | met |")
    print("|---|---|---|---|---|---|---|")
    by_key = {key(r): r for r in default}
    for k, (t_s, t_gib) in TARGETS.items():
        r, p = by_key.get(k), peer.get(k)
        shape = f"{k[0]} {k[1]} {k[2]}px" + (" checkpointing" if k[5] else "")
        if r is None or r.get("status") != "ok":
            print(f"| {shape} | {cell(r, 'step_ms_median', '{:.0f} ms')} | {t_s:.2f} s | — | — | — | no |")
            continue
        step, peak = r["step_ms_median"] / 1e3, r["peak_gib"]
        ok = step <= t_s and (t_gib is None or peak <= t_gib)
        vs = "—"
        if p and p.get("status") == "ok":
            rt, rm = r["step_ms_median"] / p["step_ms_median"], peak / max(p["peak_alloc_gib"], 1e-9)
            vs = f"{rt:.2f}× / {rm:.2f}×"
            ok = ok and rt <= 1.0 and rm <= 0.8
        t_mem = f"{t_gib:.1f} GiB" if t_gib else "—"
        print(f"| {shape} | {step:.3f} s | {t_s:.2f} s | {peak:.2f} GiB | {t_mem} | {vs} | {'yes' if ok else 'no'} |")


def main(out):
    device = open(os.path.join(out, "device.txt")).read().strip() if os.path.exists(os.path.join(out, "device.txt")) else "?"
    rows = read_jsonl(os.path.join(out, "bench.jsonl"))
    ours = [r for r in rows if "op_ms" not in r]
    profiles = [r for r in rows if "op_ms" in r]
    peer = {key(r): r for r in read_jsonl(os.path.join(out, "peer.jsonl"))}
    print(f"## gpu-check on {device}\n")
    default = [r for r in ours if r.get("pool_cache", True) and not r.get("event_tracking", False)
               and r.get("fused_ops", True) and not r.get("variant") and not r.get("fp8_base")
               and not r.get("fused")]
    print("| shape | precision | sdtrain step | diffusers step | time ratio | sdtrain peak | diffusers peak | memory ratio | sdtrain fwd/bwd/opt ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in default:
        k = key(r)
        p = peer.get(k)
        ratio_t = ratio_m = "—"
        if r.get("status") == "ok" and p and p.get("status") == "ok":
            ratio_t = f"{r['step_ms_median'] / p['step_ms_median']:.2f}×"
            ratio_m = f"{r['peak_gib'] / max(p['peak_alloc_gib'], 1e-9):.2f}×"
        phases = "—"
        if r.get("status") == "ok":
            phases = f"{r.get('fwd_ms', 0):.0f} / {r.get('bwd_ms', 0):.0f} / {r.get('opt_ms', 0):.0f}"
        shape = f"{k[0]} {k[1]} {k[2]}px b{k[3]}" + (" checkpointing" if k[5] else "")
        print(f"| {shape} | {k[4]} | {cell(r, 'step_ms_median', '{:.0f} ms')} | {cell(p, 'step_ms_median', '{:.0f} ms')} "
              f"| {ratio_t} | {cell(r, 'peak_gib', '{:.2f} GiB')} | {cell(p, 'peak_alloc_gib', '{:.2f} GiB')} | {ratio_m} | {phases} |")
    print_targets(default, peer)
    fp8 = [r for r in ours if r.get("fp8_base")]
    if fp8:
        print("\nThe fp8 frozen base (`--fp8-base`) beside the same shape on a bf16 base:\n")
        print("| shape | fp8 step | bf16-base step | fp8 peak | bf16-base peak |")
        print("|---|---|---|---|---|")
        base = {key(r): r for r in default}
        for r in fp8:
            k = key(r)
            b = base.get(k)
            shape = label(k)
            print(f"| {shape} | {cell(r, 'step_ms_median', '{:.0f} ms')} | {cell(b, 'step_ms_median', '{:.0f} ms')} "
                  f"| {cell(r, 'peak_gib', '{:.2f} GiB')} | {cell(b, 'peak_gib', '{:.2f} GiB')} |")
    fused = [r for r in ours if r.get("fused")]
    if fused:
        print("\nThe fused backward pass (`--fused`, `fused_backward_pass: true`) beside the same shape "
              "unfused and diffusers:\n")
        print("| shape | fused step | unfused step | diffusers step | fused peak | unfused peak | diffusers peak |")
        print("|---|---|---|---|---|---|---|")
        base = {key(r): r for r in default}
        for r in fused:
            k = key(r)
            b, p = base.get(k), peer.get(k)
            shape = label(k)
            print(f"| {shape} | {cell(r, 'step_ms_median', '{:.0f} ms')} | {cell(b, 'step_ms_median', '{:.0f} ms')} "
                  f"| {cell(p, 'step_ms_median', '{:.0f} ms')} | {cell(r, 'peak_gib', '{:.2f} GiB')} "
                  f"| {cell(b, 'peak_gib', '{:.2f} GiB')} | {cell(p, 'peak_alloc_gib', '{:.2f} GiB')} |")
    simt = [r for r in ours if str(r.get("variant", "")).startswith("SIMT flash")]
    if simt:
        print("\nFlash attention on tensor cores (the default for bf16) beside the SIMT kernels "
              "(`SDTRAIN_FLASH_TC=0`), the same shape:\n")
        print("| shape | tensor-core step | SIMT step | tensor-core fwd/bwd ms | SIMT fwd/bwd ms |")
        print("|---|---|---|---|---|")
        base = {key(r): r for r in default}
        for r in simt:
            k = key(r)
            b = base.get(k)
            shape = label(k)
            fb = lambda x: f"{x.get('fwd_ms', 0):.0f} / {x.get('bwd_ms', 0):.0f}" if x and x.get("status") == "ok" else "—"
            print(f"| {shape} | {cell(b, 'step_ms_median', '{:.0f} ms')} | {cell(r, 'step_ms_median', '{:.0f} ms')} "
                  f"| {fb(b)} | {fb(r)} |")
    variants = [r for r in ours if r not in default and not r.get("fp8_base") and r not in simt
                and not r.get("fused")]
    if variants:
        print("\nDevice settings and variants (sdtrain, sd15 LoRA 512 px b1 bf16; default: pool cache on, "
              "event tracking off, fused ops on):\n")
        print("| pool cache | event tracking | fused ops | variant | step | fwd/bwd/opt ms | peak |")
        print("|---|---|---|---|---|---|---|")
        for r in [x for x in ours if key(x) == ("sd15", "lora", 512, 1, "bf16", False)]:
            onoff = lambda f, d: "on" if r.get(f, d) else "off"
            phases = f"{r.get('fwd_ms', 0):.0f} / {r.get('bwd_ms', 0):.0f} / {r.get('opt_ms', 0):.0f}"
            print(f"| {onoff('pool_cache', True)} | {onoff('event_tracking', False)} | {onoff('fused_ops', True)} "
                  f"| {r.get('variant', 'default')} | {cell(r, 'step_ms_median', '{:.0f} ms')} | {phases} "
                  f"| {cell(r, 'peak_gib', '{:.2f} GiB')} |")
    census = [r for r in ours if r.get("mode") == "lora" and r.get("status") == "ok"]
    if census:
        r = census[0]
        print(f"\nLoRA gradient store: {r.get('grad_entries')} entries for {r.get('vars')} adapter Vars "
              f"({r.get('vars_with_grad')} with a gradient).")
    vram = read_jsonl(os.path.join(out, "vram.jsonl"))
    if vram:
        print_vram(vram)
    optim = read_jsonl(os.path.join(out, "optim.jsonl"))
    if optim:
        print_optimizers(optim)
    log = os.path.join(out, "cuda-tests.log")
    if os.path.exists(log):
        text = open(log).read()
        print("\n### CUDA test suite\n")
        for line in text.splitlines():
            if line.startswith("test result") or "FAILED" in line or "panicked" in line:
                print(f"- `{line.strip()}`")
        errs = [l.strip() for l in text.splitlines() if "rel err" in l or "max abs diff" in l or "losses" in l]
        if errs:
            print("\n<details><summary>parity errors on CUDA</summary>\n\n```")
            print("\n".join(errs))
            print("```\n</details>")
    if profiles:
        print("\n### Op profile (SD1.5 at 512 px, batch 1; each op alone, forward + backward, ms)\n")
        names = sorted({k for r in profiles for k in r["op_ms"]})
        print("| op | " + " | ".join(r.get("precision", "?") for r in profiles) + " |")
        print("|---|" + "---|" * len(profiles))
        for n in names:
            print(f"| {n} | " + " | ".join(f"{r['op_ms'].get(n, float('nan')):.2f}" for r in profiles) + " |")
    prof = os.path.join(out, "profile.md")
    if os.path.exists(prof) and os.path.getsize(prof) > 0:
        print()
        print(open(prof).read())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out")
