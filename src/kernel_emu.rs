//! Runs any of sdtrain's CUDA kernel files (`src/**/*.cu`) on the host, for the unit tests: the
//! file is compiled as C++ against tests/kernel_emu/emu.h (every CUDA thread an OS thread,
//! `__syncthreads` a barrier, warp shuffles through a per-warp exchange) and the generic driver
//! tests/kernel_emu/emu_main.h, with the system C++ compiler (`CXX`, else `c++`), so a kernel is
//! checked against its reference on a machine without a GPU.
//!
//! The driver of a file lists every `extern "C" __global__` entry point found in it. It is built
//! with AddressSanitizer where the compiler has it (a kernel that reads or writes out of bounds
//! then fails the test), once per version of its sources, into the temp directory.
//!
//! `SDTRAIN_EMULATE` is defined, so a .cu file can keep device-only code (intrinsics, vector
//! types) behind `#ifndef SDTRAIN_EMULATE`.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

const EMU_HEADERS: [&str; 2] = ["tests/kernel_emu/emu.h", "tests/kernel_emu/emu_main.h"];

/// A buffer element type: plain old data the driver sees as bytes.
///
/// # Safety
/// Implementors have no padding and every bit pattern is a valid value.
pub unsafe trait Elem: Copy {}
unsafe impl Elem for f32 {}
unsafe impl Elem for u8 {}
unsafe impl Elem for u16 {}
unsafe impl Elem for i32 {}
unsafe impl Elem for u32 {}
unsafe impl Elem for half::bf16 {}
unsafe impl Elem for half::f16 {}

/// One kernel parameter, in the entry point's order.
pub enum Arg<'a> {
    /// A pointer to a buffer that is read and written back.
    Out(&'a mut [u8]),
    /// A pointer to a buffer that is only read.
    In(&'a [u8]),
    /// A float parameter.
    F32(f32),
    /// An integer parameter of any width.
    Int(i64),
}

impl<'a> Arg<'a> {
    pub fn out<T: Elem>(x: &'a mut [T]) -> Self {
        let len = std::mem::size_of_val(x);
        // SAFETY: T is plain data (Elem), so its bytes may be read and written as u8.
        Arg::Out(unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), len) })
    }

    pub fn input<T: Elem>(x: &'a [T]) -> Self {
        // SAFETY: as in `out`.
        Arg::In(unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) })
    }
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `extern "C" __global__` entry points of a .cu source, in order.
pub fn entry_points(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    // Entry points made by a macro are written on one logical line; split on the keyword.
    for part in source.split("extern \"C\"").skip(1) {
        let Some(rest) = part.trim_start().strip_prefix("__global__") else {
            continue;
        };
        let head = rest.split('(').next().unwrap_or("");
        if let Some(name) = head.split_whitespace().last() {
            // Macro entry points paste a suffix (`adamw_f32_##SUFFIX`): expand from the
            // instantiations the file makes, `ENTRY_POINTS(f32, float)` and the like.
            names.push(name.to_string());
        }
    }
    names
}

/// Expands `NAME_##SUFFIX` entry points with the suffixes of the file's macro instantiations that
/// are compiled under the emulation (those outside `#ifndef SDTRAIN_EMULATE`).
fn expand_pasted(source: &str, names: Vec<String>) -> Vec<String> {
    if !names.iter().any(|n| n.contains("##")) {
        return names;
    }
    let mut suffixes = Vec::new();
    let mut skipping = 0usize;
    for line in source.lines() {
        let l = line.trim();
        if l.starts_with("#ifndef SDTRAIN_EMULATE") {
            skipping += 1;
        } else if skipping > 0 && l.starts_with("#endif") {
            skipping -= 1;
        } else if skipping == 0 && !l.starts_with('#') && !l.ends_with('\\') {
            // `MACRO(suffix, type)` at the top level.
            if let Some((mac, args)) = l.split_once('(') {
                let is_call = mac.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                    && !mac.is_empty()
                    && l.ends_with(')');
                if is_call {
                    suffixes.push(args.split(',').next().unwrap_or("").trim().to_string());
                }
            }
        }
    }
    names
        .into_iter()
        .flat_map(|n| match n.split_once("##") {
            Some((stem, _)) => suffixes.iter().map(|s| format!("{stem}{s}")).collect(),
            None => vec![n],
        })
        .collect()
}

fn compile(cxx: &str, src: &Path, exe: &Path, asan: bool) -> std::io::Result<std::process::Output> {
    let mut cmd = Command::new(cxx);
    cmd.args(["-std=c++20", "-O1", "-pthread", "-DSDTRAIN_EMULATE", "-w"]);
    if asan {
        cmd.args(["-fsanitize=address", "-fno-omit-frame-pointer"]);
    }
    cmd.arg("-I")
        .arg(root().join("tests/kernel_emu"))
        .arg(src)
        .arg("-o")
        .arg(exe)
        .output()
}

/// The built driver of `cu` (a path relative to the crate root), compiled on first use.
fn driver(cu: &str) -> PathBuf {
    static DRIVERS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut drivers = DRIVERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = drivers.get(cu) {
        return p.clone();
    }
    let cu_path = root().join(cu);
    let source = std::fs::read_to_string(&cu_path)
        .unwrap_or_else(|e| panic!("kernel emulation: reading {cu}: {e}"));
    let names = expand_pasted(&source, entry_points(&source));
    assert!(
        !names.is_empty(),
        "kernel emulation: {cu} has no extern \"C\" __global__ entry point"
    );
    let table: String = names
        .iter()
        .map(|n| format!("  {{\"{n}\", &emu_call<&{n}>}},\n"))
        .collect();
    let generated = format!(
        "#include \"emu.h\"\n#include \"{}\"\n#include \"emu_main.h\"\n\
         static const EmuEntry EMU_ENTRIES[] = {{\n{table}}};\n\
         int main(int argc, char** argv) {{\n  \
         return emu_main(argc, argv, EMU_ENTRIES, sizeof EMU_ENTRIES / sizeof *EMU_ENTRIES);\n}}\n",
        cu_path.display()
    );
    let mut h = std::collections::hash_map::DefaultHasher::new();
    generated.hash(&mut h);
    source.hash(&mut h);
    for s in EMU_HEADERS {
        std::fs::read(root().join(s))
            .unwrap_or_else(|e| panic!("kernel emulation: reading {s}: {e}"))
            .hash(&mut h);
    }
    // Headers the .cu file includes from its own folder.
    if let Some(dir) = cu_path.parent() {
        let mut local: Vec<_> = std::fs::read_dir(dir)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        local.retain(|p: &PathBuf| p.extension().is_some_and(|x| x == "cuh"));
        local.sort();
        for p in local {
            std::fs::read(&p).unwrap_or_default().hash(&mut h);
        }
    }
    let stem = cu.replace(['/', '.'], "_");
    let exe = std::env::temp_dir().join(format!("sdtrain-emu-{stem}-{:016x}", h.finish()));
    if !exe.exists() {
        let pid = std::process::id();
        let src = exe.with_extension(format!("{pid}.cpp"));
        std::fs::write(&src, &generated).expect("kernel emulation: writing the driver source");
        let tmp = exe.with_extension(format!("tmp{pid}"));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let run = |asan| {
            compile(&cxx, &src, &tmp, asan).unwrap_or_else(|e| {
                panic!("kernel emulation needs a C++20 compiler ({cxx}, or set CXX): {e}")
            })
        };
        let mut out = run(true);
        if !out.status.success() {
            // No AddressSanitizer runtime: build without it (a compile error shows again).
            out = run(false);
        }
        let _ = std::fs::remove_file(&src);
        assert!(
            out.status.success(),
            "kernel emulation: {cxx} failed on {cu}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&tmp, &exe).expect("kernel emulation: placing the driver");
    }
    drivers.insert(cu.to_string(), exe.clone());
    exe
}

/// Runs entry point `entry` of `cu` (a path relative to the crate root) over `grid` blocks of
/// `block` threads with `args`, then writes every buffer back. Panics with the driver's message
/// when the launch fails (a bad argument list, a divergent barrier, an out-of-bounds access).
pub fn launch(cu: &str, entry: &str, grid: [u32; 3], block: [u32; 3], args: &mut [Arg]) {
    let mut bytes = Vec::new();
    let mut tokens = Vec::new();
    for a in args.iter() {
        match a {
            Arg::Out(x) => {
                bytes.extend_from_slice(x);
                tokens.push(format!("b:{}", x.len()));
            }
            Arg::In(x) => {
                bytes.extend_from_slice(x);
                tokens.push(format!("b:{}", x.len()));
            }
            Arg::F32(v) => tokens.push(format!("f:{:08x}", v.to_bits())),
            Arg::Int(v) => tokens.push(format!("i:{v}")),
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("buffers");
    std::fs::write(&file, &bytes).expect("writing the kernel's buffers");
    let dims = grid.iter().chain(&block).map(|d| d.to_string());
    let out = Command::new(driver(cu))
        .arg(entry)
        .args(dims)
        .arg(&file)
        .args(&tokens)
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .output()
        .expect("running the kernel emulation driver");
    assert!(
        out.status.success(),
        "kernel emulation of {cu}:{entry} ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&file).expect("reading the kernel's buffers back");
    let mut at = 0;
    for a in args.iter_mut() {
        match a {
            Arg::Out(x) => {
                x.copy_from_slice(&bytes[at..at + x.len()]);
                at += x.len();
            }
            Arg::In(x) => at += x.len(),
            Arg::F32(_) | Arg::Int(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_found_in_plain_and_macro_definitions() {
        let src = "extern \"C\" __global__ void a(float* p, u64 n) {}\n\
                   #define E(S, P) extern \"C\" __global__ void b_##S(P* p) {}\n\
                   E(f32, float)\n#ifndef SDTRAIN_EMULATE\nE(bf16, __nv_bfloat16)\n#endif\n";
        let names = expand_pasted(src, entry_points(src));
        assert_eq!(names, ["a", "b_f32"]);
    }
}
