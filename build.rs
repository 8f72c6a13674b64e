//! With the `cuda` feature: compiles the optimizers' kernels (src/optim/kernels.cu) to PTX with
//! nvcc, embedded in the binary by src/optim/cuda.rs.
//!
//! PTX at build time rather than NVRTC at run time: nvcc is already needed to build candle's own
//! kernels, a compile error shows up in the build (CI builds `--features cuda`) instead of at a
//! user's first step, and the GPU machine needs no libnvrtc. The PTX targets compute_75 (the
//! oldest architecture CUDA 13 supports); the driver compiles it for the card it runs on.
//!
//! nvcc is taken from NVCC, else CUDA_HOME/bin, else PATH (scripts/build-cuda.sh sets PATH).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/optim/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("optim.ptx");
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CUDA_HOME")
                .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-arch=compute_75",
            "--fmad=false",
            "-O3",
            "-std=c++17",
        ])
        .arg("src/optim/kernels.cu")
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed on src/optim/kernels.cu ({s})"),
        Err(e) => panic!(
            "the cuda feature needs nvcc to compile src/optim/kernels.cu: running {} failed: {e}. \
             Set NVCC or CUDA_HOME, or build with scripts/build-cuda.sh",
            nvcc.display()
        ),
    }
}
