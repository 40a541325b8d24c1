//! The disk tier: the slot store's integrity checks under injected faults (the three-tier
//! scheduler property test is tests/serve_scheduler.rs's, parametrised by tiers), bitwise
//! accuracy with a tiny host tier and a disk tier, engine
//! runs under random disk faults, and the prefix cache surviving a restart (new processes).

mod common;

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{scratch_dir, serve_requests as requests, TinySpec, KV_DTYPES};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::KvDtype;
use strata::model::Model;
use strata::serve::block_key::BlockKey;
use strata::serve::cache_events::{CacheEvent, KvGroup, Medium};
use strata::serve::disk::store::{DiskStore, IoMode, SlotError, SlotIo, StoreLayout, ALIGN};
use strata::serve::disk::DiskTierConfig;
use strata::serve::scheduler::SchedulerConfig;
use strata::serve::{Engine, EngineConfig, RequestParams};

// ---------------------------------------------------------------- faults below the store

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    FlipByte,
    ShortRead,
    TornWrite,
    LostWrite,
    ShortWrite,
    Enospc,
    Eio,
    Slow,
}

/// A `SlotIo` that injects one planned fault per call (`plan`), else a random one with
/// probability `p` (`seeded`), and counts what it injected.
struct ChaosIo {
    inner: Box<dyn SlotIo>,
    rng: Mutex<StdRng>,
    p: f64,
    plan: Mutex<Vec<Fault>>,
    injected: Arc<AtomicUsize>,
}

impl ChaosIo {
    fn new(inner: Box<dyn SlotIo>, seed: u64, p: f64, injected: Arc<AtomicUsize>) -> Self {
        Self {
            inner,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            p,
            plan: Mutex::new(Vec::new()),
            injected,
        }
    }

    fn next(&self, reading: bool) -> Fault {
        if let Some(f) = self.plan.lock().unwrap().pop() {
            return f;
        }
        let mut rng = self.rng.lock().unwrap();
        if !rng.random_bool(self.p) {
            return Fault::None;
        }
        let choices: &[Fault] = if reading {
            &[Fault::FlipByte, Fault::ShortRead, Fault::Eio, Fault::Slow]
        } else {
            &[
                Fault::TornWrite,
                Fault::LostWrite,
                Fault::ShortWrite,
                Fault::Enospc,
                Fault::Eio,
                Fault::Slow,
            ]
        };
        choices[rng.random_range(0..choices.len())]
    }
}

fn os_err(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl SlotIo for ChaosIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let f = self.next(true);
        if f != Fault::None && f != Fault::Slow {
            self.injected.fetch_add(1, Ordering::SeqCst);
        }
        match f {
            Fault::Eio => Err(os_err(libc::EIO)),
            Fault::Slow => {
                std::thread::sleep(Duration::from_millis(3));
                self.inner.read_at(buf, offset)
            }
            Fault::ShortRead => Ok(self.inner.read_at(buf, offset)? / 2),
            Fault::FlipByte => {
                let n = self.inner.read_at(buf, offset)?;
                // A byte the check covers: the header, or the payload's first page.
                let at = self
                    .rng
                    .lock()
                    .unwrap()
                    .random_range(0..2 * ALIGN)
                    .min(n - 1);
                let at = if at < ALIGN { at % 48 } else { at };
                buf[at] ^= 0x10;
                Ok(n)
            }
            _ => self.inner.read_at(buf, offset),
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let f = self.next(false);
        if f != Fault::None && f != Fault::Slow {
            self.injected.fetch_add(1, Ordering::SeqCst);
        }
        match f {
            Fault::Enospc => Err(os_err(libc::ENOSPC)),
            Fault::Eio => Err(os_err(libc::EIO)),
            Fault::Slow => {
                std::thread::sleep(Duration::from_millis(3));
                self.inner.write_at(buf, offset)
            }
            // The device reports success, but only the first half reached it (a crash
            // mid-write), or nothing did (a lost write: the old slot content stays).
            Fault::TornWrite => {
                self.inner.write_at(&buf[..buf.len() / 2], offset)?;
                Ok(buf.len())
            }
            Fault::LostWrite => Ok(buf.len()),
            Fault::ShortWrite => self.inner.write_at(&buf[..buf.len() / 2], offset),
            _ => self.inner.write_at(buf, offset),
        }
    }

    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }
}

// ---------------------------------------------------------------- the store alone

const LAYOUT: StoreLayout = StoreLayout {
    payload_bytes: 3 * ALIGN + 100,
    num_slots: 8,
};

fn fill(store: &DiskStore, seed: u8) -> strata::serve::disk::store::AlignedBuf {
    let mut buf = store.slot_buffer().unwrap();
    for (i, b) in store.payload_mut(&mut buf).iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    buf
}

#[test]
fn store_round_trips_and_rejects_every_injected_fault() {
    let dir = scratch_dir("disk_store_faults");
    let injected = Arc::new(AtomicUsize::new(0));
    let plan = Arc::new(Mutex::new(Vec::<Fault>::new()));
    let plan2 = Arc::clone(&plan);
    let inj = Arc::clone(&injected);
    let store = DiskStore::open(&dir, LAYOUT, 42, move |io| {
        Box::new(PlannedIo {
            chaos: ChaosIo::new(io, 0, 0.0, inj),
            plan: plan2,
        })
    })
    .unwrap();
    assert_eq!(
        std::fs::metadata(dir.join("strata-kv.slots"))
            .unwrap()
            .len(),
        LAYOUT.file_bytes().unwrap()
    );

    // A clean round trip.
    let mut w = fill(&store, 1);
    store.write_slot(3, 77, &mut w).unwrap();
    let mut r = store.slot_buffer().unwrap();
    store.read_slot(3, 77, &mut r).unwrap();
    assert_eq!(store.payload(&r), store.payload(&w));
    // The wrong key is never served.
    assert!(matches!(
        store.read_slot(3, 78, &mut r),
        Err(SlotError::Integrity { .. })
    ));

    // Each fault, planned on the next write (w) or read (r): never served as good data.
    let cases = [
        (Fault::FlipByte, 'r', "integrity"),
        (Fault::ShortRead, 'r', "io"),
        (Fault::Eio, 'r', "io"),
        (Fault::TornWrite, 'w', "integrity"),
        (Fault::LostWrite, 'w', "integrity"),
        (Fault::ShortWrite, 'w', "io-write"),
        (Fault::Enospc, 'w', "io-write"),
        (Fault::Eio, 'w', "io-write"),
    ];
    for (i, &(fault, when, expect)) in cases.iter().enumerate() {
        let seed = 10 + i as u8;
        // An older, different content of the slot: a lost write must not bring it back.
        let mut old = fill(&store, seed.wrapping_add(100));
        store.write_slot(5, 500, &mut old).unwrap();
        let mut w = fill(&store, seed);
        if when == 'w' {
            plan.lock().unwrap().push(fault);
        }
        let wrote = store.write_slot(5, 500, &mut w);
        if expect == "io-write" {
            assert!(wrote.is_err(), "{fault:?}: write reported success");
        } else {
            wrote.unwrap();
        }
        if when == 'r' {
            plan.lock().unwrap().push(fault);
        }
        let mut r = store.slot_buffer().unwrap();
        let got = store.read_slot(5, 500, &mut r);
        match expect {
            "integrity" => assert!(
                matches!(got, Err(SlotError::Integrity { .. })),
                "{fault:?}: {got:?}"
            ),
            "io" => assert!(
                matches!(got, Err(SlotError::Io(_) | SlotError::Short { .. })),
                "{fault:?}: {got:?}"
            ),
            // A failed write leaves the slot untrusted: nothing is read from it.
            _ => assert!(
                matches!(got, Err(SlotError::Unknown(5))),
                "{fault:?}: {got:?}"
            ),
        }
    }
    let st = store.stats();
    assert_eq!(injected.load(Ordering::SeqCst), cases.len());
    assert_eq!(st.checksum_failures, 1 + 3, "{st:?}"); // wrong key, flip, torn, lost
    assert_eq!(st.io_errors, 2 + 3, "{st:?}");
    // The clean slot is still good.
    store.read_slot(3, 77, &mut r).unwrap();
    assert_eq!(store.payload(&r), store.payload(&fill(&store, 1)));
}

/// ChaosIo with an explicit plan shared with the test.
struct PlannedIo {
    chaos: ChaosIo,
    plan: Arc<Mutex<Vec<Fault>>>,
}

impl SlotIo for PlannedIo {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if let Some(f) = self.plan.lock().unwrap().pop() {
            self.chaos.plan.lock().unwrap().push(f);
        }
        self.chaos.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        if let Some(f) = self.plan.lock().unwrap().pop() {
            self.chaos.plan.lock().unwrap().push(f);
        }
        self.chaos.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.chaos.sync_data()
    }
}

#[test]
fn one_process_per_directory_and_tmpfs_falls_back_to_buffered_io_reported() {
    let dir = scratch_dir("disk_store_lock");
    let a = DiskStore::open(&dir, LAYOUT, 1, |io| io).unwrap();
    let e = DiskStore::open(&dir, LAYOUT, 1, |io| io).err().unwrap();
    assert!(format!("{e:#}").contains("in use"), "{e:#}");
    drop(a);
    DiskStore::open(&dir, LAYOUT, 1, |io| io).unwrap();
    // tmpfs refused O_DIRECT before Linux 6.6: either way the store works, and a
    // fallback names the file system it happened on.
    let shm = Path::new("/dev/shm");
    if strata::serve::disk::store::fs_name(shm) == "tmpfs" {
        let d = shm.join(format!("strata-disk-test-{}", std::process::id()));
        let s = DiskStore::open(&d, LAYOUT, 1, |io| io).unwrap();
        if let IoMode::Buffered { reason } = s.io_mode() {
            assert!(reason.contains("tmpfs"), "{reason}");
        }
        let mut w = fill(&s, 3);
        s.write_slot(0, 9, &mut w).unwrap();
        let mut r = s.slot_buffer().unwrap();
        s.read_slot(0, 9, &mut r).unwrap();
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }
}

// ---------------------------------------------------------------- the engine

fn tiny_model(name: &str) -> (Arc<Model>, std::path::PathBuf) {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 7);
    (Model::load(&dir, false).unwrap().0, dir)
}

fn config(gpu: usize, cpu: usize, disk: Option<(&Path, usize)>) -> EngineConfig {
    config_kv(KvDtype::F32, gpu, cpu, disk)
}

fn config_kv(
    kv_dtype: KvDtype,
    gpu: usize,
    cpu: usize,
    disk: Option<(&Path, usize)>,
) -> EngineConfig {
    EngineConfig {
        kv_dtype,
        sched: SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: gpu,
            max_cpu_offload_blocks: cpu,
            max_disk_offload_blocks: disk.map_or(0, |d| d.1),
            max_num_seqs: 16,
            max_num_batched_tokens: 16,
            prefill_chunk: 8,
        },
        link_gbps: 0.0,
        sanitize: false,
        check_order: strata::device::order::on_by_default(),
        disk: disk.map(|(dir, _)| DiskTierConfig {
            dir: dir.to_path_buf(),
            io_threads: 3,
        }),
    }
}

fn working_set(p: &[Vec<u32>], r: &[RequestParams]) -> usize {
    p.iter()
        .zip(r)
        .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(4))
        .sum()
}

fn assert_all_free(e: &Engine) {
    let bm = &e.scheduler().bm;
    e.scheduler().check().unwrap();
    assert_eq!(bm.available_pages(), bm.num_pages(), "pages leaked");
    assert_eq!(bm.free_slots(), bm.num_slots(), "host slots leaked");
    assert_eq!(
        bm.free_disk_slots() + bm.num_persisted(),
        bm.num_disk_slots(),
        "disk slots leaked"
    );
}

/// Runs `prompts` unconstrained and on `gpu` pages, `host` host slots and a disk tier, in
/// KV elements `kv`; every token and log-prob must be bitwise equal. Returns the
/// constrained run's stats.
fn bitwise_equal_with_disk(
    model: &Arc<Model>,
    kv: KvDtype,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
    gpu: usize,
    host: usize,
) -> strata::serve::EngineStats {
    let ws = working_set(prompts, params);
    let want = Engine::new(model.clone(), config_kv(kv, ws, 0, None))
        .unwrap()
        .generate_with_logprobs(prompts, params)
        .unwrap();
    let dir = scratch_dir(&format!("disk_accuracy_{gpu}_{host}_{kv}"));
    let cfg = config_kv(kv, gpu, host, Some((&dir, 400)));
    let mut e = Engine::new(model.clone(), cfg).unwrap();
    let got = e.generate_with_logprobs(prompts, params).unwrap();
    let st = e.stats();
    assert!(
        st.sched.blocks_stored_disk > 0 && st.sched.blocks_loaded_disk > 0,
        "host {host}: {st:?}"
    );
    assert_eq!(st.disk.checksum_failures + st.disk.io_errors, 0, "{st:?}");
    assert_eq!(st.sched.recomputations, 0, "host {host}: {st:?}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "{kv} host {host}: request {i} tokens differ");
        assert_eq!(g.1, w.1, "{kv} host {host}: request {i} log-probs differ");
    }
    assert_all_free(&e);
    st
}

#[test]
fn a_tiny_host_tier_with_a_disk_tier_matches_the_unconstrained_run_bitwise() {
    // Host slots for 2 blocks: victims go straight to disk.
    let (model, _) = tiny_model("disk_accuracy_model");
    let (prompts, params) = requests(31, 8, 16);
    let ws = working_set(&prompts, &params);
    assert!((ws / 3) * 4 >= 70 + 40);
    for kv in KV_DTYPES {
        let st = bitwise_equal_with_disk(&model, kv, &prompts, &params, ws / 3, 2);
        assert!(st.sched.prefix_blocks_persisted > 0, "{kv}: {st:?}");
    }
}

/// Six requests of 8 prompt tokens that decode to 12 blocks each (48 tokens): on 24 pages
/// decode growth preempts repeatedly; 12 host slots hold one victim, so the next victim
/// finds the host tier full and the older one is demoted to disk.
fn decode_growth_requests() -> (Vec<Vec<u32>>, Vec<RequestParams>) {
    let mut rng = StdRng::seed_from_u64(61);
    let prompts = (0..6)
        .map(|_| (0..8).map(|_| rng.random_range(3..300)).collect())
        .collect();
    let params = RequestParams {
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    (prompts, vec![params; 6])
}

#[test]
fn demotions_from_a_full_host_tier_match_the_unconstrained_run_bitwise() {
    let (model, _) = tiny_model("disk_demote_model");
    let (prompts, params) = decode_growth_requests();
    for kv in KV_DTYPES {
        let st = bitwise_equal_with_disk(&model, kv, &prompts, &params, 24, 12);
        assert!(st.sched.blocks_demoted > 0, "{kv}: no demotion: {st:?}");
    }
}

#[test]
fn random_disk_faults_never_change_a_token_and_are_counted() {
    let (model, _) = tiny_model("disk_faults_model");
    let (prompts, params) = requests(41, 8, 8);
    let ws = working_set(&prompts, &params);
    let want = Engine::new(model.clone(), config(ws, 0, None))
        .unwrap()
        .generate_with_logprobs(&prompts, &params)
        .unwrap();
    let mut fallbacks = 0;
    for seed in 0..6u64 {
        let dir = scratch_dir(&format!("disk_faults_{seed}"));
        let injected = Arc::new(AtomicUsize::new(0));
        let inj = Arc::clone(&injected);
        // Half the runs with a host tier that can demote to disk (faults may hit them).
        let host = if seed % 2 == 0 { 1 } else { ws / 10 };
        let cfg = config(ws / 3, host, Some((&dir, 400)));
        let mut e = Engine::with_disk_io(model.clone(), cfg, move |io| {
            Box::new(ChaosIo::new(io, seed, 0.3, inj))
        })
        .unwrap();
        let got = e.generate_with_logprobs(&prompts, &params).unwrap();
        let st = e.stats();
        assert!(
            injected.load(Ordering::SeqCst) > 0,
            "seed {seed}: no fault injected"
        );
        assert!(
            st.disk.checksum_failures + st.disk.io_errors > 0,
            "seed {seed}: faults not counted: {st:?}"
        );
        fallbacks += st.sched.disk_load_failures + st.sched.failed_jobs;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "seed {seed}: request {i} differs");
        }
        assert_all_free(&e);
    }
    assert!(fallbacks > 0);
}

/// A disk whose every write fails (EIO): reads and syncs pass through.
struct WritesFail(Box<dyn SlotIo>);

impl SlotIo for WritesFail {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, _buf: &[u8], _offset: u64) -> io::Result<usize> {
        Err(os_err(5))
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

#[test]
fn failed_demotions_fall_back_to_recomputation_without_a_wrong_token() {
    // The demotion test's workload; every disk write fails, so every demotion fails: its
    // request recomputes (spills and write-throughs fail too: blocks stay on the GPU).
    let (model, _) = tiny_model("disk_demote_fail_model");
    let (prompts, params) = decode_growth_requests();
    let ws = working_set(&prompts, &params);
    let want = Engine::new(model.clone(), config(ws, 0, None))
        .unwrap()
        .generate_with_logprobs(&prompts, &params)
        .unwrap();
    let dir = scratch_dir("disk_demote_fail");
    let cfg = config(24, 12, Some((&dir, 400)));
    let mut e = Engine::with_disk_io(model, cfg, |io| Box::new(WritesFail(io))).unwrap();
    let got = e.generate_with_logprobs(&prompts, &params).unwrap();
    let st = e.stats();
    assert!(
        st.sched.demotion_failures > 0,
        "no demotion was tried: {st:?}"
    );
    assert_eq!(
        st.sched.blocks_demoted + st.sched.blocks_stored_disk,
        0,
        "{st:?}"
    );
    assert!(
        st.sched.recomputations >= st.sched.demotion_failures,
        "{st:?}"
    );
    assert!(st.disk.io_errors > 0, "{st:?}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs");
    }
    assert_all_free(&e);
}

#[test]
fn a_slot_file_truncated_under_the_engine_falls_back_to_recomputation() {
    // Once blocks are on disk the file is truncated: their reads come back short; the
    // requests recompute and the engine keeps going.
    let (model, _) = tiny_model("disk_truncated_model");
    let (prompts, params) = requests(51, 6, 0);
    let ws = working_set(&prompts, &params);
    let want = Engine::new(model.clone(), config(ws, 0, None))
        .unwrap()
        .generate(&prompts, &params)
        .unwrap();
    let dir = scratch_dir("disk_truncated");
    let mut e = Engine::new(model, config(ws / 3, 1, Some((&dir, 200)))).unwrap();
    let rxs: Vec<_> = prompts
        .iter()
        .zip(&params)
        .map(|(p, r)| e.submit(p.clone(), r).unwrap().1)
        .collect();
    let mut truncated = false;
    while e.has_unfinished() {
        e.step().unwrap();
        if !truncated && e.stats().sched.blocks_stored_disk > 0 {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("strata-kv.slots"))
                .unwrap();
            f.set_len(0).unwrap();
            truncated = true;
        }
    }
    e.drain_transfers().unwrap();
    let got: Vec<Vec<u32>> = rxs.iter().map(|rx| rx.try_iter().collect()).collect();
    let st = e.stats();
    assert!(truncated);
    assert_eq!(got, want);
    // Short reads (past the end) or zeros (a hole under a later write) fail the check.
    assert!(st.sched.disk_load_failures > 0, "{st:?}");
    assert!(st.disk.io_errors + st.disk.checksum_failures > 0, "{st:?}");
    assert!(st.sched.recomputations > 0, "{st:?}");
    assert_all_free(&e);
}

// ---------------------------------------------------------------- restart (new processes)

fn bench_tiny(model: &Path, dir: &Path, block_size: &str) -> serde_json::Value {
    bench_tiny_kv(model, dir, block_size, KvDtype::F32)
}

fn bench_tiny_kv(model: &Path, dir: &Path, block_size: &str, kv: KvDtype) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "serve", "--kv-dtype", kv.name(), "--model"])
        .arg(model)
        .args([
            "--num-seqs",
            "3",
            "--input-len",
            "60:70",
            "--output-len",
            "4",
            "--shared-prefix",
            "56",
            "--block-size",
            block_size,
            "--prefill-chunk",
            "8",
            "--max-num-batched-tokens",
            "8",
            "--max-disk-offload-blocks",
            "64",
            "--compare",
            "--json",
            "--disk-offload-dir",
        ])
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap()
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[test]
fn the_prefix_cache_survives_a_restart_and_corruption_is_ignored() {
    let (_, model) = tiny_model("disk_restart_model");
    let dir = scratch_dir("disk_restart");
    let first = bench_tiny(&model, &dir, "4");
    assert_eq!(u(&first, "compare_mismatches"), 0);
    assert_eq!(u(&first, "restored_prefix_blocks"), 0);
    assert!(u(&first, "prefix_blocks_persisted") >= 14, "{first}");
    // A new process on the same directory: the shared prefix comes from disk.
    let second = bench_tiny(&model, &dir, "4");
    assert_eq!(u(&second, "compare_mismatches"), 0);
    assert!(u(&second, "restored_prefix_blocks") >= 14, "{second}");
    assert!(u(&second, "prefix_blocks_from_disk") >= 12, "{second}");
    assert!(
        u(&second, "computed_tokens") + 40 <= u(&first, "computed_tokens"),
        "prefill did not drop: {first} {second}"
    );
    assert_eq!(u(&second, "checksum_failures"), 0);

    // A crash mid-write tore a persisted slot: detected, never used, tokens still exact.
    let slots = dir.join("strata-kv.slots");
    let mut bytes = std::fs::read(&slots).unwrap();
    let slot_bytes = bytes.len() / 64;
    for s in 0..64 {
        let at = s * slot_bytes + ALIGN + 100; // every slot's payload
        bytes[at] ^= 0xff;
    }
    std::fs::write(&slots, &bytes).unwrap();
    let torn = bench_tiny(&model, &dir, "4");
    assert_eq!(u(&torn, "compare_mismatches"), 0);
    assert!(u(&torn, "checksum_failures") > 0, "{torn}");
    assert_eq!(u(&torn, "prefix_blocks_from_disk"), 0, "{torn}");

    // The same directory with a torn index (crash during the index write): ignored.
    // (the torn run wrote its blocks through again: the index is good once more)
    let run = bench_tiny(&model, &dir, "4");
    assert!(u(&run, "restored_prefix_blocks") >= 14, "{run}");
    let index = dir.join("strata-kv.index");
    let text = std::fs::read(&index).unwrap();
    std::fs::write(&index, &text[..text.len() / 2]).unwrap();
    let after = bench_tiny(&model, &dir, "4");
    assert_eq!(u(&after, "compare_mismatches"), 0);
    assert_eq!(u(&after, "restored_prefix_blocks"), 0, "{after}");

    // Another block size (so another fingerprint and layout) never matches.
    bench_tiny(&model, &dir, "4");
    let other = bench_tiny(&model, &dir, "8");
    assert_eq!(u(&other, "restored_prefix_blocks"), 0, "{other}");
    assert_eq!(u(&other, "compare_mismatches"), 0);

    // Nor another KV element (a bf16 block is half an f32 block's bytes, an f16 block
    // as many as a bf16 one: the fingerprint names the element); each restores its own.
    bench_tiny(&model, &dir, "4");
    for kv in [KvDtype::Bf16, KvDtype::F16] {
        let other = bench_tiny_kv(&model, &dir, "4", kv);
        assert_eq!(u(&other, "restored_prefix_blocks"), 0, "{kv}: {other}");
        assert_eq!(u(&other, "compare_mismatches"), 0);
        let again = bench_tiny_kv(&model, &dir, "4", kv);
        assert!(u(&again, "restored_prefix_blocks") >= 14, "{kv}: {again}");
        assert_eq!(u(&again, "compare_mismatches"), 0);
    }
}

#[test]
fn a_restarted_engine_announces_the_blocks_it_restored_from_disk() {
    // The first engine computes two prompts (every full block is written through); a
    // second one on the same directory announces each restored block (medium DISK) with
    // its parent and tokens as soon as a consumer starts recording, before any request,
    // so a router learns at start-up what this instance can serve from disk.
    let (model, _) = tiny_model("disk_announce_model");
    let dir = scratch_dir("disk_announce");
    let prompts: Vec<Vec<u32>> = vec![(3..30).collect(), (3..19).chain(40..51).collect()];
    let params = vec![
        RequestParams {
            max_tokens: 5,
            ignore_eos: true,
            ..Default::default()
        };
        2
    ];
    let mut first = Engine::new(model.clone(), config(64, 0, Some((&dir, 64)))).unwrap();
    first.generate_with_logprobs(&prompts, &params).unwrap();
    let persisted = first.stats().sched.prefix_blocks_persisted;
    assert!(persisted >= 10, "{:?}", first.stats());
    drop(first); // writes the last index

    let mut second = Engine::new(model.clone(), config(64, 0, Some((&dir, 64)))).unwrap();
    assert_eq!(second.stats().restored_prefix_blocks, persisted);
    second.record_cache_events();
    let mut announced = HashMap::new(); // hash → (parent, tokens)
    for e in second.take_cache_events() {
        let CacheEvent::Stored {
            medium: Medium::Disk,
            group: KvGroup::Full,
            parent,
            hashes,
            tokens,
        } = e
        else {
            panic!("at start-up only restored disk blocks are announced: {e:?}");
        };
        let mut prev = parent;
        for (h, t) in hashes.iter().zip(tokens.chunks(4)) {
            assert_eq!(
                BlockKey::chained(second.scheduler().key_seed(), prev.as_ref(), t),
                *h,
                "an announced block's hash is not its parent's and tokens'"
            );
            announced.insert(*h, (prev, t.to_vec()));
            prev = Some(*h);
        }
    }
    assert_eq!(announced.len(), persisted, "every restored block, once");
    // Each prompt's full blocks are among them, chained from the first.
    for p in &prompts {
        let mut prev = None;
        for t in p.chunks_exact(4) {
            let h = BlockKey::chained(second.scheduler().key_seed(), prev.as_ref(), t);
            assert_eq!(announced.get(&h), Some(&(prev, t.to_vec())), "{p:?}");
            prev = Some(h);
        }
    }
}

#[test]
fn bad_disk_options_are_one_line_errors() {
    let (_, model) = tiny_model("disk_cli_model");
    let blocked = scratch_dir("disk_cli").join("a-file");
    std::fs::write(&blocked, b"not a directory").unwrap();
    // Usage errors (flags that need each other, a value out of range) exit 2; a directory
    // that cannot be one exits 1. Either way: one line.
    let cases: [(&[&str], &str, i32); 4] = [
        (&["--max-disk-offload-blocks", "8"], "--disk-offload-dir", 2),
        (
            &["--disk-offload-dir", "/tmp/x"],
            "--max-disk-offload-blocks",
            2,
        ),
        (
            &[
                "--disk-offload-dir",
                "/tmp/x",
                "--max-disk-offload-blocks",
                "8",
                "--disk-io-threads",
                "0",
            ],
            "--disk-io-threads",
            2,
        ),
        (
            &[
                "--disk-offload-dir",
                blocked.to_str().unwrap(),
                "--max-disk-offload-blocks",
                "8",
            ],
            ": not a directory",
            1,
        ),
    ];
    for (args, want, code) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["bench", "serve", "--model"])
            .arg(&model)
            .args(["--num-seqs", "1", "--input-len", "8", "--output-len", "2"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert!(
            lines.len() == 1 && lines[0].starts_with("error:") && lines[0].contains(want),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
