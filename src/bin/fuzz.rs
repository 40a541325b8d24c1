//! `fuzz`: runs strata's structure-aware fuzzer (`strata::fuzz`) over its targets and keeps
//! every finding in `tests/fuzz_corpus/<target>/<hash>`, replayed by `cargo test`.
//!
//! The supervisor (the process you start) runs each target in a worker process (this
//! binary again, `--worker`), which prints the index of each case before running it. A
//! panic is caught in the worker and reported; a case past its memory or time budget, or a
//! worker that dies (an abort, a signal), is attributed to the last case it started. Since
//! a case is a pure function of (target, seed, index), the supervisor rebuilds the input
//! from the index, stores it, and restarts the worker after it.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;

use strata::errors;
use strata::fuzz::{self, Outcome, Target};

#[derive(Parser)]
#[command(
    name = "fuzz",
    about = "Structure-aware fuzzing of strata's model, tokenizer and template loaders, its HTTP server, KV-event socket and disk tier's files, and its command lines"
)]
struct Args {
    /// Cases per target (stops early if --minutes runs out).
    #[arg(long)]
    cases: Option<u64>,
    /// Wall-clock budget for the whole run, split evenly between the targets.
    #[arg(long)]
    minutes: Option<f64>,
    /// Targets to run (comma-separated): gguf, gguf-meta, safetensors, tokenizer, template, http, http-pipelined, kv-events, disk, flags [default: all]
    #[arg(long, value_delimiter = ',')]
    target: Vec<String>,
    /// Base seed; each target's seed is derived from it (printed with the results).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// First case index (to resume a run).
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Where findings are written.
    #[arg(long, default_value = "tests/fuzz_corpus")]
    corpus: PathBuf,
    /// Run the stored input FILE of one --target and print how it ends (panics show
    /// their location).
    #[arg(long, value_name = "FILE")]
    replay: Option<PathBuf>,
    /// Internal: run cases of one target and report on stdout.
    #[arg(long, hide = true)]
    worker: bool,
    /// Internal: the worker's deadline, in milliseconds from its start.
    #[arg(long, hide = true)]
    deadline_ms: Option<u64>,
}

fn main() -> ExitCode {
    if let Some(code) = strata::model::template::worker::enter() {
        return code;
    }
    let args = match errors::parse_args::<Args>("fuzz") {
        Ok(a) => a,
        Err(code) => return code,
    };
    let result = if let Some(file) = &args.replay {
        replay(&args, file)
    } else if args.worker {
        worker(&args)
    } else {
        supervise(&args)
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => errors::report(&e),
    }
}

fn targets(args: &Args) -> Result<Vec<Target>> {
    if args.target.is_empty() {
        return Ok(Target::ALL.to_vec());
    }
    args.target
        .iter()
        .map(|n| {
            Target::from_name(n).with_context(|| {
                let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
                format!("unknown target {n:?} ({})", names.join(", "))
            })
        })
        .collect()
}

/// Each target's seed: the base seed mixed with the target, so targets differ.
fn target_seed(seed: u64, t: Target) -> u64 {
    seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Worker: runs cases `start..start+cases` of one target (or until the deadline).
/// Protocol, one line each: `c I` before case I, `p I MSG` for a panic, `x I KIND` for a
/// budget exceeded (then exits 3), `r I` after a case that was refused but left an
/// abandoned thread behind (then exits 4, to be restarted), `done N A` at the end (N cases
/// run, A of them accepted: the rest were refused with an error).
fn worker(args: &Args) -> Result<bool> {
    let [target] = targets(args)?[..] else {
        bail!("a worker runs exactly one --target");
    };
    std::panic::set_hook(Box::new(|_| {})); // panics are reported by the protocol
    fuzz::count_panics(); // ...and those of the servers' own threads, by their targets
    let seed = target_seed(args.seed, target);
    let base = fuzz::base_corpus(target);
    let deadline = args
        .deadline_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let end = args.start.saturating_add(args.cases.unwrap_or(u64::MAX));
    let mut out = std::io::stdout().lock();
    let (mut done, mut accepted) = (0u64, 0u64);
    for i in args.start..end {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        writeln!(out, "c {i}")?;
        out.flush()?;
        let case = fuzz::make_case(target, &base, seed, i);
        match fuzz::run_case_bounded(target, &case) {
            Outcome::Ok => accepted += 1,
            Outcome::Refused(_) => {}
            Outcome::Panicked(msg) => {
                writeln!(out, "p {i} {}", errors::one_line(&msg))?;
            }
            Outcome::Exceeded(kind) => {
                writeln!(out, "x {i} {kind}")?;
                out.flush()?;
                std::process::exit(3); // a parked or runaway thread: start afresh
            }
        }
        done += 1;
        if strata::bounded::abandoned() > 0 {
            // A refused case (a template over its budget) left a parked thread holding
            // memory: start afresh after it, so leaks cannot add up.
            writeln!(out, "r {i}")?;
            out.flush()?;
            std::process::exit(4);
        }
    }
    writeln!(out, "done {done} {accepted}")?;
    Ok(true)
}

fn replay(args: &Args, file: &std::path::Path) -> Result<bool> {
    let [target] = targets(args)?[..] else {
        bail!("--replay needs exactly one --target");
    };
    let case = fuzz::Case::from_bytes(&std::fs::read(file)?)?;
    let outcome = fuzz::run_case_bounded(target, &case);
    println!("{outcome:?}");
    Ok(!outcome.is_finding())
}

#[derive(Default)]
struct Tally {
    executions: u64,
    /// Cases accepted (not refused), as the workers that finished counted them.
    accepted: u64,
    findings: Vec<(u64, String)>,
}

/// Supervisor: runs every target's worker, restarting it past each fatal finding.
fn supervise(args: &Args) -> Result<bool> {
    if args.cases.is_none() && args.minutes.is_none() {
        bail!("give --cases N or --minutes M");
    }
    if let Some(m) = args.minutes {
        if !(m.is_finite() && m > 0.0 && m <= 10_000.0) {
            bail!("--minutes must be in (0, 10000], got {m}");
        }
    }
    let targets = targets(args)?;
    let exe = std::env::current_exe().context("locating the fuzz binary")?;
    let per_target = args
        .minutes
        .map(|m| Duration::from_secs_f64(m * 60.0 / targets.len() as f64));
    let mut all_ok = true;
    println!("target           seed                 executions  accepted  findings  time");
    for &t in &targets {
        let started = Instant::now();
        let mut tally = Tally::default();
        let mut next = args.start;
        let stop = args.cases.map(|n| args.start.saturating_add(n));
        loop {
            let left = per_target.map(|d| d.saturating_sub(started.elapsed()));
            if left.is_some_and(|l| l.is_zero()) || stop.is_some_and(|s| next >= s) {
                break;
            }
            let mut cmd = Command::new(&exe);
            cmd.args(["--worker", "--target", t.name()]).args([
                "--seed",
                &args.seed.to_string(),
                "--start",
                &next.to_string(),
            ]);
            if let Some(s) = stop {
                cmd.args(["--cases", &(s - next).to_string()]);
            }
            if let Some(l) = left {
                cmd.args(["--deadline-ms", &l.as_millis().to_string()]);
            }
            let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
            let reader = BufReader::new(child.stdout.take().context("worker stdout")?);
            let mut last_started = None;
            let mut restart_after = None;
            let mut finished = false;
            for line in reader.lines() {
                let line = line?;
                let mut parts = line.splitn(3, ' ');
                let (kind, idx, rest) = (parts.next(), parts.next(), parts.next());
                let idx: Option<u64> = idx.and_then(|s| s.parse().ok());
                match (kind, idx) {
                    (Some("c"), Some(i)) => {
                        last_started = Some(i);
                        tally.executions += 1;
                    }
                    (Some("p"), Some(i)) => record(
                        args,
                        t,
                        i,
                        &format!("panic: {}", rest.unwrap_or("")),
                        &mut tally,
                    )?,
                    (Some("x"), Some(i)) => {
                        record(args, t, i, rest.unwrap_or("budget exceeded"), &mut tally)?
                    }
                    (Some("r"), Some(i)) => restart_after = Some(i),
                    (Some("done"), _) => {
                        finished = true;
                        tally.accepted += rest.and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
                    }
                    _ => {}
                }
            }
            let status = child.wait()?;
            if finished {
                break;
            }
            if let Some(i) = restart_after {
                next = i + 1; // not a finding: the case ended in an error
                continue;
            }
            // Died without finishing: the last case it started is the culprit (unless it
            // was already recorded as over budget).
            let Some(i) = last_started else {
                bail!(
                    "the {} worker failed before its first case ({status})",
                    t.name()
                );
            };
            if !tally.findings.iter().any(|(j, _)| *j == i) {
                record(args, t, i, &format!("worker died: {status}"), &mut tally)?;
            }
            next = i + 1;
        }
        println!(
            "{:<16} {:<20} {:>10}  {:>8}  {:>8}  {:.0} s",
            t.name(),
            target_seed(args.seed, t),
            tally.executions,
            tally.accepted,
            tally.findings.len(),
            started.elapsed().as_secs_f64()
        );
        for (i, why) in &tally.findings {
            println!("  finding: {} case {i}: {why}", t.name());
        }
        all_ok &= tally.findings.is_empty();
    }
    Ok(all_ok)
}

/// Rebuilds case `i` of target `t` and stores it under the corpus directory.
fn record(args: &Args, t: Target, i: u64, why: &str, tally: &mut Tally) -> Result<()> {
    let case = fuzz::make_case(t, &fuzz::base_corpus(t), target_seed(args.seed, t), i);
    let dir = args.corpus.join(t.name());
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(case.hash_name());
    std::fs::write(&path, case.to_bytes())?;
    tally
        .findings
        .push((i, format!("{why} -> {}", path.display())));
    Ok(())
}
