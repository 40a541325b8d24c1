//! A structure-aware mutation fuzzer for strata's untrusted inputs, on stable Rust (the
//! `fuzz` binary drives it; `tests/fuzz_corpus.rs` replays its findings).
//!
//! Ten targets, each a function from a `Case` (a few named files) to a `Result`:
//! - `gguf`: a GGUF file through the reader, our config/tokenizer building from its
//!   metadata, the weight loader, then a chat-template rendering and a short generation;
//! - `gguf-meta`: a GGUF header alone, metadata bombs above all, through what is read
//!   before any tensor, within a memory budget a small multiple of the file (`gguf_meta`);
//! - `safetensors`: a Hugging Face directory (config.json, model.safetensors) the same way;
//! - `tokenizer`: tokenizer.json, tokenizer_config.json, generation_config.json and
//!   chat_template.jinja beside a fixed valid model;
//! - `template`: a chat template rendered through `render_template`;
//! - `http`: raw HTTP/1.1 requests against a live server in this process (`http`), the
//!   contract (an answer, OpenAI error objects, no 500, still healthy) checked after each;
//! - `http-pipelined`: several requests back to back on one connection, answers read or
//!   not (`http`): every answer whole and in order, a valid pipeline answered in full;
//! - `kv-events`: what a peer of the KV-event port sends, against a live ZMQ PUB socket
//!   (`kv_events`): the server's answer well-formed, the peer closed when it leaves, an
//!   honest subscriber served throughout;
//! - `disk`: the disk tier's index and slot file as a restart finds them (`disk`), the
//!   contract (reads return exactly what was written, nothing written through a link,
//!   no FIFO waited on) checked after each;
//! - `flags`: the `strata` and `needle` binaries run with flags at the edges of their
//!   ranges (`flags`), the CLI contract (exit 0/1/2, one error line, no signal, no hang,
//!   bounded memory) checked after each, also with environment variables (`RAYON_NUM_THREADS`,
//!   `STRATA_*`) set and with stdout a closed pipe or a full disk.
//!
//! Case `i` of a run is a pure function of (target, seed, i): a base input (tiny models
//! built here, `corpus`) changed by a stack of mutations (`mutate`) drawn from a generator
//! seeded by (seed, i). So a supervisor that only knows the index of a case that crashed
//! can rebuild its input and store it as a finding. A finding is any panic, an abort, a
//! case past the memory budget or past the time budget; an `Err` is the expected outcome
//! of a bad input, and `Ok` of a good one.

pub mod corpus;
pub mod disk;
pub mod flags;
pub mod gguf_meta;
pub mod gguf_writer;
pub mod http;
pub mod kv_events;
pub mod mutate;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rand::{rngs::StdRng, SeedableRng};

use crate::bounded::{self, Exceeded, Limits};
use crate::engine::{self, GenerateOptions, SamplingParams};
use crate::model::{tokenizer, Model, Tokenizer};

/// What one case may use before it counts as a finding.
pub const CASE_LIMITS: Limits = Limits {
    memory_bytes: 1 << 30,
    time: Duration::from_secs(10),
    stack_bytes: 8 << 20,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Gguf,
    Safetensors,
    Tokenizer,
    Template,
    Http,
    Disk,
    Flags,
    GgufMeta,
    HttpPipelined,
    KvEvents,
}

impl Target {
    pub const ALL: [Target; 10] = [
        Target::Gguf,
        Target::GgufMeta,
        Target::Safetensors,
        Target::Tokenizer,
        Target::Template,
        Target::Http,
        Target::HttpPipelined,
        Target::KvEvents,
        Target::Disk,
        Target::Flags,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Safetensors => "safetensors",
            Target::Tokenizer => "tokenizer",
            Target::Template => "template",
            Target::Http => "http",
            Target::Disk => "disk",
            Target::Flags => "flags",
            Target::GgufMeta => "gguf-meta",
            Target::HttpPipelined => "http-pipelined",
            Target::KvEvents => "kv-events",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// One input: named files (for `template`, one file holding the template).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Case {
    pub files: Vec<(String, Vec<u8>)>,
}

impl Case {
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    pub fn set(&mut self, name: &str, bytes: Vec<u8>) {
        match self.files.iter_mut().find(|(n, _)| n == name) {
            Some((_, b)) => *b = bytes,
            None => self.files.push((name.to_string(), bytes)),
        }
    }

    /// `name\n<len>\n<bytes>` per file: the format of the stored findings.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, bytes) in &self.files {
            out.extend_from_slice(format!("{name}\n{}\n", bytes.len()).as_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    pub fn from_bytes(mut data: &[u8]) -> Result<Self> {
        let mut files = Vec::new();
        let line = |data: &mut &[u8]| -> Result<String> {
            let end = data
                .iter()
                .position(|&b| b == b'\n')
                .context("truncated case file")?;
            let s = String::from_utf8(data[..end].to_vec()).context("case file header")?;
            *data = &data[end + 1..];
            Ok(s)
        };
        while !data.is_empty() {
            let name = line(&mut data)?;
            let len: usize = line(&mut data)?.parse().context("case file length")?;
            if len > data.len() {
                bail!("truncated case file");
            }
            files.push((name, data[..len].to_vec()));
            data = &data[len..];
        }
        Ok(Self { files })
    }

    /// A stable name for a finding: FNV-1a of the bytes, in hex.
    pub fn hash_name(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.to_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }
}

/// The base inputs of a target, built once.
pub fn base_corpus(target: Target) -> Vec<Case> {
    match target {
        Target::Gguf => corpus::gguf_cases(),
        Target::Safetensors => corpus::safetensors_cases(),
        Target::Tokenizer => corpus::tokenizer_cases(),
        Target::Template => corpus::template_cases(),
        Target::Http => http::http_cases(),
        Target::Disk => disk::disk_cases(),
        Target::Flags => flags::flags_cases(),
        Target::GgufMeta => gguf_meta::gguf_meta_cases(),
        Target::HttpPipelined => http::pipelined_cases(),
        Target::KvEvents => kv_events::kv_events_cases(),
    }
}

/// Case `index` of a run with `seed`: a base input with mutations stacked on it.
pub fn make_case(target: Target, base: &[Case], seed: u64, index: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(
        seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (target as u64) << 56,
    );
    let pick = &base[(index as usize) % base.len()];
    mutate::mutate(target, pick, base, &mut rng)
}

/// How a case ended, as a fuzzer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted, or refused with an error: both fine.
    Ok,
    Refused(String),
    Panicked(String),
    Exceeded(Exceeded),
}

impl Outcome {
    pub fn is_finding(&self) -> bool {
        matches!(self, Outcome::Panicked(_) | Outcome::Exceeded(_))
    }
}

static PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static LAST_PANIC: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Counts every panic of the process from now on and keeps the last one's message (then
/// calls the hook that was there). The servers under test run their code on threads of
/// their own, where a runtime catches a panic and it shows only as a closed connection:
/// the server targets compare the count before and after a case
/// (`assert_no_panic_since`).
pub fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Ok(mut last) = LAST_PANIC.try_lock() {
                *last = info.to_string();
            }
            previous(info);
        }));
    });
}

/// Panics counted since `count_panics`.
pub(crate) fn panics_seen() -> u64 {
    PANICS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Panics if a panic was counted since `before` (`panics_seen`): the server under test
/// caught one on a thread of its own.
pub(crate) fn assert_no_panic_since(before: u64) {
    assert!(
        panics_seen() == before,
        "a task of the server panicked: {}",
        LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner())
    );
}

/// Everything the peer sends until it closes (a reset counts as closed), or an error if it
/// is still open after `within`.
pub(crate) fn read_until_closed(
    s: &mut std::net::TcpStream,
    within: Duration,
) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    s.set_read_timeout(Some(within))?;
    let start = std::time::Instant::now();
    let mut out = Vec::new();
    let mut chunk = [0u8; 16 << 10];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(out),
            // A signal (a debugger attaching) interrupted the wait: not the server's doing.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if start.elapsed() > within {
            return Err(std::io::Error::other("still open"));
        }
    }
}

/// Runs one case under `CASE_LIMITS`, catching panics.
pub fn run_case_bounded(target: Target, case: &Case) -> Outcome {
    let case = case.clone();
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bounded::run(CASE_LIMITS, move || run_case(target, &case))
    }));
    match run {
        Ok(Ok(Ok(()))) => Outcome::Ok,
        Ok(Ok(Err(e))) => Outcome::Refused(format!("{e:#}")),
        Ok(Err(exceeded)) => Outcome::Exceeded(exceeded),
        Err(panic) => Outcome::Panicked(bounded::panic_message(&*panic)),
    }
}

/// Runs one case: load what the files describe and use it the way the CLI does.
pub fn run_case(target: Target, case: &Case) -> Result<()> {
    match target {
        Target::Http => http::run_http(case),
        Target::Disk => disk::run_disk(case),
        Target::Flags => flags::run_flags(case),
        Target::GgufMeta => gguf_meta::run_gguf_meta(case),
        Target::HttpPipelined => http::run_pipelined(case),
        Target::KvEvents => kv_events::run_kv_events(case),
        Target::Template => {
            let text = String::from_utf8_lossy(case.get("template").unwrap_or_default());
            tokenizer::render_template("fuzz case", &text, corpus::template_context())?;
            Ok(())
        }
        Target::Tokenizer => {
            let dir = ScratchDir::new()?;
            dir.write(case)?;
            let tok = Tokenizer::from_hf_dir(dir.path(), &[], corpus::TINY_VOCAB)?;
            let gen = dir.path().join("generation_config.json");
            if let Some(bytes) = case.get("generation_config.json") {
                let v: serde_json::Value = serde_json::from_slice(bytes).context("malformed")?;
                crate::model::config::GenerationDefaults::from_json(&v)
                    .with_context(|| gen.display().to_string())?;
            }
            exercise_tokenizer(&tok).map(drop)
        }
        Target::Gguf => {
            let dir = ScratchDir::new()?;
            dir.write(case)?;
            let (model, tok) = Model::load(&dir.path().join("model.gguf"), false)?;
            exercise_model(&model, &tok)
        }
        Target::Safetensors => {
            let dir = ScratchDir::new()?;
            dir.write(case)?;
            let (model, tok) = Model::load(dir.path(), false)?;
            exercise_model(&model, &tok)
        }
    }
}

pub(crate) fn exercise_tokenizer(tok: &Tokenizer) -> Result<Vec<u32>> {
    let ids = tok.encode("Hello, world! 12345 héllo 🦀", true)?;
    tok.decode(&ids, true)?;
    if tok.has_chat_template() {
        let text = tok.apply_chat_template("What is 2+2?")?;
        tok.encode(&text, false)?;
    }
    Ok(ids)
}

/// A two-token generation on whatever the loader accepted: an accepted model must run.
fn exercise_model(model: &Arc<Model>, tok: &Tokenizer) -> Result<()> {
    let mut ids = exercise_tokenizer(tok)?;
    ids.truncate(8);
    if ids.is_empty() {
        ids.push(0);
    }
    let opts = GenerateOptions {
        max_tokens: 2,
        sampling: SamplingParams::default(),
        stop_ids: model.cfg.eos_token_ids.clone(),
    };
    let max_len = model.cfg.max_position_embeddings.min(ids.len() + 2);
    if ids.len() >= max_len {
        bail!("prompt longer than the model's context");
    }
    engine::generate(model, &ids, &opts, max_len, &mut |_| Ok(()))?;
    Ok(())
}

/// A directory of its own for one case's files, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> Result<Self> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "strata-fuzz-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, case: &Case) -> Result<()> {
        for (name, bytes) in &case.files {
            // Names come from stored cases: plain file names only.
            if name.contains('/') || name.starts_with('.') {
                bail!("bad file name in case: {name:?}");
            }
            std::fs::write(self.0.join(name), bytes)?;
        }
        Ok(())
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_round_trip_through_their_file_format() {
        let c = Case {
            files: vec![
                ("a.json".into(), b"{\n}".to_vec()),
                ("b".into(), vec![0, 10, 255]),
            ],
        };
        assert_eq!(Case::from_bytes(&c.to_bytes()).unwrap(), c);
        assert!(Case::from_bytes(b"a\n99\nshort").is_err());
    }

    #[test]
    fn every_base_input_is_accepted() {
        // The corpus must be valid, or mutations start from an input refused at once.
        // (`flags` runs the binaries, which a unit test run may not have built:
        // tests/fuzz_corpus.rs checks its base command lines.)
        for target in Target::ALL.into_iter().filter(|&t| t != Target::Flags) {
            for (i, case) in base_corpus(target).iter().enumerate() {
                let out = run_case_bounded(target, case);
                assert_eq!(out, Outcome::Ok, "{} base case {i}", target.name());
            }
        }
    }

    #[test]
    fn cases_are_reproducible_from_seed_and_index() {
        for target in Target::ALL {
            let base = base_corpus(target);
            assert_eq!(
                make_case(target, &base, 7, 123),
                make_case(target, &base, 7, 123)
            );
        }
    }
}
