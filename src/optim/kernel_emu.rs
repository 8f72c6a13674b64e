//! The optimizer kernels (src/optim/kernels.cu) under the host emulation ([`crate::kernel_emu`]),
//! in the optimizers' terms: a parameter, its gradient, its moments and the dynamic maps, launched
//! as the CUDA path launches them; and how far a run is from the host kernels'.

use crate::kernel_emu::{self, Arg};

use super::launch;
use super::quant8::Moment;

const SOURCE: &str = "src/optim/kernels.cu";

/// One of a kernel's buffer arguments, in argument order.
pub enum Buf<'a> {
    /// Read and written back.
    F32(&'a mut [f32]),
    U8(&'a mut [u8]),
    /// A bf16 or f16 parameter, read and written back (the entry point of its dtype).
    Bf16(&'a mut [half::bf16]),
    F16(&'a mut [half::f16]),
    /// Read only.
    In(&'a [f32]),
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
    run_moments_on(name, Buf::F32(p), g, moments, maps, scalars, grid)
}

/// [`run_moments`] on a parameter of any dtype (`Buf::F32`, `Buf::Bf16` or `Buf::F16`), through
/// the entry point of its dtype.
pub fn run_moments_on(
    name: &str,
    p: Buf,
    g: &[f32],
    moments: &mut [&mut Moment],
    maps: &[f32],
    scalars: &[f32],
    grid: Option<u32>,
) {
    let q8 = matches!(moments.first().map(|m| &**m), Some(Moment::Q8 { .. }));
    let n = g.len();
    let mut bufs = vec![p, Buf::In(g)];
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

/// Runs entry point `entry` (without its dtype suffix, which is the first buffer's: the
/// parameter) on `n` elements over `grid` blocks, then writes the buffers back.
pub fn run(entry: &str, n: usize, grid: u32, scalars: &[f32], bufs: &mut [Buf]) {
    let suffix = match bufs.first() {
        Some(Buf::Bf16(_)) => "bf16",
        Some(Buf::F16(_)) => "f16",
        _ => "f32",
    };
    let mut args: Vec<Arg> = bufs
        .iter_mut()
        .map(|b| match b {
            Buf::F32(x) => Arg::out(x),
            Buf::U8(x) => Arg::out(x),
            Buf::Bf16(x) => Arg::out(x),
            Buf::F16(x) => Arg::out(x),
            Buf::In(x) => Arg::input(x),
        })
        .collect();
    args.extend(scalars.iter().map(|&s| Arg::F32(s)));
    args.push(Arg::Int(n as i64));
    kernel_emu::launch(
        SOURCE,
        &format!("{entry}_{suffix}"),
        [grid, 1, 1],
        [launch::THREADS, 1, 1],
        &mut args,
    );
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

/// A bf16 or f16 parameter on the host.
enum LowPrecision {
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl LowPrecision {
    /// `values` rounded to nearest even into the same dtype as `self`.
    fn rounded(&self, values: &[f32]) -> Self {
        match self {
            Self::Bf16(_) => Self::Bf16(values.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            Self::F16(_) => Self::F16(values.iter().map(|&x| half::f16::from_f32(x)).collect()),
        }
    }

    fn to_f32(&self) -> Vec<f32> {
        match self {
            Self::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Self::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    fn bits(&self) -> Vec<u16> {
        match self {
            Self::Bf16(v) => v.iter().map(|x| x.to_bits()).collect(),
            Self::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        }
    }

    fn buf(&mut self) -> Buf<'_> {
        match self {
            Self::Bf16(v) => Buf::Bf16(v),
            Self::F16(v) => Buf::F16(v),
        }
    }
}

/// Entry point `name`'s bf16 and f16 versions against its f32 one under the emulation, for
/// `steps` updates of `n` elements from `moments` (with gradients `grad(t)` and scalars
/// `scalars(t)`): before each update the f32 run starts from the low-precision parameter's
/// values, and after it the low-precision parameter must be the f32 result rounded to nearest
/// even, and the state bit for bit the f32 run's. The f32 entry points are held to the host
/// kernels by each optimizer's own emulation test, so this holds the others to them too.
pub fn assert_low_precision_tracks_f32(
    name: &str,
    n: usize,
    moments: &[Moment],
    maps: &[f32],
    grad: impl Fn(u64) -> Vec<f32>,
    scalars: impl Fn(u64) -> Vec<f32>,
    steps: u64,
) {
    let start = super::test_values(9, n, 1.0);
    let kinds = [
        LowPrecision::Bf16(Vec::new()),
        LowPrecision::F16(Vec::new()),
    ];
    for kind in kinds {
        let dtype = match kind {
            LowPrecision::Bf16(_) => "bf16",
            LowPrecision::F16(_) => "f16",
        };
        let mut low = kind.rounded(&start);
        let (mut m_low, mut m_f32) = (moments.to_vec(), moments.to_vec());
        for t in 1..=steps {
            let (g, k) = (grad(t), scalars(t));
            let mut p_f32 = low.to_f32();
            let mut refs: Vec<&mut Moment> = m_f32.iter_mut().collect();
            run_moments(name, &mut p_f32, &g, &mut refs, maps, &k, None);
            let mut refs: Vec<&mut Moment> = m_low.iter_mut().collect();
            run_moments_on(name, low.buf(), &g, &mut refs, maps, &k, None);
            let (got, want) = (low.bits(), low.rounded(&p_f32).bits());
            let wrong = (0..n).filter(|&i| got[i] != want[i]).count();
            let first = (0..n).find(|&i| got[i] != want[i]);
            assert_eq!(
                wrong, 0,
                "{name} {dtype} t={t}: {wrong} of {n} parameters are not the f32 update \
                 rounded to nearest even (first at {first:?})"
            );
            let a: Vec<&Moment> = m_f32.iter().collect();
            let b: Vec<&Moment> = m_low.iter().collect();
            let gap = gap(&p_f32, &p_f32, &a, &b);
            assert_eq!(
                (gap.codes, gap.state),
                (0, 0.0),
                "{name} {dtype} t={t}: state differs from the f32 run's: {gap:?}"
            );
        }
    }
}
