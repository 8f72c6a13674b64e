//! The CUDA launches of src/nn/kernels/fp8.cu: the row scales, encoding and decoding of the fp8
//! frozen base (the arithmetic and the host version: [`super::fp8`]).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_fp8.ptx"));
const MODULE: &str = "sdtrain_fp8";
const THREADS: u32 = 256;
/// Grid-stride loops: at most this many blocks.
const MAX_BLOCKS: usize = 4096;

fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("fp8 kernels: a {other:?} weight (f32, bf16 or f16 only)"),
    })
}

fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => bail!("fp8 kernels: the {what} is not contiguous"),
    }
}

fn config(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elementwise(n: usize) -> LaunchConfig {
    config(n.div_ceil(THREADS as usize))
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("fp8 kernels: {what} {v} > u32")))
}

/// Calls `$f::<T>($args)` with `T` the Rust type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            other => bail!("fp8 kernels: a {other:?} weight (f32, bf16 or f16 only)"),
        }
    };
}

/// The f32 row scales of the weight `s` (`rows` × `cols`).
pub(crate) fn row_scale(
    s: &CudaStorage,
    l: &Layout,
    rows: usize,
    cols: usize,
) -> Result<CudaStorage> {
    by_dtype!(s.dtype(), row_scale_t(s, l, rows, cols))
}

fn row_scale_t<T: CudaDType + DeviceRepr>(
    s: &CudaStorage,
    l: &Layout,
    rows: usize,
    cols: usize,
) -> Result<CudaStorage> {
    let dev = s.device().clone();
    let w = view::<T>(s, l, "weight")?;
    // SAFETY: the kernel writes every one of the `rows` scales.
    let mut scale = unsafe { dev.alloc::<f32>(rows) }?;
    let f = function(&dev, &format!("fp8_row_scale_{}", suffix(s.dtype())?))?;
    let stream = dev.cuda_stream();
    let (rows32, cols32) = (u32_of(rows, "rows")?, u32_of(cols, "columns")?);
    let mut b = stream.launch_builder(&f);
    b.arg(&mut scale).arg(&w).arg(&rows32).arg(&cols32);
    // SAFETY: fp8_row_scale_T(float* scale, const T* w, u32 rows, u32 cols); `w` holds rows·cols
    // values, `scale` rows; one warp per row, grid-stride over rows.
    unsafe { b.launch(config(rows.div_ceil(THREADS as usize / 32))) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(scale, dev))
}

/// The e4m3 codes of the weight `s` with the row scales `sc`.
pub(crate) fn encode(
    s: &CudaStorage,
    l: &Layout,
    sc: &CudaStorage,
    scl: &Layout,
    cols: usize,
) -> Result<CudaStorage> {
    by_dtype!(s.dtype(), encode_t(s, l, sc, scl, cols))
}

fn encode_t<T: CudaDType + DeviceRepr>(
    s: &CudaStorage,
    l: &Layout,
    sc: &CudaStorage,
    scl: &Layout,
    cols: usize,
) -> Result<CudaStorage> {
    let dev = s.device().clone();
    let w = view::<T>(s, l, "weight")?;
    let scale = view::<f32>(sc, scl, "scales")?;
    let n = l.shape().elem_count();
    if scale.len() * cols != n {
        bail!(
            "fp8 encode: {} scales for {n} weights of {cols} per row",
            scale.len()
        );
    }
    // SAFETY: the kernel writes every one of the `n` codes.
    let mut codes = unsafe { dev.alloc::<u8>(n) }?;
    let f = function(&dev, &format!("fp8_encode_{}", suffix(s.dtype())?))?;
    let stream = dev.cuda_stream();
    let (n64, cols32) = (n as u64, u32_of(cols, "columns")?);
    let mut b = stream.launch_builder(&f);
    b.arg(&mut codes).arg(&w).arg(&scale).arg(&n64).arg(&cols32);
    // SAFETY: fp8_encode_T(u8* codes, const T* w, const float* scale, u64 n, u32 cols); `w` and
    // `codes` hold n values, `scale` n / cols; grid-stride.
    unsafe { b.launch(elementwise(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(codes, dev))
}

/// The weight in `dtype` that the codes `s` and row scales `sc` encode.
pub(crate) fn decode(
    s: &CudaStorage,
    l: &Layout,
    sc: &CudaStorage,
    scl: &Layout,
    cols: usize,
    dtype: DType,
) -> Result<CudaStorage> {
    by_dtype!(dtype, decode_t(s, l, sc, scl, cols, dtype))
}

fn decode_t<T: CudaDType + DeviceRepr>(
    s: &CudaStorage,
    l: &Layout,
    sc: &CudaStorage,
    scl: &Layout,
    cols: usize,
    dtype: DType,
) -> Result<CudaStorage> {
    let dev = s.device().clone();
    let codes = view::<u8>(s, l, "codes")?;
    let scale = view::<f32>(sc, scl, "scales")?;
    let n = l.shape().elem_count();
    if scale.len() * cols != n {
        bail!(
            "fp8 decode: {} scales for {n} codes of {cols} per row",
            scale.len()
        );
    }
    // SAFETY: the kernel writes every one of the `n` values.
    let mut out = unsafe { dev.alloc::<T>(n) }?;
    let f = function(&dev, &format!("fp8_decode_{}", suffix(dtype)?))?;
    let stream = dev.cuda_stream();
    let (n64, cols32) = (n as u64, u32_of(cols, "columns")?);
    let mut b = stream.launch_builder(&f);
    b.arg(&mut out)
        .arg(&codes)
        .arg(&scale)
        .arg(&n64)
        .arg(&cols32);
    // SAFETY: fp8_decode_T(T* out, const u8* codes, const float* scale, u64 n, u32 cols); `codes`
    // and `out` hold n values, `scale` n / cols; grid-stride.
    unsafe { b.launch(elementwise(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
