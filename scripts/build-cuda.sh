#!/usr/bin/env bash
# Builds and links sdtrain with `--features cuda` on a machine with no GPU and no system CUDA
# toolkit: CI uses it, and so can a user without a toolkit (README.md, docs/GPU.md).
#
#  1. The CUDA 13.0 compiler toolchain from pinned PyPI wheels (nvcc, ptxas, nvvm, crt, cccl and
#     the cudart runtime) in a venv. Pin all five: a newer nvvm emits PTX that ptxas 13.0 rejects.
#  2. Empty stub shared libraries for the libraries cudarc links with `dynamic-linking`
#     (libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13, and
#     libnccl.so.2 for the `nccl` feature),
#     generated from the extern "C" names in cudarc's own bindings, as the toolkit's lib/stubs are.
#     They are on LIBRARY_PATH only (link time); nothing is baked into the binary (no rpath), so
#     at run time the loader finds the real driver and CUDA libraries of the GPU machine.
#  3. cargo build with the arguments given (default: --release --features cuda).
#
# At run time a GPU machine needs the driver's libcuda.so.1 plus libcublas.so.13,
# libcublasLt.so.13, libcurand.so.10 and libcudart.so.13 (a CUDA 13 toolkit, or the pip wheels
# nvidia-cublas, nvidia-curand and nvidia-cuda-runtime on LD_LIBRARY_PATH; scripts/gpu-check finds
# them). Kernels are compiled for CUDA_COMPUTE_CAP: 90 (the default) is H100/H200, 86 an RTX 30xx
# (3060 12 GB), 89 an RTX 40xx (4070 12 GB), 80 an A100. A binary built for one does not load on
# another.
#
# Usage (from the repo root): scripts/build-cuda.sh [build|test|check|clippy] [cargo args...]
#   The default subcommand is build and the default args --release --features cuda. With `test`,
#   the test binaries run against the stub libraries: without a GPU the tests that need a device
#   report as ignored and the device-free ones run, which checks that they load and start.
# Environment: CARGO_TARGET_DIR (default ./target), SDTRAIN_CUDA_CACHE (where the venv and stubs
# live, default ~/.cache/sdtrain-cuda), CUDA_COMPUTE_CAP (default 90).
set -euo pipefail

PROJECT=${PROJECT:-$PWD}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PROJECT/target}
CACHE=${SDTRAIN_CUDA_CACHE:-$HOME/.cache/sdtrain-cuda}
VENV=$CACHE/venv
STUBS=$CACHE/stubs
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
CARGO_CMD=build
case "${1:-}" in build | test | check | clippy) CARGO_CMD=$1; shift ;; esac
BUILD_ARGS=("$@")
[ ${#BUILD_ARGS[@]} -gt 0 ] || BUILD_ARGS=(--release --features cuda)

# --- 1. toolchain (~100 MB download; pin all five or ptxas rejects newer PTX from a newer nvvm)
PINS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
# A cached toolchain is reused as long as its stamp names the same pins (no registry access then).
if [ "$(cat "$VENV/.sdtrain-pins" 2>/dev/null)" != "${PINS[*]}" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "${PINS[@]}"
  echo "${PINS[*]}" >"$VENV/.sdtrain-pins"
fi
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
export CUDA_HOME="$SITE/nvidia/cu13"
export PATH="$CUDA_HOME/bin:$PATH"
# candle-kernels links its static libmoe.a with -lcudart (dynamic): use the wheel's real libcudart.so.13.
ln -sf libcudart.so.13 "$CUDA_HOME/lib/libcudart.so"
nvcc --version | tail -2

# --- 2. stub libraries from cudarc's bindings
cd "$PROJECT"
CUDARC_DIR=$(cargo metadata --format-version 1 --features cuda 2>/dev/null | "$VENV/bin/python" -c '
import json, os, sys
m = json.load(sys.stdin)
p = [p for p in m["packages"] if p["name"] == "cudarc"]
assert len(p) == 1, p
print(os.path.dirname(p[0]["manifest_path"]))')
echo "cudarc sources: $CUDARC_DIR"
mkdir -p "$STUBS"
"$VENV/bin/python" - "$CUDARC_DIR/src" "$STUBS" <<'PY'
import re, subprocess, sys, os
src, out = sys.argv[1], sys.argv[2]
# (cudarc module, soname, link name, error value for status returns, symbol version node)
# The real CUDA 13 libs version their symbols with a node named after the soname (checked with
# readelf -V on the pip wheels); the driver library is left unversioned.
LIBS = [
    ("driver",   "libcuda.so.1",      "libcuda.so",     34,  None),  # CUDA_ERROR_STUB_LIBRARY
    ("cublas",   "libcublas.so.13",   "libcublas.so",   1,   "libcublas.so.13"),  # NOT_INITIALIZED
    ("cublaslt", "libcublasLt.so.13", "libcublasLt.so", 1,   "libcublasLt.so.13"),
    ("curand",   "libcurand.so.10",   "libcurand.so",   203, "libcurand.so.10"),  # INITIALIZATION_FAILED
    ("nvrtc",    "libnvrtc.so.13",    "libnvrtc.so",    11,  "libnvrtc.so.13"),   # INTERNAL_ERROR
    ("nccl",     "libnccl.so.2",      "libnccl.so",     2,   None),  # ncclSystemError (feature nccl)
]
STATUS = {"CUresult", "cublasStatus_t", "curandStatus_t", "nvrtcResult", "ncclResult_t"}
decl = re.compile(r'^\s+fn (\w+)\((.*)\)(?: -> (.+))?;$')
for mod, soname, linkname, err, node in LIBS:
    text = open(os.path.join(src, mod, "sys", "mod.rs")).read()
    names = set(re.findall(r'load::<_F>\("(\w+)"\)', text))   # every symbol cudarc can call
    rets = {}
    for line in text.splitlines():
        m = decl.match(line)
        if m and m.group(1) in names:
            rets.setdefault(m.group(1), (m.group(3) or "").strip())
    assert set(rets) == names, (mod, names - set(rets))
    c = ["/* generated stub for %s: every entry point fails, never use at run time */" % soname,
         "#include <stddef.h>"]
    for n in sorted(names):
        r = rets[n]
        if r in STATUS:
            c.append("int %s(void) { return %d; }" % (n, err))
        elif r == "":
            c.append("void %s(void) { }" % n)
        elif r == "usize":
            c.append("size_t %s(void) { return 0; }" % n)
        elif r.startswith("*const") or r.startswith("*mut"):
            c.append('const void *%s(void) { return "%s stub"; }' % (n, soname))
        else:
            sys.exit("unhandled return type %r for %s" % (r, n))
    cfile = os.path.join(out, soname + ".c")
    open(cfile, "w").write("\n".join(c) + "\n")
    cmd = ["gcc", "-shared", "-fPIC", "-O0", "-fno-builtin", "-w", "-o", os.path.join(out, soname),
           "-Wl,-soname," + soname, cfile]
    if node:
        vfile = os.path.join(out, soname + ".map")
        open(vfile, "w").write("%s { global: *; };\n" % node)
        cmd.append("-Wl,--version-script=" + vfile)
    subprocess.check_call(cmd)
    link = os.path.join(out, linkname)
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(soname, link)
    print("stub %-18s %4d symbols" % (soname, len(names)))
PY

# --- 3. build: stubs only on the link-time search path (gcc reads LIBRARY_PATH; no rpath is added)
export LIBRARY_PATH="$STUBS:$CUDA_HOME/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
[ "$CARGO_CMD" = test ] && export LD_LIBRARY_PATH="$STUBS:$CUDA_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
time cargo "$CARGO_CMD" "${BUILD_ARGS[@]}"

BIN="$CARGO_TARGET_DIR/release/sdtrain"
if [ -x "$BIN" ]; then
  echo "--- NEEDED / RPATH of $BIN"
  readelf -d "$BIN" | grep -E 'NEEDED|RPATH|RUNPATH' || true
  echo "--- to run here (no GPU): LD_LIBRARY_PATH=$STUBS:$CUDA_HOME/lib $BIN --help"
fi
