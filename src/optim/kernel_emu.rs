//! Runs src/optim/kernels.cu on the host, for the unit tests: the file is compiled as C++ against
//! tests/kernel_emu/emu.h (every CUDA thread an OS thread, `__syncthreads` a barrier) with the
//! system C++ compiler (`CXX`, else `c++`), so the CUDA kernels are checked against the host
//! kernels on a machine without a GPU.
//!
//! The driver is built once per source version into the temp directory and reused.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::launch;
use super::quant8::Moment;

const SOURCES: [&str; 3] = [
    "src/optim/kernels.cu",
    "tests/kernel_emu/emu.h",
    "tests/kernel_emu/driver.cpp",
];

/// One of a kernel's buffer arguments, in argument order.
pub enum Buf<'a> {
    /// Read and written back.
    F32(&'a mut [f32]),
    U8(&'a mut [u8]),
    /// Read only.
    In(&'a [f32]),
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The built driver: compiled on first use, keyed by a hash of its sources.
fn driver() -> &'static Path {
    static DRIVER: OnceLock<PathBuf> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for s in SOURCES {
            std::fs::read(root().join(s))
                .unwrap_or_else(|e| panic!("kernel emulation: reading {s}: {e}"))
                .hash(&mut h);
        }
        let exe = std::env::temp_dir().join(format!("sdtrain-kernel-emu-{:016x}", h.finish()));
        if exe.exists() {
            return exe;
        }
        let tmp = exe.with_extension(format!("tmp{}", std::process::id()));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-pthread", "-DSDTRAIN_EMULATE"])
            .arg("-I")
            .arg(root().join("src/optim"))
            .arg("-I")
            .arg(root().join("tests/kernel_emu"))
            .arg(root().join("tests/kernel_emu/driver.cpp"))
            .arg("-o")
            .arg(&tmp)
            .output()
            .unwrap_or_else(|e| {
                panic!("kernel emulation needs a C++20 compiler ({cxx}, or set CXX): {e}")
            });
        assert!(
            out.status.success(),
            "kernel emulation: {cxx} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&tmp, &exe).expect("kernel emulation: placing the driver");
        exe
    })
}

/// Runs entry point `name` (without its `_q8`/`_f32` and dtype suffixes) on parameter `p` with
/// gradient `g` and state `moments` (all of one kind), as the CUDA path launches it: `maps` are
/// the dynamic maps the 8-bit kernels take, `scalars` the f32 arguments. `grid` overrides the
/// launch grid (to make grid-stride loops go round).
pub fn run_moments(
    name: &str,
    p: &mut [f32],
    g: &[f32],
    moments: &mut [&mut Moment],
    maps: &[f32],
    scalars: &[f32],
    grid: Option<u32>,
) {
    let q8 = matches!(moments.first().map(|m| &**m), Some(Moment::Q8 { .. }));
    let n = p.len();
    let mut bufs = vec![Buf::F32(p), Buf::In(g)];
    for m in moments.iter_mut() {
        match &mut **m {
            Moment::F32(v) => bufs.push(Buf::F32(v)),
            Moment::Q8 { codes, absmax } => {
                bufs.push(Buf::U8(codes));
                bufs.push(Buf::F32(absmax));
            }
        }
    }
    if q8 {
        bufs.push(Buf::In(maps));
    }
    let grid = grid.unwrap_or_else(|| launch::grid(n, q8));
    run(&launch::entry(name, q8), n, grid, scalars, &mut bufs);
}

/// Runs entry point `entry` (without its dtype suffix; f32 parameters) on `n` elements over
/// `grid` blocks, then writes the buffers back.
pub fn run(entry: &str, n: usize, grid: u32, scalars: &[f32], bufs: &mut [Buf]) {
    let mut bytes = Vec::new();
    for b in bufs.iter() {
        match b {
            Buf::F32(x) => x.iter().for_each(|v| bytes.extend(v.to_le_bytes())),
            Buf::In(x) => x.iter().for_each(|v| bytes.extend(v.to_le_bytes())),
            Buf::U8(x) => bytes.extend_from_slice(x),
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("buffers");
    std::fs::write(&file, &bytes).expect("writing the kernel's buffers");
    let out = Command::new(driver())
        .arg(entry)
        .arg(n.to_string())
        .arg(grid.to_string())
        .arg(&file)
        .args(scalars.iter().map(|s| format!("{:08x}", s.to_bits())))
        .output()
        .expect("running the kernel emulation driver");
    assert!(
        out.status.success(),
        "kernel emulation of {entry}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&file).expect("reading the kernel's buffers back");
    let mut at = 0;
    let f32_at = |at: usize| f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    for b in bufs.iter_mut() {
        match b {
            Buf::F32(x) => {
                for (i, v) in x.iter_mut().enumerate() {
                    *v = f32_at(at + 4 * i);
                }
                at += 4 * x.len();
            }
            Buf::In(x) => at += 4 * x.len(),
            Buf::U8(x) => {
                x.copy_from_slice(&bytes[at..at + x.len()]);
                at += x.len();
            }
        }
    }
}

/// How far an emulated run is from the host kernel's: the largest parameter difference, the
/// number of 8-bit codes that differ, and the largest difference of f32 state (values or absmax).
#[derive(Debug, Default)]
pub struct Gap {
    pub param: f32,
    pub codes: usize,
    pub state: f32,
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

impl Gap {
    /// The emulated kernel's bound against the host kernel at update `t`: codes equal but for
    /// midpoint ties (at most 1 in 1000), everything else within 1e-6, and bit for bit on the
    /// first update (nothing has diverged through a tie yet).
    pub fn assert_tracks(&self, n: usize, t: u64) {
        assert!(self.codes <= n / 1000, "n={n} t={t}: {self:?}");
        assert!(
            self.param <= 1e-6 && self.state <= 1e-6,
            "n={n} t={t}: {self:?}"
        );
        if t == 1 {
            assert_eq!((self.param, self.state), (0.0, 0.0), "n={n}: {self:?}");
        }
    }
}

pub fn gap(p_host: &[f32], p_emu: &[f32], m_host: &[&Moment], m_emu: &[&Moment]) -> Gap {
    let mut gap = Gap {
        param: max_diff(p_host, p_emu),
        ..Gap::default()
    };
    for (a, b) in m_host.iter().zip(m_emu) {
        match (a, b) {
            (Moment::F32(a), Moment::F32(b)) => gap.state = gap.state.max(max_diff(a, b)),
            (
                Moment::Q8 {
                    codes: ca,
                    absmax: aa,
                },
                Moment::Q8 {
                    codes: cb,
                    absmax: ab,
                },
            ) => {
                gap.codes += ca.iter().zip(cb).filter(|(x, y)| x != y).count();
                gap.state = gap.state.max(max_diff(aa, ab));
            }
            _ => panic!("moments of different kinds"),
        }
    }
    gap
}

/// The two maps as the 8-bit kernels take them: signed, then unsigned.
pub fn map_buffer() -> Vec<f32> {
    let (signed, unsigned) = super::quant8::maps();
    signed.code.iter().chain(&unsigned.code).copied().collect()
}
