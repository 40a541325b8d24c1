//! Log-probabilities as the API reports them: those of the distribution the sampler
//! draws from after temperature (`log softmax(logits / T)`; greedy counts as T = 1),
//! before any top-k / top-p cut — vLLM's default (`raw_logprobs`) at T = 1, and what
//! OpenAI documents. Computed in f64 from one row of logits and nothing else, so they are
//! as batch-invariant as the logits are.

/// One token's log-probability, with the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `top_n` most likely tokens with their log-probabilities, most likely first
    /// (equal logits: the lower id first). Empty when none were asked for.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under `log softmax(logits / temperature)` (T = 0, greedy,
/// is taken as 1), with the `top_n` most likely tokens.
pub fn token_logprob(logits: &[f32], token: u32, top_n: usize, temperature: f32) -> TokenLogprob {
    let d = Distribution::new(logits, temperature);
    let lp = |id: u32| d.log_prob(logits[id as usize]) as f32;
    TokenLogprob {
        token,
        logprob: lp(token),
        top: most_likely(logits, top_n)
            .into_iter()
            .map(|id| (id, lp(id)))
            .collect(),
    }
}

/// `log softmax(logits)[id]` in f64 (perplexity sums many of them).
pub fn log_prob(logits: &[f32], id: u32) -> f64 {
    Distribution::new(logits, 1.0).log_prob(logits[id as usize])
}

/// `log softmax(logits / T)`, by its largest logit and log-normalizer.
struct Distribution {
    max: f64,
    t: f64,
    log_z: f64,
}

impl Distribution {
    fn new(logits: &[f32], temperature: f32) -> Self {
        let t = if temperature > 0.0 {
            temperature as f64
        } else {
            1.0
        };
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        // The sampler's own scaling, `(x - max) / T`, so this is its distribution exactly.
        let log_z = logits
            .iter()
            .map(|&x| ((x as f64 - max) / t).exp())
            .sum::<f64>()
            .ln();
        Self { max, t, log_z }
    }

    /// The log-probability of a token whose logit is `x`.
    fn log_prob(&self, x: f32) -> f64 {
        (x as f64 - self.max) / self.t - self.log_z
    }
}

/// The ids of the `n` largest logits, largest first, the lower id first among equals.
fn most_likely(logits: &[f32], n: usize) -> Vec<u32> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, order);
        ids.truncate(n);
    }
    ids.sort_unstable_by(order);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    /// log softmax written out by hand for three logits (an independent formula).
    #[test]
    fn matches_log_softmax_at_the_temperature() {
        let logits = [1.0f32, 3.0, 2.0];
        for t in [0.0f32, 1.0, 0.5, 2.0] {
            let tt = if t == 0.0 { 1.0 } else { t as f64 };
            let z: f64 = logits.iter().map(|&x| (x as f64 / tt).exp()).sum();
            let want = |i: usize| ((logits[i] as f64 / tt).exp() / z).ln() as f32;
            let got = token_logprob(&logits, 0, 3, t);
            assert!((got.logprob - want(0)).abs() < 1e-6, "T={t}");
            let ids: Vec<u32> = got.top.iter().map(|&(id, _)| id).collect();
            assert_eq!(ids, [1, 2, 0]);
            for &(id, lp) in &got.top {
                assert!((lp - want(id as usize)).abs() < 1e-6, "T={t} id {id}");
            }
        }
    }

    #[test]
    fn top_n_is_cut_and_ties_go_to_the_lower_id() {
        let logits = [0.5f32, 2.0, 2.0, -1.0, 2.0];
        let got = token_logprob(&logits, 3, 2, 1.0);
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!(token_logprob(&logits, 3, 0, 1.0).top.is_empty());
        assert_eq!(token_logprob(&logits, 3, 99, 1.0).top.len(), 5);
    }

    #[test]
    fn probabilities_sum_to_one() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.13).collect();
        let all = token_logprob(&logits, 0, 1000, 0.7);
        let total: f64 = all.top.iter().map(|&(_, lp)| (lp as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
    }
}
