//! Generalized offset noise: the noise offset of timestep `t` scaled by `ψ_t`, as OneTrainer's
//! `generalized_offset_noise` does it (`ModelSetupNoiseMixin.
//! _compute_and_cache_offset_noise_psi_schedule`, commit 23df3832; Kutsuna, "Generalized
//! Diffusion Model with Adjusted Offset Noise", arXiv 2412.03134, Algorithm 1 and Equation
//! (22)), in f64 from the schedule's `ᾱ`:
//!
//! with `α_t = ᾱ_t/ᾱ_{t−1}`, `ᾱ_{−1} = 1` and the sum `S_t = Σ_{i<t} γ_i/√ᾱ_{i−1}`:
//! `γ_0 = 1`, `γ_t = C_t·S_t` with `C_t = (1 − α_t)·√ᾱ_{t−1} / (α_t·(1 − ᾱ_{t−1}))`;
//! `ψ_T = S_{T}/√(1 − ᾱ_{T−1})` normalises `γ̂ = γ/ψ_T`, and
//! `ψ_t = (Σ_{i≤t} γ̂_i/√ᾱ_{i−1}) / √(1 − ᾱ_t)`, so that `ψ` reaches 1 at the last timestep.

/// `ψ_t` for every timestep of a schedule with these `ᾱ` (module docs). Not finite where the
/// schedule has an `α_t` of 0 (zero terminal SNR).
pub fn psi_schedule(alphas_cumprod: &[f64]) -> Vec<f64> {
    let n = alphas_cumprod.len();
    if n == 0 {
        return Vec::new();
    }
    let prev = |t: usize| if t == 0 { 1.0 } else { alphas_cumprod[t - 1] };
    let mut gammas = vec![0.0; n];
    gammas[0] = 1.0;
    let mut sum = gammas[0] / prev(0).sqrt();
    for t in 1..n {
        let alpha = alphas_cumprod[t] / prev(t);
        let c = (1.0 - alpha) * prev(t).sqrt() / (alpha * (1.0 - prev(t)));
        gammas[t] = c * sum;
        sum += gammas[t] / prev(t).sqrt();
    }
    let psi_last = sum / (1.0 - alphas_cumprod[n - 1]).sqrt();
    let mut cumulative = 0.0;
    (0..n)
        .map(|t| {
            cumulative += gammas[t] / psi_last / prev(t).sqrt();
            cumulative / (1.0 - alphas_cumprod[t]).sqrt()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ψ rises to 1 at the last timestep and starts small; a schedule whose last α is 0 (zero
    /// terminal SNR) gives a ψ that is not finite, which the objective refuses.
    #[test]
    fn psi_ends_at_one_and_rises() {
        let (a, b) = (0.00085f64.sqrt(), 0.012f64.sqrt());
        let mut acc = 1.0;
        let ac: Vec<f64> = (0..1000)
            .map(|i| {
                acc *= 1.0 - (a + (b - a) * i as f64 / 999.0).powi(2);
                acc
            })
            .collect();
        let psi = psi_schedule(&ac);
        assert!((psi[999] - 1.0).abs() < 1e-12, "{}", psi[999]);
        assert!(psi[0] < 1e-3 && psi.windows(2).all(|w| w[1] >= w[0]));
        let mut zero = ac.clone();
        zero[999] = 0.0;
        assert!(psi_schedule(&zero).iter().any(|p| !p.is_finite()));
    }
}
