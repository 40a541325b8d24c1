//! RULER's needle-in-a-haystack retrieval tasks (NVIDIA/RULER, `scripts/data/synthetic/
//! niah.py` and `synthetic.yaml`), generated offline with our own seeds: the evaluation of
//! sparse decode that its selection was never tuned on (docs/offload.md, "Sparse decode").
//!
//! Followed from RULER: the eight `niah_*` tasks (haystack noise / essay / needles; keys
//! words or UUIDs; values numbers, words or UUIDs; `k` keys, `v` values per key, `q` keys
//! asked), the needle sentence, the template and answer prefix (with RULER's singular
//! rewrite when one value is asked), needle depths drawn without replacement from RULER's
//! 40 depths, 7-digit numbers, UUIDs v4, the haystack sized by binary search so that the
//! prompt plus the tokens to generate fit the context in the model's own tokens, and the
//! score: the fraction of expected values present in the output, case-insensitively
//! (`string_match_all`).
//!
//! Ours instead, and why: the essay haystack is a deterministic essay-like generator
//! (`essay`), not Paul Graham's essays (CI has no network); keys are adjective-noun pairs
//! from small built-in lists (wonderwords' lists are not vendored), all distinct within a
//! case (a distractor never shares the asked key); the noise and needle haystacks place
//! needles at RULER's depths too (RULER draws a random sentence index: the same
//! distribution, but a depth we can report and test); the singular rewrite applies to the
//! task's text only, not the model's chat template (RULER's `str.replace('are', 'is')`
//! would also rewrite SmolLM2's system prompt); tokens to generate are sized to the
//! answers (`Task::tokens_to_generate`) instead of RULER's 128, to keep CPU runs short.
//!
//! Seeds: a case's seed is a hash of its task, context and index, with the top bit set
//! for the held-out set (`SeedSet`), so the tuning and held-out cases are disjoint by
//! construction.

use std::ops::Range;

use anyhow::{bail, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::model::Tokenizer;

/// RULER's "noise" haystack sentence.
pub const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

/// RULER's needle sentence (`{v}`: the plural value type, as RULER writes it always).
fn needle_text(v: Kind, key: &str, value: &str) -> String {
    format!(
        "One of the special magic {} for {key} is: {value}.",
        v.plural()
    )
}

/// RULER's insertion depths: `round(linspace(0, 100, 40))`, in percent.
pub fn depths() -> Vec<u32> {
    (0..40)
        .map(|i| (i as f64 * 100.0 / 39.0).round() as u32)
        .collect()
}

/// What a key or value is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An adjective-noun pair, e.g. "ancient-harbor".
    Words,
    /// A 7-digit number.
    Numbers,
    /// A UUID v4.
    Uuids,
}

impl Kind {
    fn plural(self) -> &'static str {
        match self {
            Kind::Words => "words",
            Kind::Numbers => "numbers",
            Kind::Uuids => "uuids",
        }
    }

    fn random(self, rng: &mut StdRng) -> String {
        match self {
            Kind::Words => format!(
                "{}-{}",
                KEY_ADJECTIVES[rng.random_range(0..KEY_ADJECTIVES.len())],
                KEY_NOUNS[rng.random_range(0..KEY_NOUNS.len())]
            ),
            Kind::Numbers => rng.random_range(1_000_000..=9_999_999u32).to_string(),
            Kind::Uuids => {
                // uuid.UUID(int=getrandbits(128), version=4): version and variant bits set.
                let mut b: [u8; 16] = rng.random();
                b[6] = (b[6] & 0x0f) | 0x40;
                b[8] = (b[8] & 0x3f) | 0x80;
                crate::needle::uuid_text(b)
            }
        }
    }
}

/// The haystack around the needles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Haystack {
    /// `NOISE` repeated, one per line.
    Noise,
    /// Essay-like prose (`essay`), sentences joined by spaces.
    Essay,
    /// Distractor needles with random keys and values, one per line.
    Needles,
}

/// RULER's retrieval tasks (`synthetic.yaml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Task {
    #[value(name = "niah_single_1")]
    Single1,
    #[value(name = "niah_single_2")]
    Single2,
    #[value(name = "niah_single_3")]
    Single3,
    #[value(name = "niah_multikey_1")]
    MultiKey1,
    #[value(name = "niah_multikey_2")]
    MultiKey2,
    #[value(name = "niah_multikey_3")]
    MultiKey3,
    #[value(name = "niah_multivalue")]
    MultiValue,
    #[value(name = "niah_multiquery")]
    MultiQuery,
}

/// One task's settings, as `synthetic.yaml` writes them.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub haystack: Haystack,
    pub key: Kind,
    pub value: Kind,
    /// Keys hidden (`num_needle_k`, at least `queries`).
    pub keys: usize,
    /// Values per key (`num_needle_v`).
    pub values: usize,
    /// Keys asked (`num_needle_q`).
    pub queries: usize,
}

impl Task {
    pub const ALL: [Task; 8] = [
        Task::Single1,
        Task::Single2,
        Task::Single3,
        Task::MultiKey1,
        Task::MultiKey2,
        Task::MultiKey3,
        Task::MultiValue,
        Task::MultiQuery,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Task::Single1 => "niah_single_1",
            Task::Single2 => "niah_single_2",
            Task::Single3 => "niah_single_3",
            Task::MultiKey1 => "niah_multikey_1",
            Task::MultiKey2 => "niah_multikey_2",
            Task::MultiKey3 => "niah_multikey_3",
            Task::MultiValue => "niah_multivalue",
            Task::MultiQuery => "niah_multiquery",
        }
    }

    pub fn spec(self) -> Spec {
        use Haystack::*;
        use Kind::*;
        let s = |haystack, key, value, keys, values, queries| Spec {
            haystack,
            key,
            value,
            keys,
            values,
            queries,
        };
        match self {
            Task::Single1 => s(Noise, Words, Numbers, 1, 1, 1),
            Task::Single2 => s(Essay, Words, Numbers, 1, 1, 1),
            Task::Single3 => s(Essay, Words, Uuids, 1, 1, 1),
            Task::MultiKey1 => s(Essay, Words, Numbers, 4, 1, 1),
            Task::MultiKey2 => s(Needles, Words, Numbers, 1, 1, 1),
            Task::MultiKey3 => s(Needles, Uuids, Uuids, 1, 1, 1),
            Task::MultiValue => s(Essay, Words, Numbers, 1, 4, 1),
            Task::MultiQuery => s(Essay, Words, Numbers, 4, 1, 4),
        }
    }

    /// New tokens allowed for the answer, counted inside the context as RULER counts its
    /// `tokens_to_generate`: the answer prefix restated costs ~15 tokens, a 7-digit number
    /// 8 (SmolLM2 splits digits), a UUID ~25.
    pub fn tokens_to_generate(self) -> usize {
        let s = self.spec();
        match (s.value, s.values * s.queries) {
            (Kind::Uuids, _) => 64,
            (_, 1) => 32,
            _ => 80,
        }
    }
}

/// Which seeds a case draws: the tuning set (look at it while choosing a method) or the
/// held-out set (run once, with the final method).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SeedSet {
    Tune,
    Heldout,
}

/// FNV-1a, 64-bit: a stable hash (std's `DefaultHasher` may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// One generated case: a task at a context size, the `index`-th of its seed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RulerCase {
    pub task: Task,
    /// Prompt plus tokens to generate, in the model's tokens (RULER's `max_seq_length`).
    pub context: usize,
    pub index: usize,
    pub set: SeedSet,
}

/// A ready prompt and what its answer must contain.
#[derive(Debug, Clone)]
pub struct RulerPrompt {
    pub ids: Vec<u32>,
    /// The expected values (every one must appear for a full score).
    pub answers: Vec<String>,
    /// The keys asked.
    pub queries: Vec<String>,
    /// Every inserted needle (asked or not): its first token and its depth in percent.
    pub needles: Vec<NeedleAt>,
    /// Token range of the context (haystack and needles) within `ids`.
    pub haystack: Range<usize>,
    /// New tokens the context leaves for the answer (`Task::tokens_to_generate`).
    pub max_new_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NeedleAt {
    /// Its first token (the separator before it, "\n" or " One", included).
    pub token: usize,
    /// Its length in tokens.
    pub tokens: usize,
    pub depth: u32,
    /// Whether its key is asked.
    pub asked: bool,
}

/// A case's text before tokenization: the template's start, the context as pieces (each
/// unit of haystack and each needle, with the separator before it), the template's end.
/// Every piece after the first starts with its separator (" " or "\n"), where the
/// byte-level pre-tokenizer splits anyway, so tokenizing piece by piece gives the same
/// tokens as tokenizing the whole text, and each needle's first token is known exactly.
struct Text {
    pre: String,
    pieces: Vec<(String, Option<(u32, bool)>)>, // text, and for a needle: depth, asked
    post: String,
}

/// Keys in the order drawn, their values, and which keys are asked (indices, in asking
/// order).
struct Draw {
    keys: Vec<String>,
    values: Vec<Vec<String>>,
    asked: Vec<usize>,
}

impl RulerCase {
    /// The case's seed: a hash of task, context and index, the top bit naming the set.
    pub fn seed(&self) -> u64 {
        let h = fnv1a(format!("{}/{}/{}", self.task.name(), self.context, self.index).as_bytes());
        match self.set {
            SeedSet::Tune => h >> 1,
            SeedSet::Heldout => h >> 1 | 1 << 63,
        }
    }

    /// Builds the prompt: the largest haystack (binary search over its units: words of
    /// the essay, lines of the others) whose prompt plus the task's tokens to generate fit
    /// `context` tokens, chat template included.
    pub fn build(&self, tok: &Tokenizer) -> Result<RulerPrompt> {
        let gen = self.task.tokens_to_generate();
        let room = self.context.saturating_sub(gen);
        let chat = chat_parts(tok)?;
        let len = |units| -> Result<usize> { Ok(encode(tok, &self.text(&chat, units))?.ids.len()) };
        let (mut lo, mut hi) = (1usize, 2usize);
        if len(lo)? > room {
            bail!(
                "--context {} is too small for {}: its instruction, question, needles and {gen} answer tokens do not fit",
                self.context,
                self.task.name()
            );
        }
        while len(hi)? <= room {
            (lo, hi) = (hi, hi * 2);
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if len(mid)? <= room {
                lo = mid
            } else {
                hi = mid
            }
        }
        let mut p = encode(tok, &self.text(&chat, lo))?;
        let d = self.draw();
        p.queries = d.asked.iter().map(|&i| d.keys[i].clone()).collect();
        p.answers = d.asked.iter().flat_map(|&i| d.values[i].clone()).collect();
        p.max_new_tokens = gen;
        Ok(p)
    }

    /// Keys, values and the asked keys, drawn first from the case's RNG, so they do not
    /// depend on the haystack's size; keys distinct, values distinct.
    fn draw(&self) -> Draw {
        let s = self.task.spec();
        let mut rng = StdRng::seed_from_u64(self.seed());
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < s.keys {
            let k = s.key.random(&mut rng);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let mut seen: Vec<String> = Vec::new();
        let mut values = Vec::new();
        for _ in 0..s.keys {
            let mut vs = Vec::new();
            while vs.len() < s.values {
                let v = s.value.random(&mut rng);
                if !seen.contains(&v) {
                    seen.push(v.clone());
                    vs.push(v);
                }
            }
            values.push(vs);
        }
        // The asked keys: a sample without replacement (RULER's random.sample).
        let mut order: Vec<usize> = (0..s.keys).collect();
        for i in 0..s.queries {
            let j = rng.random_range(i..s.keys);
            order.swap(i, j);
        }
        order.truncate(s.queries);
        Draw {
            keys,
            values,
            asked: order,
        }
    }

    /// The case's text with a haystack of `units` units.
    fn text(&self, chat: &(String, String), units: usize) -> Text {
        let s = self.task.spec();
        let d = self.draw();
        // Every key's needles, shuffled (as RULER shuffles them), at depths drawn without
        // replacement from RULER's 40, ascending: the i-th needle at the i-th depth.
        let mut rng = StdRng::seed_from_u64(self.seed() ^ 0x6e65_6564_6c65_7321);
        let mut needles: Vec<(String, bool)> = Vec::new();
        for (i, key) in d.keys.iter().enumerate() {
            for v in &d.values[i] {
                needles.push((needle_text(s.value, key, v), d.asked.contains(&i)));
            }
        }
        for i in (1..needles.len()).rev() {
            needles.swap(i, rng.random_range(0..=i));
        }
        let mut pool = depths();
        let mut depth: Vec<u32> = (0..needles.len())
            .map(|_| pool.swap_remove(rng.random_range(0..pool.len())))
            .collect();
        depth.sort_unstable();

        // Haystack units: sentences (the essay's words are cut to `units`, as RULER cuts
        // its essay, then split into sentences), or lines.
        let mut filler = StdRng::seed_from_u64(self.seed() ^ 0x6861_7973_7461_636b);
        let (units, sep): (Vec<String>, &str) = match s.haystack {
            Haystack::Noise => (vec![NOISE.to_string(); units], "\n"),
            Haystack::Essay => (essay::sentences(&mut filler, units), " "),
            Haystack::Needles => {
                let mut lines = Vec::with_capacity(units);
                while lines.len() < units {
                    let k = s.key.random(&mut filler);
                    if d.keys.contains(&k) {
                        continue; // a distractor never shares a real key
                    }
                    let v = s.value.random(&mut filler);
                    lines.push(needle_text(s.value, &k, &v));
                }
                (lines, "\n")
            }
        };
        let n = units.len();
        let mut pieces: Vec<(String, Option<(u32, bool)>)> = Vec::new();
        let mut push = |text: &str, needle| {
            let sep = if pieces.is_empty() { "" } else { sep };
            pieces.push((format!("{sep}{text}"), needle));
        };
        let mut from = 0;
        for ((needle, asked), &dp) in needles.iter().zip(&depth) {
            // RULER: int(len(sentences) * depth / 100) sentences before it.
            let to = (n * dp as usize / 100).max(from);
            for u in &units[from..to] {
                push(u, None);
            }
            push(needle, Some((dp, *asked)));
            from = to;
        }
        for u in &units[from..] {
            push(u, None);
        }

        // RULER's template; its singular rewrite when one value is asked.
        let one = s.values * s.queries == 1;
        let plural = s.value.plural();
        let v = if one {
            &plural[..plural.len() - 1]
        } else {
            plural
        };
        let asked: Vec<&str> = d.asked.iter().map(|&i| d.keys[i].as_str()).collect();
        let query = match asked.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, init)) => format!("{}, and {last}", init.join(", ")),
            None => String::new(), // every task asks at least one key
        };
        let (some, are, are_all) = if one {
            ("A", "is", "is")
        } else {
            ("Some", "are", "are all")
        };
        let instruction = format!(
            "{some} special magic {v} {are} hidden within the following text. Make sure to memorize it. I will quiz you about the {v} afterwards.\n"
        );
        let question = format!(
            "\nWhat {are_all} the special magic {v} for {query} mentioned in the provided text?"
        );
        let answer_prefix =
            format!(" The special magic {v} for {query} mentioned in the provided text {are}");
        Text {
            pre: format!("{}{instruction}", chat.0),
            pieces,
            post: format!("{question}{}{answer_prefix}", chat.1),
        }
    }
}

/// The chat template around a user turn, split where the content goes (RULER's model
/// template); none: the text alone, then a newline.
fn chat_parts(tok: &Tokenizer) -> Result<(String, String)> {
    if !tok.has_chat_template() {
        return Ok((String::new(), "\n".to_string()));
    }
    let rendered = tok.apply_chat_template("\u{1}")?;
    match rendered.split_once('\u{1}') {
        Some((a, b)) => Ok((a.to_string(), b.to_string())),
        None => bail!("the chat template drops the user's message"),
    }
}

/// Tokenizes a case's text piece by piece (`Text`): the ids, the context's range and
/// each needle's first token.
fn encode(tok: &Tokenizer, t: &Text) -> Result<RulerPrompt> {
    let mut ids = tok.encode(&t.pre, false)?;
    let start = ids.len();
    let mut needles = Vec::new();
    for (text, needle) in &t.pieces {
        let piece = tok.encode(text, false)?;
        if let Some((depth, asked)) = *needle {
            needles.push(NeedleAt {
                token: ids.len(),
                tokens: piece.len(),
                depth,
                asked,
            });
        }
        ids.extend(piece);
    }
    let haystack = start..ids.len();
    ids.extend(tok.encode(&t.post, false)?);
    Ok(RulerPrompt {
        ids,
        answers: Vec::new(),
        queries: Vec::new(),
        needles,
        haystack,
        max_new_tokens: 0,
    })
}

/// RULER's `string_match_all` for one output: the fraction of `answers` found in
/// `output`, case-insensitively.
pub fn score(output: &str, answers: &[String]) -> f64 {
    score_found(&found(output, answers))
}

/// `score` from `found`'s answer: the fraction of values found (0 when none are expected).
pub fn score_found(found: &[bool]) -> f64 {
    if found.is_empty() {
        return 0.0;
    }
    found.iter().filter(|&&f| f).count() as f64 / found.len() as f64
}

/// Which of `answers` appear in `output`, case-insensitively (`score`'s test, per value).
pub fn found(output: &str, answers: &[String]) -> Vec<bool> {
    let out = output.to_lowercase();
    answers
        .iter()
        .map(|a| out.contains(&a.to_lowercase()))
        .collect()
}

/// Key words: adjectives and nouns (keys are "adjective-noun").
const KEY_ADJECTIVES: &[&str] = &[
    "ancient", "bright", "calm", "daring", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
    "vivid", "wild", "young", "zealous", "amber", "brave", "crisp", "dusty", "elegant", "fierce",
    "golden", "humble", "ivory", "jagged", "kind", "lucky", "misty", "narrow", "obscure", "pale",
    "rusty", "scarlet", "tender", "urban", "velvet", "wary", "windy", "bitter", "clever", "dark",
];
const KEY_NOUNS: &[&str] = &[
    "harbor", "meadow", "lantern", "glacier", "orchard", "falcon", "canyon", "violin", "compass",
    "ember", "thicket", "quarry", "beacon", "willow", "cobalt", "saddle", "pebble", "summit",
    "tundra", "walnut", "anchor", "basalt", "badger", "cabinet", "dolphin", "engine", "feather",
    "garden", "hammer", "island", "jacket", "kettle", "ladder", "mirror", "needle", "oyster",
    "parrot", "quilt", "rocket", "sparrow", "tractor", "umbrella", "valley", "wagon", "yacht",
    "zipper", "bridge", "castle", "desert", "forest",
];

/// A deterministic essay-like prose generator (RULER uses Paul Graham's essays; we have no
/// network in CI): sentences from a few clause patterns over small word lists, with no
/// digits and no "special magic", so nothing in it looks like an answer.
pub mod essay {
    use rand::{rngs::StdRng, Rng};

    const SUBJECTS: &[&str] = &[
        "most founders",
        "a good programmer",
        "the best investors",
        "people who start companies",
        "a small team",
        "the average employee",
        "young writers",
        "many students",
        "a new startup",
        "large companies",
        "good designers",
        "the people I know",
        "some users",
        "a careful reader",
    ];
    const VERBS: &[&str] = &[
        "underestimate",
        "learn",
        "ignore",
        "discover",
        "build",
        "remember",
        "avoid",
        "notice",
        "question",
        "explain",
        "choose",
        "imagine",
        "change",
        "measure",
        "trust",
        "improve",
    ];
    const OBJECTS: &[&str] = &[
        "the problems they care about",
        "how hard it is to make something new",
        "the value of working on their own ideas",
        "what users actually want",
        "the difference between a job and a project",
        "the cost of doing things slowly",
        "the habits that made them productive",
        "ideas that seem obvious afterwards",
        "the way a city shapes its people",
        "what it takes to write clearly",
        "the risk of copying what everyone else does",
        "the questions nobody asks",
        "the pleasure of solving a hard problem",
        "the reasons behind old rules",
    ];
    const CONNECTIVES: &[&str] = &[
        "because",
        "although",
        "even when",
        "until",
        "as soon as",
        "unless",
        "whenever",
    ];
    const OPENERS: &[&str] = &[
        "In practice,",
        "Surprisingly,",
        "For a long time,",
        "Sooner or later,",
        "In my experience,",
        "Oddly enough,",
        "At first,",
        "Over time,",
        "Usually,",
    ];
    const ENDINGS: &[&str] = &[
        "and that is rarely a mistake",
        "which is harder than it sounds",
        "and the effect compounds",
        "which few of them expect",
        "and nobody tells them so",
        "which changes everything else",
        "and it shows in their work",
    ];

    fn pick<'a>(rng: &mut StdRng, xs: &[&'a str]) -> &'a str {
        xs[rng.random_range(0..xs.len())]
    }

    fn capitalized(s: &str) -> String {
        let mut c = s.chars();
        match c.next() {
            Some(f) => f.to_uppercase().chain(c).collect(),
            None => String::new(),
        }
    }

    /// One sentence, capitalized, ending in a period.
    pub fn sentence(rng: &mut StdRng) -> String {
        let s = match rng.random_range(0..4) {
            0 => format!(
                "{} {} {}",
                pick(rng, SUBJECTS),
                pick(rng, VERBS),
                pick(rng, OBJECTS)
            ),
            1 => format!(
                "{} {} {} {}",
                pick(rng, OPENERS),
                pick(rng, SUBJECTS),
                pick(rng, VERBS),
                pick(rng, OBJECTS)
            ),
            2 => format!(
                "{} {} {}, {} {} {} {}",
                pick(rng, SUBJECTS),
                pick(rng, VERBS),
                pick(rng, OBJECTS),
                pick(rng, CONNECTIVES),
                pick(rng, SUBJECTS),
                pick(rng, VERBS),
                pick(rng, OBJECTS)
            ),
            _ => format!(
                "{} {} {}, {}",
                pick(rng, SUBJECTS),
                pick(rng, VERBS),
                pick(rng, OBJECTS),
                pick(rng, ENDINGS)
            ),
        };
        format!("{}.", capitalized(&s))
    }

    /// The essay's first `words` words, split into sentences (the last one cut short, as
    /// RULER cuts its essay at a word count before splitting it into sentences).
    pub fn sentences(rng: &mut StdRng, words: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut left = words;
        while left > 0 {
            let s = sentence(rng);
            let n = s.split(' ').count();
            if n <= left {
                left -= n;
                out.push(s);
            } else {
                out.push(s.split(' ').take(left).collect::<Vec<_>>().join(" "));
                left = 0;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_deterministic_and_the_sets_disjoint() {
        let case = |task, context, index, set| RulerCase {
            task,
            context,
            index,
            set,
        };
        let mut tune = std::collections::HashSet::new();
        let mut held = std::collections::HashSet::new();
        for t in Task::ALL {
            for c in [1024, 2048, 4096, 8192] {
                for i in 0..50 {
                    let a = case(t, c, i, SeedSet::Tune);
                    assert_eq!(a.seed(), a.seed());
                    assert!(tune.insert(a.seed()), "{a:?} repeats a tuning seed");
                    assert!(held.insert(case(t, c, i, SeedSet::Heldout).seed()));
                }
            }
        }
        assert!(tune.is_disjoint(&held));
        // Stable across builds: FNV-1a of a fixed string.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn depths_are_rulers_forty() {
        let d = depths();
        assert_eq!(d.len(), 40);
        assert_eq!((d[0], d[1], d[20], d[39]), (0, 3, 51, 100));
    }

    #[test]
    fn score_is_the_fraction_of_values_found_ignoring_case() {
        let a = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(score("It is 1234567.", &a(&["1234567"])), 1.0);
        assert_eq!(score("It is 1234568.", &a(&["1234567"])), 0.0);
        assert_eq!(
            score(
                "1234567 and 7654321",
                &a(&["1234567", "7654321", "1111111"])
            ),
            2.0 / 3.0
        );
        assert_eq!(score("AB-CD", &a(&["ab-cd"])), 1.0);
        assert_eq!(score("anything", &[]), 0.0);
    }

    #[test]
    fn values_have_rulers_shapes() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..100 {
            let n = Kind::Numbers.random(&mut rng);
            assert!(n.len() == 7 && n.bytes().all(|b| b.is_ascii_digit()) && !n.starts_with('0'));
            let u = Kind::Uuids.random(&mut rng);
            assert_eq!(u.len(), 36);
            assert_eq!(&u[14..15], "4", "{u}: version 4");
            assert!("89ab".contains(&u[19..20]), "{u}: variant");
            let w = Kind::Words.random(&mut rng);
            assert_eq!(w.matches('-').count(), 1);
        }
    }

    #[test]
    fn essays_are_deterministic_digit_free_and_cut_at_the_word_count() {
        let a = essay::sentences(&mut StdRng::seed_from_u64(1), 500);
        let b = essay::sentences(&mut StdRng::seed_from_u64(1), 500);
        assert_eq!(a, b);
        let words: usize = a.iter().map(|s| s.split(' ').count()).sum();
        assert_eq!(words, 500);
        let text = a.join(" ");
        assert!(!text.bytes().any(|b| b.is_ascii_digit()));
        assert!(!text.contains("magic"));
        assert_ne!(a, essay::sentences(&mut StdRng::seed_from_u64(2), 500));
    }
}
