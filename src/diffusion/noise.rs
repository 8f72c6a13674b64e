//! Standard normal noise drawn on the host from a seeded generator, so a run (and a sample)
//! repeats exactly: candle's CPU `randn` cannot be seeded, and a device generator would make the
//! draws depend on the device. One f32 per element, `rand_distr::StandardNormal`.

use candle_core::Tensor;
use rand::Rng;
use rand_distr::StandardNormal;

/// Standard normal noise of shape `dims` drawn on the host from `rng`, as f32 on `device`.
pub fn host_randn<R: Rng>(
    rng: &mut R,
    dims: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.sample(StandardNormal)).collect();
    Tensor::from_vec(data, dims, device)
}
