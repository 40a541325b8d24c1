//! Token sampling: greedy, temperature, top-k, top-p; seedable.

use rand::{rngs::StdRng, Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplingParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
    /// 1.0 = no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            anyhow::bail!(
                "--temperature must be a finite number >= 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            anyhow::bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest logit; the lowest index wins ties (as torch.argmax does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    /// The temperature it samples at (0: greedy).
    pub fn temperature(&self) -> f32 {
        self.params.temperature
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let (idx, probs) = self.candidates(logits);
        self.walk(&idx, &probs)
    }

    /// The distribution `sample` draws from, as (token, probability) pairs summing to 1,
    /// most likely first (greedy: the argmax alone): what speculative sampling compares.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        if self.params.temperature == 0.0 {
            return vec![(argmax(logits), 1.0)];
        }
        let (idx, probs) = self.candidates(logits);
        let total: f32 = probs.iter().sum();
        idx.into_iter()
            .zip(probs.iter().map(|p| p / total))
            .collect()
    }

    /// One token drawn from `dist` (weights need not sum to 1; none may be negative).
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        let (idx, probs): (Vec<u32>, Vec<f32>) = dist.iter().copied().unzip();
        self.walk(&idx, &probs)
    }

    /// A uniform number in [0, 1) from the sampler's stream.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Candidates sorted by logit, cut to top-k, their probabilities at the temperature,
    /// cut to the nucleus (those kept are not renormalized: `walk` scales by their sum).
    fn candidates(&self, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let p = &self.params;
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = if p.top_k == 0 {
            logits.len()
        } else {
            p.top_k.min(logits.len())
        };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // Nucleus: keep the smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, &x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
        }
        (idx, probs)
    }

    /// Draws `idx[i]` with probability `probs[i] / sum(probs)`: one uniform number.
    fn walk(&mut self, idx: &[u32], probs: &[f32]) -> u32 {
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &x) in probs.iter().enumerate() {
            if r < x {
                return idx[i];
            }
            r -= x;
        }
        *idx.last().expect("at least one candidate")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.0, 3.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 1,
        });
        assert_eq!(s.sample(&logits), argmax(&logits));
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 42,
        };
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
        let xs: Vec<u32> = (0..50).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..50).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        assert!(
            xs.iter().any(|&x| x != xs[0]),
            "temperature sampling never varied"
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~0.97 of the mass: top_p 0.5 must always pick it.
        let mut logits = vec![0.0f32; 10];
        logits[4] = 6.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 9,
        });
        assert!((0..200).all(|_| s.sample(&logits) == 4));
    }
}
