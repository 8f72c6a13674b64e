#!/usr/bin/env python3
"""Where a step's GPU time goes: python3 scripts/ncu_summary.py ncu.csv > profile.md.

Reads the CSV of `ncu --metrics gpu__time_duration.sum --csv --print-units base` (one row per
kernel launch, time in ns), groups kernels by name and by kind (convolution, matmul, attention
softmax, norms and reductions, elementwise, copies and casts, optimizer), and prints two markdown
tables: time per kind and the 20 most expensive kernels. Kernel time only: launch gaps and
host-side work are not in it (compare the total with the step time).
"""
import csv
import re
import sys
from collections import defaultdict

KINDS = [
    ("conv (naive conv_transpose2d / im2col / col2im)", r"conv_transpose|im2col|col2im|conv2d|conv1d"),
    ("matmul (cuBLAS)", r"gemm|xmma|cutlass|sm\d+_|ampere|hopper|cublas|gemv|splitK"),
    ("softmax / reductions", r"softmax|reduce|sum|max|min|argm|fast_"),
    ("norm", r"norm"),
    ("copy / cast / where", r"copy|cast|ucopy|where|index|gather|scatter|cat|fill"),
    ("elementwise (affine, binary, unary)", r"affine|badd|bmul|bsub|bdiv|bminimum|bmaximum|uneg|uexp|ulog|usqr|usqrt|urecip|ugelu|usilu|utanh|uabs|elu|powf|unary|binary|add|mul|sub|div"),
]


def kind(name):
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "other"


def main(path):
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        rows.append((r.get("Kernel Name", "?"), ns))
    if not rows:
        print("(no kernels in the ncu output)")
        return
    total = sum(ns for _, ns in rows)
    by_kind, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for name, ns in rows:
        short = re.sub(r"\(.*", "", name)[:80]
        by_kind[kind(short)] += ns
        by_name[short] += ns
        count[short] += 1
    print(f"### Kernel profile (ncu): {len(rows)} launches, {total / 1e6:.1f} ms of kernel time\n")
    print("| kind | ms | share |")
    print("|---|---|---|")
    for k, ns in sorted(by_kind.items(), key=lambda x: -x[1]):
        print(f"| {k} | {ns / 1e6:.1f} | {100 * ns / total:.1f}% |")
    print("\n| kernel | launches | ms | share |")
    print("|---|---|---|---|")
    for n, ns in sorted(by_name.items(), key=lambda x: -x[1])[:20]:
        print(f"| `{n}` | {count[n]} | {ns / 1e6:.2f} | {100 * ns / total:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
