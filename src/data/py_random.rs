//! Python's `random.Random`, bit for bit: the MT19937 generator (Matsumoto & Nishimura 1998)
//! with CPython's seeding (`Modules/_randommodule.c` `random_seed`: the absolute value of an int
//! seed as 32-bit words, least significant first, through `init_by_array`) and the methods
//! EveryDream2's data code calls (`Lib/random.py`): `random`, `uniform`, `getrandbits`,
//! `_randbelow`, `shuffle` and `choice`.
//!
//! EveryDream2 draws its tag shuffles, its rated-image picking and its validation split from
//! `random.Random(seed)`; drawing them from the same generator here lets the tests compare with
//! EveryDream2's own functions run on the same seed, draw for draw.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// `random.Random(seed)` for a non-negative integer seed.
#[derive(Clone)]
pub struct PyRandom {
    mt: [u32; N],
    index: usize,
}

impl std::fmt::Debug for PyRandom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyRandom")
            .field("index", &self.index)
            .finish()
    }
}

impl PyRandom {
    /// `random.Random(seed)`.
    pub fn new(seed: u64) -> Self {
        let key: Vec<u32> = if seed >> 32 == 0 {
            vec![seed as u32]
        } else {
            vec![seed as u32, (seed >> 32) as u32]
        };
        let mut rng = Self {
            mt: [0; N],
            index: N,
        };
        rng.init_by_array(&key);
        rng
    }

    fn init_genrand(&mut self, s: u32) {
        self.mt[0] = s;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
        }
        self.mt[0] = 0x8000_0000;
    }

    fn twist(&mut self) {
        for k in 0..N {
            let y = (self.mt[k] & UPPER_MASK) | (self.mt[(k + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            self.mt[k] = self.mt[(k + M) % N] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }

    /// The next tempered 32-bit output (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.twist();
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `random()`: a 53-bit float in `[0, 1)`.
    pub fn random(&mut self) -> f64 {
        let a = self.next_u32() >> 5;
        let b = self.next_u32() >> 6;
        (f64::from(a) * 67_108_864.0 + f64::from(b)) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `uniform(a, b)`: `a + (b − a)·random()`.
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.random()
    }

    /// `getrandbits(k)` for `k ≤ 64`: whole words from the least significant up, the last one
    /// cut to its top bits.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        debug_assert!(k <= 64);
        let mut out = 0u64;
        let mut left = k;
        let mut shift = 0;
        while left > 0 {
            let mut word = self.next_u32();
            if left < 32 {
                word >>= 32 - left;
            }
            out |= u64::from(word) << shift;
            shift += 32;
            left = left.saturating_sub(32);
        }
        out
    }

    /// `_randbelow(n)`: uniform in `0..n` by rejection on `n.bit_length()` bits; 0 for `n == 0`.
    pub fn randbelow(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let k = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `shuffle(x)`: Fisher–Yates from the end.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            x.swap(i, j);
        }
    }

    /// `choice(seq)`: `None` for an empty slice (Python raises).
    pub fn choice<'a, T>(&mut self, seq: &'a [T]) -> Option<&'a T> {
        if seq.is_empty() {
            return None;
        }
        let i = self.randbelow(seq.len() as u64) as usize;
        seq.get(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference MT19937 `init_by_array({0x123, 0x234, 0x345, 0x456})` outputs (mt19937ar.c's
    /// published test vector starts 1067595299 955945823 477289528); a one-word key then checks
    /// our key split.
    #[test]
    fn matches_the_mt19937_reference_vector() {
        let mut rng = PyRandom {
            mt: [0; N],
            index: N,
        };
        rng.init_by_array(&[0x123, 0x234, 0x345, 0x456]);
        let got: Vec<u32> = (0..3).map(|_| rng.next_u32()).collect();
        assert_eq!(got, [1_067_595_299, 955_945_823, 477_289_528]);
    }

    #[test]
    fn shuffle_is_a_permutation_and_choice_of_empty_is_none() {
        let mut rng = PyRandom::new(7);
        let mut x: Vec<usize> = (0..50).collect();
        rng.shuffle(&mut x);
        let mut sorted = x.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert!(rng.choice::<u8>(&[]).is_none());
        assert_eq!(rng.randbelow(0), 0);
    }
}
