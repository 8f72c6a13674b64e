//! With the `cuda` feature: compiles every CUDA kernel file of the crate (`src/**/*.cu`) to PTX
//! with nvcc, into `OUT_DIR/<folder>_<stem>.ptx` (src/optim/kernels.cu → `optim_kernels.ptx`),
//! which the Rust side embeds with `include_str!` and loads as candle custom kernels.
//!
//! PTX at build time rather than NVRTC at run time: nvcc is already needed to build candle's own
//! kernels, a compile error shows up in the build (CI builds `--features cuda`) instead of at a
//! user's first step, and the GPU machine needs no libnvrtc. The PTX targets compute_75 (the
//! oldest architecture CUDA 13 supports) unless the file asks for another; the driver compiles it
//! for the card it runs on.
//!
//! A file sets its own nvcc flags on a line `// nvcc-flags: ...` (for example `--fmad=false`, or
//! `-arch=compute_80` for bf16 tensor-core code).
//!
//! nvcc is taken from NVCC, else CUDA_HOME/bin, else PATH (scripts/build-cuda.sh sets PATH).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every `.cu` file under `dir`, sorted.
fn cu_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            println!("cargo:rerun-if-changed={}", p.display());
            cu_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "cu") {
            out.push(p);
        }
    }
    out.sort();
}

/// The PTX file name of `cu`: its folder and stem.
fn ptx_name(cu: &Path) -> String {
    let stem = cu.file_stem().and_then(|s| s.to_str()).unwrap_or("kernels");
    let dir = cu
        .parent()
        .and_then(|d| d.file_name())
        .and_then(|s| s.to_str())
        .unwrap_or("src");
    format!("{dir}_{stem}.ptx")
}

/// The flags from the file's `// nvcc-flags:` line.
fn file_flags(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("// nvcc-flags:"))
        .flat_map(|f| f.split_whitespace().map(str::to_string))
        .collect()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CUDA_HOME")
                .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let mut files = Vec::new();
    cu_files(Path::new("src"), &mut files);
    for cu in files {
        println!("cargo:rerun-if-changed={}", cu.display());
        let source = std::fs::read_to_string(&cu)
            .unwrap_or_else(|e| panic!("reading {}: {e}", cu.display()));
        let flags = file_flags(&source);
        let mut cmd = Command::new(&nvcc);
        cmd.args(["--ptx", "-O3", "-std=c++17"]);
        if !flags.iter().any(|f| f.starts_with("-arch")) {
            cmd.arg("-arch=compute_75");
        }
        cmd.args(&flags)
            .arg(&cu)
            .arg("-o")
            .arg(out_dir.join(ptx_name(&cu)));
        match cmd.status() {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed on {} ({s})", cu.display()),
            Err(e) => panic!(
                "the cuda feature needs nvcc to compile {}: running {} failed: {e}. \
                 Set NVCC or CUDA_HOME, or build with scripts/build-cuda.sh",
                cu.display(),
                nvcc.display()
            ),
        }
    }
}
