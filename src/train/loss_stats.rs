//! Loss bookkeeping for progress and the end-of-run summary: an exponential moving average for
//! the bar, and the mean loss of the first and last 20% of steps.

/// `ema ← β·ema + (1−β)·x`, bias-corrected like Adam's moments so early values are not pulled
/// toward zero.
#[derive(Debug, Clone)]
pub struct Smoothed {
    beta: f64,
    value: f64,
    count: i32,
}

impl Smoothed {
    pub fn new(beta: f64) -> Self {
        Self {
            beta,
            value: 0.0,
            count: 0,
        }
    }

    pub fn push(&mut self, x: f64) {
        self.value = self.beta * self.value + (1.0 - self.beta) * x;
        self.count += 1;
    }

    pub fn get(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else {
            self.value / (1.0 - self.beta.powi(self.count))
        }
    }
}

/// Mean of the first and last `fraction` of `losses` (at least one value each), or `None` when
/// there are fewer than two values.
pub fn first_last_means(losses: &[f64], fraction: f64) -> Option<(f64, f64)> {
    if losses.len() < 2 {
        return None;
    }
    let k = ((losses.len() as f64 * fraction).round() as usize).clamp(1, losses.len() / 2);
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    Some((mean(&losses[..k]), mean(&losses[losses.len() - k..])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothed_is_bias_corrected() {
        let mut s = Smoothed::new(0.9);
        s.push(2.0);
        assert!((s.get() - 2.0).abs() < 1e-12);
        s.push(2.0);
        assert!((s.get() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn first_last_twenty_percent() {
        let losses: Vec<f64> = (0..10).map(|i| i as f64).collect();
        assert_eq!(first_last_means(&losses, 0.2), Some((0.5, 8.5)));
        assert_eq!(first_last_means(&[1.0, 3.0], 0.2), Some((1.0, 3.0)));
        assert_eq!(first_last_means(&[1.0], 0.2), None);
    }
}
