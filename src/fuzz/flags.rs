//! The `flags` target: the real `strata` and `needle` binaries, run as a user runs them,
//! with command lines whose flags sit at and just past the edges of their documented
//! ranges (every bound in `crate::flags`, ±1), at the extremes of the integer and float
//! types, or written oddly (`+1`, `0x10`, `1e3`, `NaN`, a 4,000-digit number, lists and
//! `A:B` pairs of those).
//!
//! A case is one command line (`argv`: NUL-separated, the binary's name first; `{model}`
//! stands for the fuzzer's tiny GGUF model, `{dir}` for the case's own scratch directory),
//! with environment variables strata reads (`env`: NUL-separated `NAME=value`) and where
//! stdout goes (`stdout`: `closed`, a pipe nobody reads, or `full`, `/dev/full`; a pipe
//! the fuzzer reads when absent).
//! The base command lines are cheap runs of every subcommand on the tiny model; the flags
//! a mutation may set are read from the binary's own `--help`, so a new flag is fuzzed
//! the day it is added. Contract checked after each run (a breach is a panic, which the
//! fuzzer records as a finding):
//! - the process ends by itself with status 0, 1 or 2 (no signal, no other status);
//! - a failure (1 or 2) prints exactly one line on stderr, `error: …`: every flag is
//!   checked before anything is printed, so nothing precedes the error (`needle`'s
//!   verdict that a case failed, 1 with its table on stdout and no error line, aside);
//!   with stdout closed or full, a run ends quietly with 0 (as `head` expects) or with
//!   one `error:` line, the last on stderr, after whatever it printed before writing;
//! - nothing prints a panic;
//! - peak memory stays under `MAX_RSS_BYTES`;
//! - `strata serve`, once it says it is listening, stops with status 0 on SIGTERM;
//! - a run still going after `RUN_LIMIT` is an accepted command doing what it was asked
//!   (a million decode steps, say) if it has printed something by then, and is stopped;
//!   one that has printed nothing at all is a hang.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{rngs::StdRng, Rng};

use super::{corpus, Case, ScratchDir};
use crate::flags as f;

/// How long a command may run before it is stopped (an accepted long run, or a hang).
const RUN_LIMIT: Duration = Duration::from_secs(3);
/// How long `strata serve` may take to stop after SIGTERM with nothing in flight.
const STOP_LIMIT: Duration = Duration::from_secs(5);
/// Peak resident memory of one run on the tiny model (it needs well under 100 MiB), on top
/// of the KV blocks its flags ask to hold (`asked_kv_bytes`).
const MAX_RSS_BYTES: u64 = 2 << 30;
/// Flags that ask for KV blocks held in memory (a tier of that many blocks is allocated,
/// once checked against the machine's available memory: memory the user asked for).
const BLOCK_FLAGS: &[&str] = &["num-gpu-blocks", "max-cpu-offload-blocks", "num-cpu-blocks"];
/// The tiny model's KV bytes per token in f32 (2 layers × K and V × 2 KV heads × 8 × 4 B).
const TINY_KV_TOKEN_BYTES: u64 = 256;
/// The largest default `--block-size` of any subcommand (an upper bound where not given).
const LARGEST_DEFAULT_BLOCK: u64 = 256;
/// Most output kept from one stream of a run (a `--help` page is ~5 KiB).
const KEEP_OUTPUT: usize = 64 << 10;

/// Flags whose values are paths, names or text: the files and the server have targets of
/// their own (`hostile_files`, `http`); here they keep their base values.
const NOT_FUZZED: &[&str] = &[
    "model",
    "prompt",
    "prompt-file",
    "trace-out",
    "disk-offload-dir",
    "dir",
    "host",
    "api-key",
    "served-model-name",
    "kv-events-endpoint",
    "kv-events-topic",
    "kv-events-replay-endpoint",
    "text",
];

/// Environment variables strata reads, with values at their edges (`{model}`, `{dir}` as
/// in command lines). `STRATA_MODEL` matters when a mutation drops `--model`.
const ENV: &[(&str, &[&str])] = &[
    (
        "RAYON_NUM_THREADS",
        &[
            "0",
            "1",
            "2",
            "3",
            "2000",
            "-1",
            "abc",
            "",
            "1e3",
            "99999999999999999999",
        ],
    ),
    (
        "STRATA_MODEL",
        &[
            "{model}",
            "/nonexistent",
            "{dir}",
            "/dev/null",
            "",
            "/proc/self/mem",
        ],
    ),
    ("STRATA_CHECK_ORDER", &["1", "0", "yes"]),
    ("STRATA_SANITIZE", &["1", "0", ""]),
    (
        "STRATA_KERNEL_CACHE",
        &["{dir}/kernels", "/nonexistent/x", "", "/dev/null"],
    ),
    ("STRATA_CUDA_LIBS", &["/nonexistent", "{dir}", "", ":::"]),
];

/// Where a run's stdout goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdout {
    /// A pipe the fuzzer reads (the contract looks at what it says).
    Read,
    /// A pipe whose reading end is closed: writes fail with EPIPE.
    Closed,
    /// `/dev/full`: writes fail with ENOSPC.
    Full,
}

impl Stdout {
    fn of(case: &Case) -> Self {
        match case.get("stdout") {
            Some(b"closed") => Stdout::Closed,
            Some(b"full") => Stdout::Full,
            _ => Stdout::Read,
        }
    }
}

/// The base command lines: each an accepted, cheap run on the tiny model.
pub fn flags_cases() -> Vec<Case> {
    let line = |words: &str| words.split(' ').map(str::to_string).collect::<Vec<_>>();
    let generate = "strata generate --model {model} --prompt Hello --max-tokens 2";
    let offload = format!("{generate} --enable-offload --block-size 16");
    [
        generate.to_string(),
        format!("{offload} --num-kv-buffers 2"),
        format!("{offload} --max-model-len 64 --sparse-budget 32"),
        "strata serve --model {model} --port 0 --max-model-len 64".into(),
        "strata bench offload --model {model} --context 32 --decode-steps 2 --rounds 1 \
         --block-size 16"
            .into(),
        "strata bench serve --model {model} --num-seqs 2 --input-len 8:8 --output-len 2:2 \
         --block-size 16"
            .into(),
        "strata bench disk --dir {dir}/disk --size-mib 1".into(),
        "strata bench decode --model {model} --context 16 --decode-steps 2 --rounds 1".into(),
        "strata bench agreement --model {model} --positions 8 --greedy-tokens 2".into(),
        "strata perplexity {dir}/text.txt --model {model} --ctx 8".into(),
        "needle --model {model} --input-len 600 --depth 0.5".into(),
    ]
    .iter()
    .map(|words| {
        let mut c = Case::default();
        c.set("argv", join(&line(words)));
        c
    })
    .collect()
}

fn join(argv: &[String]) -> Vec<u8> {
    argv.join("\0").into_bytes()
}

fn split(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\0')
        .map(str::to_string)
        .collect()
}

/// The binary and subcommand words of a command line (`strata bench serve`, `needle`).
fn command_words(argv: &[String]) -> Vec<String> {
    argv.iter()
        .take_while(|a| !a.starts_with('-'))
        .take(3)
        .cloned()
        .collect()
}

/// A flag of a subcommand, as its `--help` lists it.
#[derive(Debug, Clone)]
struct Flag {
    name: String,
    takes_value: bool,
}

/// Subcommand words and the flags their `--help` lists.
type HelpCache = Mutex<Vec<(Vec<String>, Arc<Vec<Flag>>)>>;

/// The flags `words`' `--help` lists (read once per subcommand and process).
fn flags_of(words: &[String]) -> Arc<Vec<Flag>> {
    static SEEN: OnceLock<HelpCache> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, flags)) = seen.iter().find(|(w, _)| w == words) {
        return Arc::clone(flags);
    }
    let flags = Arc::new(help_flags(words).unwrap_or_default());
    seen.push((words.to_vec(), Arc::clone(&flags)));
    flags
}

fn help_flags(words: &[String]) -> Result<Vec<Flag>> {
    let (bin, sub) = words.split_first().context("empty command line")?;
    let out = Command::new(binary(bin)?)
        .args(sub)
        .arg("--help")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()?;
    Ok(parse_help(&String::from_utf8_lossy(&out.stdout)))
}

/// Flags from clap's help layout: lines `  -x, --name <VALUE>  text` or `  --name  text`.
fn parse_help(help: &str) -> Vec<Flag> {
    help.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            if !line.starts_with('-') {
                return None;
            }
            let at = line.find("--")?;
            let mut words = line[at + 2..].split_whitespace();
            let name = words.next()?.to_string();
            let takes_value = words.next().is_some_and(|w| w.starts_with('<'));
            (name != "help" && name != "version").then_some(Flag { name, takes_value })
        })
        .collect()
}

/// A binary of this build: beside the running executable (the fuzz binary), or one level
/// up (a test binary in `target/<profile>/deps`).
fn binary(name: &str) -> Result<PathBuf> {
    anyhow::ensure!(
        name == "strata" || name == "needle",
        "not a strata binary: {name:?}"
    );
    let exe = std::env::current_exe()?;
    let dirs = exe.ancestors().skip(1).take(2);
    for d in dirs {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("the {name} binary is not built beside {}", exe.display())
}

/// Every documented bound of a numeric flag (`crate::flags`), and a few more edges.
fn bounds() -> Vec<u64> {
    vec![
        0,
        1,
        2,
        16,
        64,
        1000,
        65_535,
        f::MAX_TOKENS as u64,
        f::MAX_KV_BUFFERS as u64,
        f::MAX_BLOCK_SIZE as u64,
        f::MAX_BLOCKS as u64,
        f::MAX_SEQS as u64,
        f::MAX_REPEATS as u64,
        f::MAX_IO_THREADS as u64,
        f::MAX_BENCH_DISK_MIB as u64,
        f::MAX_PAYLOAD_BYTES as u64,
        f::MAX_PENDING as u64,
        f::MAX_SHUTDOWN_SECS,
        f::MAX_CONNECTIONS as u64,
    ]
}

/// One value at an edge: a bound ±1, a type's extreme, a float edge, or a number written
/// oddly.
fn edge_value(rng: &mut StdRng) -> String {
    match rng.random_range(0..100) {
        0..40 => {
            let b = bounds();
            let b = b[rng.random_range(0..b.len())];
            match rng.random_range(0..3) {
                0 => b.saturating_sub(1).to_string(),
                1 => b.to_string(),
                _ => (b as u128 + 1).to_string(),
            }
        }
        40..55 => [
            "-1",
            "2147483647",
            "4294967295",
            "4294967296",
            "9223372036854775807",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            "1000000000000000000000000000000",
        ][rng.random_range(0..9)]
        .to_string(),
        55..70 => {
            let floats = [
                f::MIN_LINK_GBPS.to_string(),
                "0.000999".into(),
                "0.0010001".into(),
                f::MAX_LINK_GBPS.to_string(),
                "1000000.1".into(),
                "NaN".into(),
                "inf".into(),
                "-inf".into(),
                "-0".into(),
                "5e-324".into(),
                "1e308".into(),
                "1e309".into(),
                "0.5".into(),
                "1.0000001".into(),
                "1e-9".into(),
            ];
            floats[rng.random_range(0..floats.len())].clone()
        }
        70..80 => [
            "", " 1", "1 ", "+1", "0x10", "1e3", "1_000", "\u{661}", "1,1", "1:1", "0:0", "1:0",
            "3:2", ",", ":", "1..2",
        ][rng.random_range(0..16)]
        .to_string(),
        80..85 => "9".repeat(4000),
        85..93 => (0..rng.random_range(1..6))
            .map(|_| edge_value_simple(rng))
            .collect::<Vec<_>>()
            .join(","),
        _ => format!("{}:{}", edge_value_simple(rng), edge_value_simple(rng)),
    }
}

/// A bound ±1 or a type's extreme (the parts of lists and pairs).
fn edge_value_simple(rng: &mut StdRng) -> String {
    let b = bounds();
    match rng.random_range(0..4) {
        0 => "-1".into(),
        1 => "18446744073709551616".into(),
        _ => b[rng.random_range(0..b.len())]
            .saturating_add(rng.random_range(0..2))
            .to_string(),
    }
}

/// One stacked change of a command line, its environment or its stdout.
pub fn mutate_flags(case: &mut Case, rng: &mut StdRng) {
    match rng.random_range(0..20) {
        0..3 => {
            let (name, values) = ENV[rng.random_range(0..ENV.len())];
            let mut env: Vec<String> = split(case.get("env").unwrap_or_default())
                .into_iter()
                .filter(|kv| !kv.is_empty() && !kv.starts_with(&format!("{name}=")))
                .collect();
            env.push(format!(
                "{name}={}",
                values[rng.random_range(0..values.len())]
            ));
            case.set("env", join(&env));
            return;
        }
        3 => {
            let to: &[u8] = [&b"closed"[..], b"full", b"read"][rng.random_range(0..3)];
            case.set("stdout", to.to_vec());
            return;
        }
        _ => {}
    }
    let mut argv = split(case.get("argv").unwrap_or_default());
    let flags = flags_of(&command_words(&argv));
    let fuzzed: Vec<&Flag> = flags
        .iter()
        .filter(|fl| !NOT_FUZZED.contains(&fl.name.as_str()))
        .collect();
    let pick_valued = |rng: &mut StdRng| {
        let v: Vec<&&Flag> = fuzzed.iter().filter(|fl| fl.takes_value).collect();
        (!v.is_empty()).then(|| v[rng.random_range(0..v.len())].name.clone())
    };
    match rng.random_range(0..100) {
        0..65 => {
            if let Some(name) = pick_valued(rng) {
                set_flag(&mut argv, &name, edge_value(rng));
            }
        }
        65..75 => {
            if let Some(name) = pick_valued(rng) {
                argv.push(format!("--{name}={}", edge_value(rng)));
            }
        }
        75..83 => {
            // Another word dropped (a flag's value goes missing, a required flag too).
            let first = command_words(&argv).len();
            if argv.len() > first {
                argv.remove(rng.random_range(first..argv.len()));
            }
        }
        83..91 => {
            if let Some(name) = pick_valued(rng) {
                argv.push(format!("--{name}"));
                argv.push(edge_value(rng));
            }
        }
        _ => {
            let bools: Vec<&&Flag> = fuzzed.iter().filter(|fl| !fl.takes_value).collect();
            if !bools.is_empty() {
                argv.push(format!(
                    "--{}",
                    bools[rng.random_range(0..bools.len())].name
                ));
            }
        }
    }
    case.set("argv", join(&argv));
}

/// The value `--name` has on a command line (`--name V` or `--name=V`; the last wins).
fn flag_value<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let flag = format!("--{name}");
    let eq = format!("--{name}=");
    let mut found = None;
    for (i, a) in args.iter().enumerate() {
        if *a == flag {
            found = args.get(i + 1).map(String::as_str);
        } else if let Some(v) = a.strip_prefix(&eq) {
            found = Some(v);
        }
    }
    found
}

/// An upper bound of the KV bytes a command line's flags ask to hold in memory, on the
/// tiny model.
fn asked_kv_bytes(args: &[String]) -> u64 {
    let num = |name| flag_value(args, name).and_then(|v| v.parse::<u64>().ok());
    let block = num("block-size").unwrap_or(LARGEST_DEFAULT_BLOCK);
    BLOCK_FLAGS
        .iter()
        .filter_map(|f| num(f))
        .fold(0u64, |sum, blocks| {
            sum.saturating_add(
                blocks
                    .saturating_mul(block)
                    .saturating_mul(TINY_KV_TOKEN_BYTES),
            )
        })
}

/// Sets `--name`'s value where the command line has it, else appends it.
fn set_flag(argv: &mut Vec<String>, name: &str, value: String) {
    let flag = format!("--{name}");
    match argv.iter().position(|a| *a == flag) {
        Some(i) if i + 1 < argv.len() => argv[i + 1] = value,
        _ => {
            argv.push(flag);
            argv.push(value);
        }
    }
}

/// The fuzzer's tiny Llama GGUF model with a 4,096-token context (room for `needle`'s
/// smallest haystack), written once per process and removed at its exit.
fn tiny_model() -> Result<&'static Path> {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    if let Some(p) = PATH.get() {
        return Ok(p);
    }
    let mut doc = corpus::gguf_doc("llama");
    for (key, value) in &mut doc.metadata {
        if key == "llama.context_length" {
            *value = candle_core::quantized::gguf_file::Value::U32(4096);
        }
    }
    let dir = std::env::temp_dir().join(format!("strata-fuzz-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.gguf");
    std::fs::write(&path, doc.to_bytes())?;
    extern "C" fn remove_model_dir() {
        if let Some(dir) = PATH.get().and_then(|p| p.parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    // SAFETY: registers a plain function to run at exit.
    unsafe { libc::atexit(remove_model_dir) };
    Ok(PATH.get_or_init(|| path))
}

/// Output of one stream, read on its own thread, kept up to `KEEP_OUTPUT` bytes.
fn drain(mut r: impl Read + Send + 'static) -> Arc<Mutex<Vec<u8>>> {
    let kept = Arc::new(Mutex::new(Vec::new()));
    let k = Arc::clone(&kept);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut k = k.lock().unwrap_or_else(|e| e.into_inner());
            let room = KEEP_OUTPUT.saturating_sub(k.len());
            k.extend_from_slice(&buf[..n.min(room)]);
        }
    });
    kept
}

fn text(kept: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&kept.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

/// How a child ended, with its peak resident memory.
struct Ended {
    status: libc::c_int,
    max_rss_bytes: u64,
}

/// Reaps `pid` if it has ended (`wait4` with `WNOHANG`: std's `Child` has no rusage).
fn try_reap(pid: libc::pid_t) -> Option<Ended> {
    let mut status = 0;
    // SAFETY: rusage is plain data, filled by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid out-pointers.
    let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
    (r == pid).then(|| Ended {
        status,
        max_rss_bytes: usage.ru_maxrss.max(0) as u64 * 1024,
    })
}

fn wait_until(pid: libc::pid_t, deadline: Instant) -> Option<Ended> {
    loop {
        if let Some(e) = try_reap(pid) {
            return Some(e);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `sig` to the child's process group (the child leads it: `process_group(0)`).
fn signal(pid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: kill on our own child's group; the child is not yet reaped, so its pid
    // (the group's id) is not reused.
    unsafe { libc::kill(-pid, sig) };
}

/// Runs one command line and checks the contract (module doc); `Err` for a clean failure.
pub fn run_flags(case: &Case) -> Result<()> {
    let argv = split(case.get("argv").context("no argv in the case")?);
    let (bin, args) = argv.split_first().context("empty command line")?;
    let bin = binary(bin)?;
    let dir = ScratchDir::new()?;
    // A text for `strata perplexity` to score.
    std::fs::write(
        dir.path().join("text.txt"),
        "the cat sat on the mat. ".repeat(40),
    )?;
    let model = tiny_model()?.display().to_string();
    let here = dir.path().display().to_string();
    let fill = |a: &str| a.replace("{model}", &model).replace("{dir}", &here);
    let args: Vec<String> = args.iter().map(|a| fill(a)).collect();
    let env: Vec<(String, String)> = split(case.get("env").unwrap_or_default())
        .iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), fill(v)))
        .collect();
    let mut stdout = Stdout::of(case);
    if args.first().is_some_and(|a| a == "serve") {
        // The server is seen ready by its listening line (tests/server_hostile.rs runs it
        // with stdout closed).
        stdout = Stdout::Read;
    }
    check_command(&bin, &args, &env, stdout, dir.path())
}

/// Runs `program args` in `cwd` with `env` added and stdout sent to `stdout`, and checks
/// the contract (module doc): a breach panics, a clean failure is `Err` with its line.
pub fn check_command(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    stdout: Stdout,
    cwd: &Path,
) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .process_group(0) // so a stop reaches the workers it started too
        .current_dir(cwd)
        .env_remove("STRATA_MODEL")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    match stdout {
        Stdout::Read => cmd.stdout(Stdio::piped()),
        Stdout::Closed => cmd.stdout(closed_pipe()?),
        Stdout::Full => cmd.stdout(std::fs::OpenOptions::new().write(true).open("/dev/full")?),
    };
    let mut child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let out = match child.stdout.take() {
        Some(s) => drain(s),
        None => Arc::new(Mutex::new(Vec::new())),
    };
    let err = drain(child.stderr.take().context("stderr")?);
    let started = Instant::now();
    let serving = args.first().is_some_and(|a| a == "serve");
    let mut stopped_by_us = false;
    let ended = loop {
        if let Some(e) = try_reap(pid) {
            break e;
        }
        if serving && text(&out).contains("listening on") {
            signal(pid, libc::SIGTERM);
            let Some(e) = wait_until(pid, Instant::now() + STOP_LIMIT) else {
                signal(pid, libc::SIGKILL);
                let _ = wait_until(pid, Instant::now() + STOP_LIMIT);
                panic!("strata serve did not stop within {STOP_LIMIT:?} of SIGTERM");
            };
            break e;
        }
        if started.elapsed() >= RUN_LIMIT {
            signal(pid, libc::SIGKILL);
            let _ = wait_until(pid, Instant::now() + STOP_LIMIT);
            // Accepted and busy: it said what it is doing (a plan, a progress line).
            assert!(
                !(text(&out).is_empty() && text(&err).is_empty()),
                "no output and no end within {RUN_LIMIT:?}: a hang ({args:?})"
            );
            stopped_by_us = true;
            break Ended {
                status: 0,
                max_rss_bytes: 0,
            };
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // The readers end with the pipes; give them a moment to take the last bytes.
    let settle = Instant::now();
    while Arc::strong_count(&out) + Arc::strong_count(&err) > 2
        && settle.elapsed() < Duration::from_secs(1)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(child); // already reaped: dropping a Child neither waits nor kills
    let (printed, stderr) = (text(&out), text(&err));
    assert!(
        !stderr.contains("panicked") && !printed.contains("panicked"),
        "a panic: {args:?}: {stderr}"
    );
    assert!(
        ended.max_rss_bytes <= MAX_RSS_BYTES.saturating_add(asked_kv_bytes(args)),
        "peak memory {} MiB: {args:?}",
        ended.max_rss_bytes >> 20
    );
    if stopped_by_us {
        return Ok(());
    }
    let status = ended.status;
    assert!(
        libc::WIFEXITED(status),
        "ended by signal {}: {args:?}: {stderr}",
        libc::WTERMSIG(status)
    );
    match libc::WEXITSTATUS(status) {
        0 => Ok(()),
        // `needle`'s verdict that a case failed (docs/errors.md): a run that completed,
        // its table on stdout, no error line (the tiny model finds no needle).
        1 if program.ends_with("needle")
            && !printed.is_empty()
            && !stderr.lines().any(|l| l.starts_with("error: ")) =>
        {
            Ok(())
        }
        code @ (1 | 2) => {
            let lines: Vec<&str> = stderr.lines().collect();
            let errors = lines.iter().filter(|l| l.starts_with("error: ")).count();
            // Output that fails mid-run follows what the run printed before it.
            let ok = if stdout != Stdout::Read {
                errors == 1 && lines.last().is_some_and(|l| l.starts_with("error: "))
            } else {
                lines.len() == 1 && errors == 1
            };
            assert!(
                ok,
                "exit {code} must print one `error:` line, printed {}: {args:?}: {stderr}",
                lines.len()
            );
            bail!("exit {code}: {}", lines[lines.len() - 1])
        }
        code => panic!("exit status {code}: {args:?}: {stderr}"),
    }
}

/// The writing end of a pipe whose reading end is already closed.
fn closed_pipe() -> Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills two descriptors, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: both descriptors are ours and open; each is owned once.
    let (read, write) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    drop(read);
    Ok(write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clap_help_lines_give_the_flags_and_whether_they_take_values() {
        let help =
            "Usage: strata generate [OPTIONS]\n\nOptions:\n      --model <MODEL>\n          \
                    GGUF file\n      --chat\n          Wrap\n  -h, --help\n          Print help\n";
        let flags = parse_help(help);
        let names: Vec<(&str, bool)> = flags
            .iter()
            .map(|f| (f.name.as_str(), f.takes_value))
            .collect();
        assert_eq!(names, [("model", true), ("chat", false)]);
    }

    fn sh(script: &str) -> std::thread::Result<Result<()>> {
        sh_to(script, Stdout::Read)
    }

    fn sh_to(script: &str, stdout: Stdout) -> std::thread::Result<Result<()>> {
        let args = ["-c".to_string(), script.to_string()];
        std::panic::catch_unwind(|| {
            check_command(Path::new("/bin/sh"), &args, &[], stdout, Path::new("/"))
        })
    }

    #[test]
    fn the_contract_takes_clean_ends_and_busy_runs_and_refuses_the_rest() {
        assert!(matches!(sh("echo text; exit 0"), Ok(Ok(()))));
        assert!(matches!(
            sh("echo 'error: bad value' >&2; exit 2"),
            Ok(Err(_))
        ));
        // Busy past the limit after saying what it does: an accepted long run.
        assert!(matches!(sh("echo working >&2; sleep 30"), Ok(Ok(()))));
        // Breaches: a line before the error, a signal, a status past 2, a panic, silence.
        for bad in [
            "echo 'plan: 1 MiB' >&2; echo 'error: x' >&2; exit 1",
            "kill -SEGV $$",
            "exit 101",
            "echo \"thread 'main' panicked at src/x.rs\" >&2; exit 0",
            "sleep 30",
        ] {
            assert!(sh(bad).is_err(), "{bad}: not a finding");
        }
    }

    #[test]
    fn a_full_stdout_makes_writes_fail_and_allows_lines_before_the_error() {
        // (A closed pipe would kill the shell with SIGPIPE; Rust binaries ignore it.)
        let script = "printf 'text\\n' 2>/dev/null || { echo 'plan: 1 MiB' >&2; echo 'error: writing: x' >&2; exit 1; }";
        assert!(matches!(sh_to(script, Stdout::Full), Ok(Err(_))));
        // With stdout read, a line before the error is still a breach.
        let printed_then_failed = "echo 'plan: 1 MiB' >&2; echo 'error: x' >&2; exit 1";
        assert!(sh_to(printed_then_failed, Stdout::Read).is_err());
        assert!(matches!(
            sh_to(printed_then_failed, Stdout::Full),
            Ok(Err(_))
        ));
        // Two error lines are a breach either way.
        let twice = "echo 'error: a' >&2; echo 'error: b' >&2; exit 1";
        assert!(sh_to(twice, Stdout::Full).is_err());
    }

    #[test]
    fn the_memory_a_command_line_asks_for_follows_its_block_flags() {
        let args: Vec<String> = ["serve", "--block-size", "16", "--num-gpu-blocks=1024"]
            .map(String::from)
            .to_vec();
        assert_eq!(asked_kv_bytes(&args), 1024 * 16 * 256);
        assert_eq!(asked_kv_bytes(&args[..1]), 0);
    }

    #[test]
    fn a_flag_is_set_in_place_or_appended() {
        let mut argv: Vec<String> = ["strata", "generate", "--max-tokens", "2"]
            .map(String::from)
            .to_vec();
        set_flag(&mut argv, "max-tokens", "7".into());
        set_flag(&mut argv, "seed", "9".into());
        assert_eq!(
            argv,
            ["strata", "generate", "--max-tokens", "7", "--seed", "9"]
        );
    }
}
