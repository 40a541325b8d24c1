//! Hostile files and flags against the release binaries (issue 30): paths that are not
//! regular files or are unbounded, the disk tier's files planted as links, FIFOs and sparse
//! giants, capacity and link-speed flags at the edges of their ranges, and the CLI
//! contract (validate first, then inform; usage errors exit 2). Every case: the exit code,
//! exactly one stderr line, no panic, no hang, nothing outside strata's own files touched.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{scratch_dir, TinySpec};

const STRATA: &str = env!("CARGO_BIN_EXE_strata");

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    secs: f64,
}

/// Runs `bin` with `args`, killing it (and failing) past `limit`.
fn run(bin: &str, args: &[OsString], limit: Duration) -> Run {
    let start = Instant::now();
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Drain the pipes on threads: a chatty child must not block on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).ok();
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).ok();
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("hung past {limit:?}: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code(),
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
        secs: start.elapsed().as_secs_f64(),
    }
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// The error contract: exit `code`, one `error:` line naming `expect`, no panic, nothing
/// on stdout, within 60 s.
fn assert_error(bin: &str, args: &[OsString], expect: &str, code: i32) -> Run {
    let r = run(bin, args, Duration::from_secs(60));
    assert!(
        !r.stderr.contains("panicked") && !r.stderr.contains("backtrace"),
        "panic for {args:?}: {}",
        r.stderr
    );
    assert_eq!(r.code, Some(code), "exit code for {args:?}: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line for {args:?}, got: {}", r.stderr);
    assert!(lines[0].starts_with("error: "), "{}", r.stderr);
    assert!(
        r.stderr.contains(expect),
        "{expect:?} for {args:?} in: {}",
        r.stderr
    );
    assert!(r.stdout.is_empty(), "stdout for {args:?}: {}", r.stdout);
    r
}

fn tiny(name: &str) -> PathBuf {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 5);
    dir
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

fn free_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs fills the zeroed struct for a valid C string path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    s.f_bavail as u64 * s.f_frsize as u64
}

fn generate(model: &Path, extra: &[OsString]) -> Vec<OsString> {
    let mut a = os(&["generate", "--json", "--model"]);
    a.push(model.into());
    a.extend(extra.iter().cloned());
    a
}

// ------------------------------------------------------------------ --prompt-file

#[test]
fn prompt_files_that_are_not_regular_or_are_unbounded_are_one_line() {
    let m = tiny("hf_prompt_model");
    let d = scratch_dir("hf_prompt");
    let fifo = d.join("fifo");
    mkfifo(&fifo);
    let sparse = d.join("sparse");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(4 << 30)
        .unwrap();
    let zero_link = d.join("zero-link");
    std::os::unix::fs::symlink("/dev/zero", &zero_link).unwrap();
    for (path, expect) in [
        (
            PathBuf::from("/dev/zero"),
            "--prompt-file /dev/zero: not a regular file (a character device)".to_string(),
        ),
        (
            zero_link.clone(),
            format!(
                "--prompt-file {}: not a regular file (a character device)",
                zero_link.display()
            ),
        ),
        (
            fifo.clone(),
            format!("--prompt-file {}: not a regular file (a FIFO)", fifo.display()),
        ),
        (
            d.clone(),
            format!("--prompt-file {}: not a regular file (a directory)", d.display()),
        ),
        (
            sparse.clone(),
            format!(
                "--prompt-file {}: 4294967296 bytes (4.0 GiB) is more than the limit of 268435456 (256.0 MiB)",
                sparse.display()
            ),
        ),
    ] {
        let args = generate(&m, &[OsString::from("--prompt-file"), path.into()]);
        let r = assert_error(STRATA, &args, &expect, 1);
        assert!(r.secs < 20.0, "{expect}: {:.1} s", r.secs);
    }
    // A regular file (through a link) is the prompt.
    let p = d.join("prompt.txt");
    std::fs::write(&p, "hello").unwrap();
    let link = d.join("prompt-link");
    std::os::unix::fs::symlink(&p, &link).unwrap();
    let args = generate(
        &m,
        &os(&["--max-tokens", "1", "--prompt-file"])
            .into_iter()
            .chain([link.into_os_string()])
            .collect::<Vec<_>>(),
    );
    let r = run(STRATA, &args, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

// ------------------------------------------------------------------ the disk tier's files

fn bench_disk(model: &Path, dir: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut a = os(&["bench", "serve", "--json", "--model"]);
    a.push(model.into());
    a.extend(os(&[
        "--num-seqs",
        "2",
        "--input-len",
        "20",
        "--output-len",
        "2",
        "--shared-prefix",
        "16",
        "--block-size",
        "4",
        "--prefill-chunk",
        "8",
        "--max-num-batched-tokens",
        "8",
    ]));
    a.extend(os(extra));
    a.push("--disk-offload-dir".into());
    a.push(dir.into());
    a
}

#[test]
fn the_slot_file_is_never_followed_nor_another_file_overwritten() {
    let m = tiny("hf_slots_model");
    let victim_dir = scratch_dir("hf_slots_victim");
    let victim = victim_dir.join("precious.txt");
    std::fs::write(&victim, "precious bytes").unwrap();
    let cap = ["--max-disk-offload-blocks", "16"];

    // A symbolic link at the slot file's name: refused, the target untouched.
    let d = scratch_dir("hf_slots_link");
    std::os::unix::fs::symlink(&victim, d.join("strata-kv.slots")).unwrap();
    assert_error(STRATA, &bench_disk(&m, &d, &cap), "a symbolic link", 1);
    // A hard link: writing it would write the other name's file.
    let d = scratch_dir("hf_slots_hard");
    std::fs::hard_link(&victim, d.join("strata-kv.slots")).unwrap();
    assert_error(STRATA, &bench_disk(&m, &d, &cap), "has 2 hard links", 1);
    // A FIFO or a directory there: refused at once, no hang.
    let d = scratch_dir("hf_slots_fifo");
    mkfifo(&d.join("strata-kv.slots"));
    assert_error(STRATA, &bench_disk(&m, &d, &cap), "(a FIFO)", 1);
    let d = scratch_dir("hf_slots_dir");
    std::fs::create_dir(d.join("strata-kv.slots")).unwrap();
    assert_error(STRATA, &bench_disk(&m, &d, &cap), "(a directory)", 1);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious bytes");

    // A link at the index's temporary name: the index is not saved (a warning), the link's
    // target untouched, the run itself fine.
    let d = scratch_dir("hf_index_tmp");
    std::os::unix::fs::symlink(&victim, d.join("strata-kv.index.tmp")).unwrap();
    let r = run(STRATA, &bench_disk(&m, &d, &cap), Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stderr.contains("index not saved"), "{}", r.stderr);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious bytes");
    // A fresh slot file is private.
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(d.join("strata-kv.slots")).unwrap().mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_hostile_index_is_ignored_at_once() {
    let m = tiny("hf_index_model");
    let cap = ["--max-disk-offload-blocks", "16"];
    type Plant<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);
    let plant: [Plant; 4] = [
        (
            "link to /dev/zero",
            &|p| std::os::unix::fs::symlink("/dev/zero", p).unwrap(),
            "a symbolic link",
        ),
        ("FIFO", &|p| mkfifo(p), "(a FIFO)"),
        (
            "sparse 8 GiB",
            &|p| std::fs::File::create(p).unwrap().set_len(8 << 30).unwrap(),
            "8589934592 bytes (8.0 GiB) is more than the limit",
        ),
        (
            "directory",
            &|p| std::fs::create_dir(p).unwrap(),
            "(a directory)",
        ),
    ];
    for (i, (name, make, why)) in plant.into_iter().enumerate() {
        let d = scratch_dir(&format!("hf_index_{i}"));
        make(&d.join("strata-kv.index"));
        let r = run(STRATA, &bench_disk(&m, &d, &cap), Duration::from_secs(120));
        assert!(!r.stderr.contains("panicked"), "{name}: {}", r.stderr);
        // (A directory there cannot be replaced by the index's rename: a warning.)
        assert_eq!(r.code, Some(0), "{name}: {}", r.stderr);
        assert!(r.stderr.contains("index ignored"), "{name}: {}", r.stderr);
        assert!(r.stderr.contains(why), "{name}: {}", r.stderr);
        assert!(r.secs < 60.0, "{name}: {:.1} s", r.secs);
    }
}

// ------------------------------------------------------------------ capacity and link flags

#[test]
fn the_disk_capacity_flag_is_bounded_and_checked_against_free_space_first() {
    let m = tiny("hf_cap_model");
    let d = scratch_dir("hf_cap");
    let tier = d.join("tier");
    // Past the flag's range: a usage error.
    assert_error(
        STRATA,
        &bench_disk(&m, &tier, &["--max-disk-offload-blocks", "16777217"]),
        "16777217 is not in 0..=16777216",
        2,
    );
    assert_error(
        STRATA,
        &bench_disk(
            &m,
            &tier,
            &["--max-disk-offload-blocks", "18446744073709551615"],
        ),
        "is not in 0..=16777216",
        2,
    );
    // In range but past the file system's room (the smallest slot is 8 KiB: 128 GiB):
    // refused at once, before the plan, nothing created, no allocation proportional to it.
    if free_bytes(&d) >= 16_777_216 * 8192 {
        eprintln!("skipped: the file system has room for 128 GiB");
        return;
    }
    let r = assert_error(
        STRATA,
        &bench_disk(&m, &tier, &["--max-disk-offload-blocks", "16777216"]),
        "not enough space for the disk tier",
        1,
    );
    assert!(r.secs < 20.0, "{:.1} s", r.secs);
    assert!(!tier.exists(), "the tier's directory was created");
    // `serve`: the same before anything is bound or printed.
    let mut args = os(&["serve", "--port", "0", "--model"]);
    args.push(m.clone().into());
    args.extend(os(&[
        "--max-disk-offload-blocks",
        "16777216",
        "--disk-offload-dir",
    ]));
    args.push(tier.clone().into());
    assert_error(STRATA, &args, "not enough space for the disk tier", 1);
    assert!(!tier.exists(), "the tier's directory was created");
}

#[test]
fn link_speeds_at_the_edges_of_their_range() {
    let m = tiny("hf_link_model");
    let offload = |gbps: &str| {
        generate(
            &m,
            &os(&[
                "--prompt",
                "hello",
                "--max-tokens",
                "2",
                "--enable-offload",
                "--block-size",
                "16",
                "--sim-link-gbps",
                gbps,
            ]),
        )
    };
    // Tiny positive speeds made the copy thread's Duration overflow (a panic) or sleep for
    // years: outside the range now.
    for bad in ["1e-300", "5e-324", "0.0009", "1e6000", "1000000.1"] {
        let want = "is not 0 (unthrottled) or in 0.001..=1000000 GB/s";
        assert_error(STRATA, &offload(bad), want, 2);
    }
    // The edges themselves work, and the slowest finishes.
    for ok in ["0", "0.001", "1000000"] {
        let r = run(STRATA, &offload(ok), Duration::from_secs(120));
        assert_eq!(r.code, Some(0), "--sim-link-gbps {ok}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    }
    let mut args = os(&["bench", "serve", "--model"]);
    args.push(m.clone().into());
    args.extend(os(&["--link-gbps", "1e-300"]));
    assert_error(STRATA, &args, "is not 0 (unthrottled) or in 0.001", 2);
}

// ------------------------------------------------------------------ the CLI contract

#[test]
fn serve_validates_every_flag_before_it_binds_or_prints() {
    let m = tiny("hf_serve_model");
    let dir = scratch_dir("hf_serve_dir");
    let d = dir.to_str().unwrap();
    for (extra, expect, code) in [
        (vec!["--block-size", "0"], "0 is not in 1..=16384", 2),
        (vec!["--max-num-seqs", "0"], "0 is not in 1..=65536", 2),
        (
            vec!["--max-num-batched-tokens", "0"],
            "0 is not in 1..=16777216",
            2,
        ),
        (
            vec!["--max-pending-requests", "0"],
            "0 is not in 1..=1048576",
            2,
        ),
        (
            vec!["--shutdown-timeout", "99999999"],
            "is not in 0..=86400",
            2,
        ),
        (vec!["--api-key", ""], "--api-key", 2),
        (vec!["--host", "a b"], "not an IP address or a host name", 2),
        (vec!["--host", ""], "not an IP address or a host name", 2),
        (
            vec!["--max-num-batched-tokens", "16", "--block-size", "64"],
            "--max-num-batched-tokens (16) must be at least the prefill chunk (64)",
            2,
        ),
        (
            vec!["--num-gpu-blocks", "1", "--max-model-len", "100"],
            "--num-gpu-blocks 1 holds 16 tokens, less than --max-model-len 100",
            2,
        ),
        (
            vec!["--max-disk-offload-blocks", "8"],
            "--disk-offload-dir",
            2,
        ),
        (
            vec!["--disk-offload-dir", d],
            "--max-disk-offload-blocks",
            2,
        ),
        (
            vec![
                "--disk-offload-dir",
                d,
                "--max-disk-offload-blocks",
                "8",
                "--disk-io-threads",
                "0",
            ],
            "0 is not in 1..=64",
            2,
        ),
    ] {
        let mut args = os(&["serve", "--port", "0", "--model"]);
        args.push(m.clone().into());
        args.extend(os(&extra));
        let r = assert_error(STRATA, &args, expect, code);
        if code == 2 {
            assert!(
                r.stderr.contains("(see `strata serve --help`)"),
                "{}",
                r.stderr
            );
        }
    }
    // A model path that cannot be a model: before the port is bound.
    assert_error(
        STRATA,
        &os(&["serve", "--port", "0", "--model", "/nonexistent/model.gguf"]),
        "model not found: /nonexistent/model.gguf",
        1,
    );
    // Limits that depend on the model, from its config alone, still before the port is
    // bound: its context (512 tokens) and the host memory its KV takes (12 KiB a block).
    for (extra, expect) in [
        (
            vec!["--max-model-len", "513"],
            "--max-model-len must be between 1 and the model's context (512), got 513",
        ),
        (
            vec![
                "--num-gpu-blocks",
                "16777216",
                "--max-cpu-offload-blocks",
                "16777216",
            ],
            "of host memory",
        ),
    ] {
        let mut args = os(&["serve", "--port", "0", "--model"]);
        args.push(m.clone().into());
        args.extend(os(&extra));
        assert_error(STRATA, &args, expect, 1);
    }
}

#[test]
fn bench_serve_and_needle_print_no_plan_before_their_error() {
    let m = tiny("hf_plan_model");
    let d = scratch_dir("hf_plan");
    let victim = d.join("victim");
    std::fs::write(&victim, "x").unwrap();
    let tier = d.join("tier");
    std::fs::create_dir(&tier).unwrap();
    std::os::unix::fs::symlink(&victim, tier.join("strata-kv.slots")).unwrap();
    // Once: the plan line, then the error from opening the tier.
    assert_error(
        STRATA,
        &bench_disk(&m, &tier, &["--max-disk-offload-blocks", "8"]),
        "a symbolic link",
        1,
    );
    // Flags against each other: usage errors.
    let mut args = os(&["bench", "serve", "--model"]);
    args.push(m.clone().into());
    args.extend(os(&["--input-len", "8", "--shared-prefix", "9"]));
    assert_error(
        STRATA,
        &args,
        "--shared-prefix (9) must not exceed the shortest input (8) (see `strata bench serve --help`)",
        2,
    );
    let mut args = os(&["bench", "serve", "--model"]);
    args.push(m.clone().into());
    args.extend(os(&["--prefill-chunk", "6", "--block-size", "4"]));
    assert_error(
        STRATA,
        &args,
        "must be a positive multiple of the block size",
        2,
    );
    let needle = env!("CARGO_BIN_EXE_needle");
    let model = common::default_model_path();
    if model.exists() {
        let mut args = os(&["--model"]);
        args.push(model.into());
        args.extend(os(&["--input-len", "40", "--enable-offload"]));
        assert_error(needle, &args, "is too small", 1);
    }
    let mut args = os(&["--model"]);
    args.push(m.into());
    args.extend(os(&["--sanitize"]));
    assert_error(
        needle,
        &args,
        "add --enable-offload or --compare-offload (see `needle --help`)",
        2,
    );
}

#[test]
fn generate_with_max_tokens_zero_succeeds_with_nothing() {
    let m = tiny("hf_zero_model");
    let args = generate(&m, &os(&["--prompt", "hello", "--max-tokens", "0"]));
    let r = run(STRATA, &args, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(v["token_ids"], serde_json::json!([]), "{v}");
    assert_eq!(v["text"], "", "{v}");
    assert!(v["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    // Without --json: an empty completion (the newline that ends it).
    let mut args = os(&[
        "generate",
        "--prompt",
        "hello",
        "--max-tokens",
        "0",
        "--model",
    ]);
    args.push(m.into());
    let r = run(STRATA, &args, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(r.stdout, "\n");
}

/// A GGUF file (v3) whose metadata is `kvs` (key, type, value bytes) and no tensors.
fn gguf_with_metadata(path: &Path, kvs: &[(&str, u32, Vec<u8>)]) {
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend(0u64.to_le_bytes());
    f.extend((kvs.len() as u64).to_le_bytes());
    for (key, ty, value) in kvs {
        f.extend((key.len() as u64).to_le_bytes());
        f.extend(key.as_bytes());
        f.extend(ty.to_le_bytes());
        f.extend(value);
    }
    std::fs::write(path, f).unwrap();
}

/// A GGUF array value: element type, count, then the elements' bytes.
fn gguf_array(elem: u32, n: u64, elements: Vec<u8>) -> Vec<u8> {
    let mut v = elem.to_le_bytes().to_vec();
    v.extend(n.to_le_bytes());
    v.extend(elements);
    v
}

#[test]
fn gguf_metadata_bombs_are_refused_before_they_are_read() {
    use std::os::unix::process::CommandExt;
    let dir = scratch_dir("gguf_bombs");
    const ARRAY: u32 = 9;
    let bombs: [(&str, Vec<u8>); 3] = [
        // 64 Mi one-byte elements: candle held each as a 32-byte value (2 GiB, 40 s).
        ("u8", gguf_array(0, 64 << 20, vec![0; 64 << 20])),
        // 8 Mi empty strings (8 bytes each on disk).
        ("strings", gguf_array(8, 8 << 20, vec![0; 64 << 20])),
        // 1 Mi arrays of 16 u8 each.
        ("nested", {
            let one = gguf_array(0, 16, vec![0; 16]);
            gguf_array(ARRAY, 1 << 20, one.repeat(1 << 20))
        }),
    ];
    for (name, value) in bombs {
        let path = dir.join(format!("{name}.gguf"));
        gguf_with_metadata(&path, &[("general.bomb", ARRAY, value)]);
        // With the heap capped at 512 MiB: reading the metadata as candle does would
        // abort on a failed allocation instead of answering.
        let start = Instant::now();
        let out = unsafe {
            Command::new(STRATA)
                .args(["generate", "--prompt", "hi", "--model"])
                .arg(&path)
                .pre_exec(|| {
                    let lim = libc::rlimit {
                        rlim_cur: 512 << 20,
                        rlim_max: 512 << 20,
                    };
                    libc::setrlimit(libc::RLIMIT_DATA, &lim);
                    Ok(())
                })
                .output()
                .unwrap()
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{name}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains("would take"),
            "{name}: {stderr}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{name}: {:?}",
            start.elapsed()
        );
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn a_second_server_on_a_disk_dir_in_use_fails_before_it_says_it_listens() {
    let m = tiny("disk_in_use_model");
    let dir = scratch_dir("disk_in_use_dir");
    let args = |port: &str| {
        let mut a = os(&["serve", "--port", port, "--max-model-len", "64", "--model"]);
        a.push(m.clone().into());
        a.extend(os(&[
            "--max-disk-offload-blocks",
            "16",
            "--disk-offload-dir",
        ]));
        a.push(dir.clone().into());
        a
    };
    let mut first = Command::new(STRATA)
        .args(args("0"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its listening line, then its tier (the lock) once loaded.
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(first.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.contains("listening"), "{line}");
    let slots = dir.join("strata-kv.slots");
    let start = Instant::now();
    while !slots.exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "no slot file");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let r = assert_error(STRATA, &args("0"), "is in use by another strata process", 1);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    let _ = first.kill();
    let _ = first.wait();
}

#[test]
fn bench_offload_checks_every_trace_file_it_will_write_before_running() {
    let m = tiny("trace_out_model");
    let dir = scratch_dir("trace_out_dir");
    // The sparse row's trace goes beside --trace-out: a directory sits at its name.
    std::fs::create_dir(dir.join("t.sparse-64.json")).unwrap();
    let mut args = os(&[
        "bench",
        "offload",
        "--context",
        "256",
        "--sparse-budget",
        "64",
    ]);
    args.extend(os(&["--decode-steps", "2", "--rounds", "1", "--model"]));
    args.push(m.into());
    args.push("--trace-out".into());
    args.push(dir.join("t.json").into());
    let r = assert_error(STRATA, &args, "t.sparse-64.json", 1);
    assert!(r.secs < 10.0, "{} s", r.secs);
}
