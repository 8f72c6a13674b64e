//! The out-of-memory classifier on the real CUDA error types (no device needed): a driver
//! allocation failure as candle and our own kernels report it, a cuBLAS one, and each under
//! candle's and anyhow's wrapping. Included from tests/cuda.rs, which compiles only with the
//! `cuda` feature; the one test there that runs without a GPU.

#[test]
fn cuda_oom_errors_of_every_kind_are_classified() {
    use candle_core::cuda_backend::cudarc::cublas::result::CublasError;
    use candle_core::cuda_backend::cudarc::cublas::sys::cublasStatus_t;
    use candle_core::cuda_backend::cudarc::driver::sys::CUresult;
    use candle_core::cuda_backend::cudarc::driver::DriverError;
    use candle_core::cuda_backend::CudaError;
    use sdtrain::train::oom::find_oom;

    let driver = || CudaError::Cuda(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    let cublas = CudaError::Cublas(CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED));
    let cases: Vec<anyhow::Error> = vec![
        candle_core::Error::from(driver()).into(),
        candle_core::Error::from(cublas).into(),
        candle_core::Error::from(driver()).context("conv2d").into(),
        anyhow::Error::from(candle_core::Error::from(driver())).context("micro-batch"),
        CudaError::Load {
            cuda: DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            module_name: "sdtrain_optim".into(),
        }
        .into(),
    ];
    for err in &cases {
        assert!(find_oom(err).is_some(), "not classified: {err:?}");
    }
    let other: anyhow::Error = candle_core::Error::from(CudaError::Cuda(DriverError(
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    )))
    .into();
    assert!(find_oom(&other).is_none());
}
