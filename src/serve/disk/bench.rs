//! `strata bench disk`: the store's sequential write and read throughput against the file
//! system's own ceiling, `dd` with `oflag=direct` / `iflag=direct` on a file of the same
//! size and block size, measured in the same run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use super::store::{DiskStore, IoMode, StoreLayout};

#[derive(Args, Debug, Clone)]
pub struct DiskBenchArgs {
    /// Directory for the test files (removed afterwards).
    #[arg(long)]
    pub dir: PathBuf,
    /// Bytes to write and read, in MiB.
    #[arg(long, default_value_t = 1024, value_parser = crate::flags::bench_disk_mib())]
    pub size_mib: usize,
    /// Payload bytes per slot [default: one SmolLM2-135M KV block of 16 tokens in f32]
    #[arg(long, default_value_t = 737_280, value_parser = crate::flags::payload_bytes())]
    pub payload_bytes: usize,
    /// IO threads.
    #[arg(long, default_value_t = 4, value_parser = crate::flags::io_threads())]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Seconds to write or read every slot once, `threads` slots in flight.
fn pass(store: &Arc<DiskStore>, threads: usize, write: bool) -> Result<f64> {
    let n = store.layout().num_slots;
    let next = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|w| {
            let (store, next) = (Arc::clone(store), Arc::clone(&next));
            std::thread::spawn(move || -> Result<()> {
                let mut buf = store.slot_buffer()?;
                for (i, b) in store.payload_mut(&mut buf).iter_mut().enumerate() {
                    *b = (i * 7 + w) as u8;
                }
                loop {
                    let slot = next.fetch_add(1, Ordering::Relaxed);
                    if slot >= n {
                        return Ok(());
                    }
                    if write {
                        store.write_slot(slot as u32, slot as u64, &mut buf)?;
                    } else {
                        store.read_slot(slot as u32, slot as u64, &mut buf)?;
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("IO thread panicked"))??;
    }
    if write {
        store.sync_data()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Runs `dd` and returns its elapsed seconds (from its own report).
fn dd(args: &[String]) -> Result<f64> {
    let out = Command::new("dd")
        .args(args)
        .output()
        .context("running dd")?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "dd {args:?} failed: {err}");
    // "... bytes (...) copied, 0.812 s, 1.3 GB/s"
    let secs = err
        .lines()
        .find_map(|l| l.split_once("copied, "))
        .and_then(|(_, rest)| rest.split_once(" s"))
        .and_then(|(secs, _)| secs.trim().parse::<f64>().ok())
        .with_context(|| format!("cannot read dd's report: {err}"))?;
    Ok(secs)
}

pub fn run_disk_bench(a: DiskBenchArgs) -> Result<()> {
    ensure!(
        a.size_mib > 0 && a.payload_bytes > 0,
        "--size-mib and --payload-bytes must be > 0"
    );
    ensure!((1..=64).contains(&a.threads), "--threads must be in 1..=64");
    let probe = StoreLayout {
        payload_bytes: a.payload_bytes,
        num_slots: 1,
    };
    // Both bounded by their flags: 16 TiB in bytes is far inside 64 bits.
    let num_slots = a.size_mib.saturating_mul(1 << 20) / probe.slot_bytes();
    if num_slots == 0 {
        return Err(crate::errors::usage(format!(
            "--size-mib {} is smaller than one slot ({} bytes for --payload-bytes {})",
            a.size_mib,
            probe.slot_bytes(),
            a.payload_bytes
        )));
    }
    let layout = StoreLayout {
        payload_bytes: a.payload_bytes,
        num_slots,
    };
    let dir = a
        .dir
        .join(format!("strata-bench-disk-{}", std::process::id()));
    let result = measure(&dir, layout, a.threads);
    let _ = std::fs::remove_dir_all(&dir);
    let m = result?;
    let bytes = layout
        .file_bytes()
        .context("the test file's size overflows")?;
    let gb = bytes as f64 / 1e9;
    let r = |x: f64, y: f64| x / y;
    let (sw, sr, dw, dr) = (
        gb / m.store_write,
        gb / m.store_read,
        gb / m.dd_write,
        gb / m.dd_read,
    );
    if a.json {
        crate::outln!(
            "{}",
            serde_json::json!({
                "bytes": bytes, "slot_bytes": layout.slot_bytes(),
                "threads": a.threads, "io_mode": m.mode, "file_system": m.fs,
                "store_write_gbps": sw, "store_read_gbps": sr,
                "dd_write_gbps": dw, "dd_read_gbps": dr,
                "write_ratio": r(sw, dw), "read_ratio": r(sr, dr),
            })
        )?;
    } else {
        crate::outln!(
            "{:.2} GB in {} slots of {} B on {} ({}), {} IO threads",
            gb,
            num_slots,
            layout.slot_bytes(),
            m.fs,
            m.mode,
            a.threads
        )?;
        crate::outln!("| | store GB/s | dd direct GB/s | ratio |")?;
        crate::outln!("|---|---|---|---|")?;
        crate::outln!(
            "| sequential write (+fdatasync) | {sw:.2} | {dw:.2} | {:.2} |",
            r(sw, dw)
        )?;
        crate::outln!(
            "| sequential read (checksummed) | {sr:.2} | {dr:.2} | {:.2} |",
            r(sr, dr)
        )?;
    }
    Ok(())
}

struct Measured {
    store_write: f64,
    store_read: f64,
    dd_write: f64,
    dd_read: f64,
    mode: String,
    fs: String,
}

fn measure(dir: &Path, layout: StoreLayout, threads: usize) -> Result<Measured> {
    std::fs::create_dir_all(dir)?;
    let store = Arc::new(DiskStore::open(dir, layout, 0, |io| io)?);
    let mode = match store.io_mode() {
        IoMode::Direct => "O_DIRECT".to_string(),
        IoMode::Buffered { reason } => format!("buffered: {reason}"),
    };
    let fs = super::store::fs_name(dir);
    // Everything is checked (flags, space, the file): say what the next seconds do.
    eprintln!(
        "strata bench disk: {} slots of {} B ({:.2} GB) on {fs} ({mode}): store write, store \
         read, then dd write and read",
        layout.num_slots,
        layout.slot_bytes(),
        layout.file_bytes().unwrap_or(u64::MAX) as f64 / 1e9
    );
    let store_write = pass(&store, threads, true)?;
    let store_read = pass(&store, threads, false)?;
    let slots_file = store.path().to_path_buf();
    drop(store);
    // dd's file takes the same room: the store's goes first (only one was checked for).
    std::fs::remove_file(&slots_file)?;
    let f = dir.join("dd.bin");
    let bs = format!("bs={}", layout.slot_bytes());
    let count = format!("count={}", layout.num_slots);
    let of = format!("of={}", f.display());
    let iff = format!("if={}", f.display());
    let dd_write = dd(&[
        "if=/dev/zero".into(),
        of,
        bs.clone(),
        count.clone(),
        "oflag=direct".into(),
        "conv=fdatasync".into(),
    ])?;
    let dd_read = dd(&[iff, "of=/dev/null".into(), bs, count, "iflag=direct".into()])?;
    if dd_write <= 0.0 || dd_read <= 0.0 {
        bail!("dd reported no time");
    }
    Ok(Measured {
        store_write,
        store_read,
        dd_write,
        dd_read,
        mode,
        fs,
    })
}
