//! Needle-in-a-haystack prompts, phrased as RULER phrases them: a haystack of exactly
//! `input_len` prompt tokens (chat template included) with one or more "special magic"
//! needles at chosen depths, and a question about one of them.

use anyhow::{bail, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::model::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NeedleKind {
    /// "One of the special magic numbers for KEY is: 1234567."
    MagicNumber,
    /// "One of the special magic uuids for KEY is: 8c1e...."
    Uuid,
    /// Four magic-number needles with different keys; the question asks for one.
    MultiKey,
}

/// RULER's "noise" haystack, repeated as often as needed.
const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const ADJECTIVES: &[&str] = &[
    "ancient", "bright", "calm", "daring", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
    "vivid", "wild", "young", "zealous",
];
const NOUNS: &[&str] = &[
    "harbor", "meadow", "lantern", "glacier", "orchard", "falcon", "canyon", "violin", "compass",
    "ember", "thicket", "quarry", "beacon", "willow", "cobalt", "saddle", "pebble", "summit",
    "tundra", "walnut", "anchor", "basalt",
];
/// Needles in a multi-key case (one asked, the rest distractors).
const MULTI_KEYS: usize = 4;

/// One case: what to hide where.
#[derive(Debug, Clone)]
pub struct Case {
    pub input_len: usize,
    pub depth: f64,
    pub kind: NeedleKind,
    pub seed: u64,
}

/// A ready prompt and what its answer must contain.
#[derive(Debug, Clone)]
pub struct NeedlePrompt {
    pub ids: Vec<u32>,
    pub key: String,
    pub value: String,
    /// Token index where the asked needle starts.
    pub needle_at: usize,
    /// Token range of the haystack (filler and needles) within `ids`.
    pub haystack: std::ops::Range<usize>,
    /// Filler tokens before the asked needle, and in all: their ratio is the real depth.
    pub filler_before: usize,
    pub filler_total: usize,
}

fn random_key(rng: &mut StdRng) -> String {
    format!(
        "{}-{}",
        ADJECTIVES[rng.random_range(0..ADJECTIVES.len())],
        NOUNS[rng.random_range(0..NOUNS.len())]
    )
}

/// 16 bytes as a UUID's text (`8-4-4-4-12` lowercase hex).
pub fn uuid_text(b: [u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn random_value(rng: &mut StdRng, kind: NeedleKind) -> String {
    match kind {
        NeedleKind::Uuid => uuid_text(rng.random()),
        _ => rng.random_range(1_000_000..10_000_000u32).to_string(),
    }
}

impl Case {
    /// Builds the prompt: `[template start + instruction] [haystack with needles] [question +
    /// template end + answer prefix]`, exactly `input_len` tokens.
    pub fn build(&self, tok: &Tokenizer) -> Result<NeedlePrompt> {
        if !(0.0..=1.0).contains(&self.depth) {
            bail!("--depth values must be in [0, 1], got {}", self.depth);
        }
        let mut rng = StdRng::seed_from_u64(self.seed);
        let (noun, noun_one) = match self.kind {
            NeedleKind::Uuid => ("uuids", "uuid"),
            _ => ("numbers", "number"),
        };
        let count = if self.kind == NeedleKind::MultiKey {
            MULTI_KEYS
        } else {
            1
        };
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < count {
            let k = random_key(&mut rng);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let values: Vec<String> = (0..count)
            .map(|_| random_value(&mut rng, self.kind))
            .collect();
        let (key, value) = (keys[0].clone(), values[0].clone());

        let instruction = format!(
            "Some special magic {noun} are hidden within the following text. Make sure to memorize it. I will quiz you about the {noun} afterwards.\n"
        );
        let question = format!(
            "\nWhat is the special magic {noun_one} for {key} mentioned in the provided text?"
        );
        let answer_prefix =
            format!("The special magic {noun_one} for {key} mentioned in the provided text is");
        // The chat template around a placeholder user turn, split where the content goes.
        let (pre, post) = if tok.has_chat_template() {
            let rendered = tok.apply_chat_template("\u{1}")?;
            let (a, b) = rendered
                .split_once('\u{1}')
                .expect("placeholder survives the template");
            (a.to_string(), b.to_string())
        } else {
            (String::new(), "\n".to_string())
        };
        let head = tok.encode(&format!("{pre}{instruction}"), false)?;
        let tail = tok.encode(&format!("{question}{post}{answer_prefix}"), false)?;
        let needles: Vec<Vec<u32>> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| {
                tok.encode(
                    &format!(" One of the special magic {noun} for {k} is: {v}."),
                    false,
                )
            })
            .collect::<Result<_>>()?;
        let fixed = head.len() + tail.len() + needles.iter().map(Vec::len).sum::<usize>();
        if self.input_len < fixed + 16 {
            bail!("--input-len {} is too small: the instruction, question and needles alone take {fixed} tokens", self.input_len);
        }
        let n_filler = self.input_len - fixed;

        // Filler token stream: one unit " <FILLER>" cycled; needles go at sentence ends.
        let unit = tok.encode(&format!(" {FILLER}"), false)?;
        let filler: Vec<u32> = unit.iter().copied().cycle().take(n_filler).collect();
        let ends: Vec<usize> = (0..=n_filler)
            .filter(|&i| {
                i == 0
                    || i == n_filler
                    || tok
                        .decode(&[filler[i - 1]], false)
                        .is_ok_and(|t| t.ends_with('.'))
            })
            .collect();
        let snap = |pos: usize| {
            *ends
                .iter()
                .min_by_key(|&&e| e.abs_diff(pos))
                .expect("0 is a sentence end")
        };
        let mut spots: Vec<(usize, usize)> =
            vec![(snap((self.depth * n_filler as f64).round() as usize), 0)];
        for i in 1..count {
            spots.push((snap(rng.random_range(0..=n_filler)), i));
        }
        spots.sort();

        let start = head.len();
        let mut ids = head;
        let (mut needle_at, mut filler_before) = (0, 0);
        let mut from = 0;
        for (at, which) in spots {
            ids.extend_from_slice(&filler[from..at]);
            if which == 0 {
                needle_at = ids.len();
                filler_before = at;
            }
            ids.extend_from_slice(&needles[which]);
            from = at;
        }
        ids.extend_from_slice(&filler[from..]);
        let haystack = start..ids.len();
        ids.extend_from_slice(&tail);
        debug_assert_eq!(ids.len(), self.input_len);
        Ok(NeedlePrompt {
            ids,
            key,
            value,
            needle_at,
            haystack,
            filler_before,
            filler_total: n_filler,
        })
    }
}

/// The answer passes when the asked value appears in the generated text.
pub fn answer_found(text: &str, value: &str) -> bool {
    text.contains(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_have_the_promised_shapes() {
        let mut rng = StdRng::seed_from_u64(1);
        let n = random_value(&mut rng, NeedleKind::MagicNumber);
        assert_eq!(n.len(), 7);
        assert!(n.chars().all(|c| c.is_ascii_digit()));
        let u = random_value(&mut rng, NeedleKind::Uuid);
        assert_eq!(u.len(), 36);
        assert_eq!(u.matches('-').count(), 4);
        assert!(answer_found("The number is 1234567.", "1234567"));
        assert!(!answer_found("The number is 123456.", "1234567"));
    }
}
