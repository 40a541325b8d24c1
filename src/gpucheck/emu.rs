//! Runs the real `kernels/*.cu` on the CPU, so machines without a GPU (CI) test the kernel
//! code itself, its launch configuration and its argument list, not only a Rust twin.
//!
//! The `.cu` sources (embedded by `build.rs`) are compiled by the system C++ compiler
//! against `emu/shim.h`, which maps the CUDA device language onto C++, and linked with
//! `emu/core.cpp`, which runs every CUDA thread of a block as a fiber that yields at
//! `__syncthreads` and at warp shuffles (see those files for what is and is not
//! emulated). The library is built once per source hash into the kernel cache directory
//! and loaded with `libloading`.
//!
//! `EmuExec` is an `Exec` whose memory is host pages (each allocation ending at a
//! no-access page) and whose kernels are these: the CUDA model's layer loop and gpu-check
//! steps 1-3 run on it. GEMMs stay on the host twin (cuBLAS has no source to emulate).

use crate::device::bf16::{bf16_to_f32, f32_to_bf16};
use crate::device::cuda::exec::{Buf, Exec};
use crate::device::cuda::nvrtc::{Fnv, HEADERS, SOURCES};
use crate::device::cuda::ops::{GemmOut, GemmShape, KArg, Launch, KERNELS};
use crate::device::DevPtr;
use anyhow::{anyhow, bail, Context, Result};
use half::bf16;
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};

const SHIM: &str = include_str!("../../emu/shim.h");
const CORE: &str = include_str!("../../emu/core.cpp");
const LINKER_SCRIPT: &str = include_str!("../../emu/shared.ld");
const CXXFLAGS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-ffp-contract=off",
    "-fPIC",
    "-Wno-unknown-pragmas",
];

type LaunchFn = unsafe extern "C" fn(
    name: *const c_char,
    signature: *const c_char,
    grid: *const u32,
    block: *const u32,
    shared_bytes: u32,
    args: *mut *mut c_void,
    err: *mut c_char,
    err_len: usize,
) -> i32;

/// The loaded emulator library.
pub struct Emulator {
    launch: LaunchFn,
    _lib: libloading::Library,
}

/// Extra kernels for a test of the emulator itself: (file name, source, kernel names).
/// The source may include `common.cuh`.
pub type ExtraUnit<'a> = (&'a str, &'a str, &'a [&'a str]);

/// The process-wide emulator of `kernels/*.cu`, built on first use.
pub fn emulator() -> Result<Arc<Emulator>> {
    static EMU: OnceLock<std::result::Result<Arc<Emulator>, String>> = OnceLock::new();
    EMU.get_or_init(|| {
        Emulator::load(&[])
            .map(Arc::new)
            .map_err(|e| format!("{e:#}"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

impl Emulator {
    /// An emulator of `kernels/*.cu` plus `extra` (a library of its own).
    pub fn load(extra: &[ExtraUnit]) -> Result<Self> {
        let path = build(extra)?;
        // SAFETY: our own library, built just above; its initialisers only fill the
        // kernel registry.
        let lib = unsafe { libloading::Library::new(&path) }
            .with_context(|| format!("loading the kernel emulator {}", path.display()))?;
        // SAFETY: the symbol has exactly this signature in emu/core.cpp.
        let launch = unsafe { *lib.get::<LaunchFn>(b"kemu_launch\0")? };
        Ok(Self { launch, _lib: lib })
    }

    /// Runs `l` to completion on the calling thread (launches are serialised).
    pub fn launch(&self, l: &Launch) -> Result<()> {
        // One pointer per parameter, as cuLaunchKernel takes them; they point into `l`.
        let mut sig = String::new();
        let mut args: Vec<*mut c_void> = l
            .args
            .iter()
            .map(|a| match a {
                KArg::Ptr(p) => {
                    sig.push('p');
                    p as *const u64 as *mut c_void
                }
                KArg::I32(i) => {
                    sig.push('i');
                    i as *const i32 as *mut c_void
                }
                KArg::F32(f) => {
                    sig.push('f');
                    f as *const f32 as *mut c_void
                }
            })
            .collect();
        let (g, b) = (l.cfg.grid_dim, l.cfg.block_dim);
        let (grid, block) = ([g.0, g.1, g.2], [b.0, b.1, b.2]);
        let name = CString::new(l.func.as_str())?;
        let sig = CString::new(sig)?;
        let mut err = vec![0u8; 512];
        // SAFETY: `args` points to live values of the types `sig` names; the kernel reads
        // and writes memory through the pointer arguments, which the caller vouches for
        // exactly as for a GPU launch (host addresses here).
        let rc = unsafe {
            (self.launch)(
                name.as_ptr(),
                sig.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                l.cfg.shared_mem_bytes,
                args.as_mut_ptr(),
                err.as_mut_ptr() as *mut c_char,
                err.len(),
            )
        };
        if rc != 0 {
            let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
            bail!(
                "kernel emulator: {} ({})",
                String::from_utf8_lossy(&err[..end]),
                l.file
            );
        }
        Ok(())
    }
}

/// The C++ compiler: `$CXX`, else the first of c++, g++, clang++ that runs.
fn compiler() -> Result<String> {
    let candidates: Vec<String> = match std::env::var("CXX") {
        Ok(c) if !c.is_empty() => vec![c],
        _ => ["c++", "g++", "clang++"].map(String::from).to_vec(),
    };
    for c in &candidates {
        if Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(c.clone());
        }
    }
    bail!("the kernel emulator needs a C++17 compiler: none of {candidates:?} runs (set CXX or install g++)")
}

/// One translation unit per `.cu` file: the shim, the file, then its kernels' registration.
fn units(extra: &[ExtraUnit]) -> Result<Vec<(String, String)>> {
    let mut units = vec![("core.cpp".to_string(), CORE.to_string())];
    let listed = SOURCES.iter().map(|(file, _)| {
        KERNELS
            .iter()
            .find(|(f, _)| f == file)
            .map(|(f, k)| (*f, *k))
            .ok_or_else(|| anyhow!("kernels/{file} is missing from ops::KERNELS"))
    });
    let extra = extra.iter().map(|(f, _, k)| Ok((*f, *k)));
    for unit in listed.chain(extra) {
        let (file, kernels) = unit?;
        let mut tu = format!("#include \"shim.h\"\n#include \"{file}\"\n");
        for k in kernels {
            tu += &format!("EMU_REGISTER({k})\n");
        }
        units.push((format!("{file}.cpp"), tu));
    }
    Ok(units)
}

/// Builds (or finds) the emulator library; returns its path.
fn build(extra: &[ExtraUnit]) -> Result<PathBuf> {
    let cxx = compiler()?;
    let units = units(extra)?;
    let extra_sources = extra.iter().map(|(f, s, _)| (*f, *s));
    let mut h = Fnv::default();
    for s in [cxx.as_str(), SHIM, LINKER_SCRIPT]
        .into_iter()
        .chain(CXXFLAGS.iter().copied())
    {
        h.write(s.as_bytes());
    }
    let sources: Vec<(&str, &str)> = SOURCES
        .iter()
        .chain(HEADERS)
        .copied()
        .chain(extra_sources)
        .collect();
    let unit_texts = units.iter().map(|(n, s)| (n.as_str(), s.as_str()));
    for (n, s) in sources.iter().copied().chain(unit_texts) {
        h.write(n.as_bytes());
        h.write(s.as_bytes());
    }
    let root = crate::device::cuda::nvrtc::default_cache_dir()
        .unwrap_or_else(|| std::env::temp_dir().join("strata-kernels"));
    let dir = root.join(format!("emu-{:016x}", h.0));
    let lib = dir.join("libkemu.so");
    if lib.exists() {
        return Ok(lib);
    }
    // Build in a private directory (per process and build), then rename it into place
    // (concurrent builders race harmlessly: the loser's rename fails and it uses the
    // winner's library).
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = root.join(format!("emu-tmp-{}-{n}-{:016x}", std::process::id(), h.0));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    if let Err(e) = compile_in(&tmp, &cxx, &sources, &units) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
        if !lib.exists() {
            bail!("could not move the kernel emulator into {}", dir.display());
        }
    }
    Ok(lib)
}

/// Writes the sources into `tmp` and builds `tmp/libkemu.so` there.
fn compile_in(
    tmp: &std::path::Path,
    cxx: &str,
    sources: &[(&str, &str)],
    units: &[(String, String)],
) -> Result<()> {
    let write = |name: &str, text: &str| {
        std::fs::write(tmp.join(name), text).with_context(|| format!("writing {name}"))
    };
    write("shim.h", SHIM)?;
    write("shared.ld", LINKER_SCRIPT)?;
    for (n, s) in sources {
        write(n, s)?;
    }
    for (n, s) in units {
        write(n, s)?;
    }
    // Compile the units in parallel, then link.
    let children: Vec<_> = units
        .iter()
        .map(|(n, _)| {
            // Kernel units: one section per static, for shared.ld (not core: its statics
            // must not be poisoned).
            let sections = (n != "core.cpp").then_some("-fdata-sections");
            Command::new(cxx)
                .args(CXXFLAGS)
                .args(sections)
                .args(["-c", n, "-o", &format!("{n}.o")])
                .current_dir(tmp)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map(|c| (n.clone(), c))
        })
        .collect();
    for c in children {
        let (n, child) = c.with_context(|| format!("running {cxx}"))?;
        let o = child.wait_with_output()?;
        check_output(cxx, &n, &o)?;
    }
    let objects: Vec<String> = units.iter().map(|(n, _)| format!("{n}.o")).collect();
    let o = Command::new(cxx)
        .args(["-shared", "-Wl,-T,shared.ld", "-o", "libkemu.so"])
        .args(&objects)
        .current_dir(tmp)
        .output()
        .with_context(|| format!("running {cxx}"))?;
    check_output(cxx, "the link", &o)
}

fn check_output(cxx: &str, what: &str, o: &std::process::Output) -> Result<()> {
    if o.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&o.stderr);
    let first: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("error"))
        .take(3)
        .collect();
    bail!(
        "the kernel emulator failed to compile ({cxx}, {what}): {}",
        first.join(" | ")
    )
}

/// Zeroed host memory whose last byte abuts a page with no access, so a kernel (or a
/// copy) that runs past the end of its buffer faults at once instead of corrupting a
/// neighbour unnoticed; the start is 16-byte aligned, so overruns within the last 15
/// bytes of rounding go unseen.
pub struct GuardedBuf {
    map: *mut libc::c_void,
    map_len: usize,
}

// SAFETY: a private anonymous mapping, owned; nothing is tied to the creating thread.
unsafe impl Send for GuardedBuf {}
unsafe impl Sync for GuardedBuf {}

impl GuardedBuf {
    fn new(bytes: usize) -> Result<(Self, DevPtr<u8>)> {
        let page = 4096usize;
        let len = bytes.max(1).next_multiple_of(16);
        let data = len.next_multiple_of(page);
        let map_len = data + page;
        // SAFETY: a fresh anonymous mapping; the guard page is inside it.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if map == libc::MAP_FAILED {
                bail!("kernel emulator: cannot map {map_len} bytes");
            }
            let guard = (map as *mut u8).add(data);
            if libc::mprotect(guard as *mut libc::c_void, page, libc::PROT_NONE) != 0 {
                libc::munmap(map, map_len);
                bail!("kernel emulator: cannot protect a guard page");
            }
            let start = DevPtr::from_addr(guard.sub(len) as u64);
            Ok((Self { map, map_len }, start))
        }
    }
}

impl Drop for GuardedBuf {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// `Exec` with the kernels emulated: host memory, guarded (every allocation ends at a
/// no-access page), and GEMMs on the host (`host_gemm`).
pub struct EmuExec {
    emu: Arc<Emulator>,
}

impl EmuExec {
    pub fn new() -> Result<Self> {
        Ok(Self { emu: emulator()? })
    }
}

/// cuBLAS's GEMM on host memory: `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 inputs widened to
/// f32 and multiplied by the CPU device's GEMM (f32 accumulation, as cuBLAS's compute
/// type), written as f32 or rounded to bf16. Like cuBLAS, whose algorithm (tile, split-K)
/// is chosen by shape, a row's rounding depends on how many rows the GEMM has: one row
/// sums `k` in one pass, several sum its two halves apart and add them (split-K). So a
/// test that expects a row inside a taller GEMM to round as it does alone fails here as
/// on a GPU (`ops::gemm_fixed` is the batch-invariant GEMM).
///
/// # Safety
/// `x`, `w` and `out` must hold `m·k`, `n·k` and `m·n` elements of their types.
unsafe fn host_gemm(x: DevPtr<bf16>, w: DevPtr<bf16>, out: GemmOut, s: GemmShape) {
    let GemmShape { m, k, n } = s;
    let widen = |p: DevPtr<bf16>, len: usize| -> Vec<f32> {
        let bits = std::slice::from_raw_parts(p.addr() as *const u16, len);
        bits.iter().map(|&b| bf16_to_f32(b)).collect()
    };
    let (xf, wf) = (widen(x, m * k), widen(w, n * k));
    let mut o = vec![0.0f32; m * n];
    let half = k / 2;
    if m == 1 || half == 0 {
        crate::device::cpu::ops::linear(&xf, &wf, None, &mut o, m, k, n);
    } else {
        // [rows, k] → the columns `ks` of every row: [rows, ks.len()].
        let cols = |a: &[f32], ks: std::ops::Range<usize>| -> Vec<f32> {
            a.chunks_exact(k)
                .flat_map(|r| r[ks.clone()].to_vec())
                .collect()
        };
        let mut hi = vec![0.0f32; m * n];
        let (lo_k, hi_k) = (0..half, half..k);
        let linear = crate::device::cpu::ops::linear;
        linear(
            &cols(&xf, lo_k.clone()),
            &cols(&wf, lo_k),
            None,
            &mut o,
            m,
            half,
            n,
        );
        linear(
            &cols(&xf, hi_k.clone()),
            &cols(&wf, hi_k),
            None,
            &mut hi,
            m,
            k - half,
            n,
        );
        o.iter_mut().zip(hi).for_each(|(a, b)| *a += b);
    }
    match out {
        GemmOut::F32(p) => {
            std::slice::from_raw_parts_mut(p.as_host_ptr(), m * n).copy_from_slice(&o)
        }
        GemmOut::Bf16(p) => {
            let dst = std::slice::from_raw_parts_mut(p.addr() as *mut u16, m * n);
            for (d, v) in dst.iter_mut().zip(o) {
                *d = f32_to_bf16(v);
            }
        }
    }
}

impl Exec for EmuExec {
    fn alloc(&self, bytes: usize) -> Result<(Buf, DevPtr<u8>)> {
        let (b, p) = GuardedBuf::new(bytes)?;
        Ok((Buf::Other(Box::new(b)), p))
    }
    fn upload(&self, data: &[u8]) -> Result<(Buf, DevPtr<u8>)> {
        let (b, p) = self.alloc(data.len())?;
        // SAFETY: the new allocation holds data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_host_ptr(), data.len()) };
        Ok((b, p))
    }
    unsafe fn htod(&self, dst: DevPtr<u8>, src: &[u8]) -> Result<()> {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_host_ptr(), src.len());
        Ok(())
    }
    unsafe fn download(&self, src: DevPtr<u8>, dst: &mut [u8]) -> Result<()> {
        std::ptr::copy_nonoverlapping(src.as_host_ptr(), dst.as_mut_ptr(), dst.len());
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    fn launch(&self, l: &Launch) -> Result<()> {
        self.emu.launch(l)
    }
    fn gemm(&self, x: DevPtr<bf16>, w: DevPtr<bf16>, out: GemmOut, s: GemmShape) -> Result<()> {
        // SAFETY: the model passes live allocations of these shapes, as to cuBLAS.
        unsafe { host_gemm(x, w, out, s) };
        Ok(())
    }
}

/// The offload engine the emulated CUDA model pairs with: the CPU device in bf16 (its
/// memory is host memory, which the emulated kernels read), random copy delays under the
/// sanitizer.
pub fn emulator_offload_engine(
    model: &crate::model::ModelConfig,
    cfg: crate::offload::OffloadConfig,
) -> Result<Box<dyn crate::offload::OffloadKv<half::bf16>>> {
    use crate::offload::{engine::OFFLOAD_STREAMS, CpuOffloadDevice, OffloadEngine};
    let d = CpuOffloadDevice::<half::bf16>::new(0.0, cfg.sanitize, OFFLOAD_STREAMS)?;
    Ok(Box::new(OffloadEngine::new(d, model, cfg)?))
}

/// The expert stream the emulated CUDA model pairs with (`--offload-experts`): the CPU
/// device in bf16 (host memory the emulated kernels read), random copy delays under the
/// sanitizer.
pub fn emulator_expert_stream(
    model: &crate::model::Model,
    cfg: crate::offload::experts::ExpertOffload,
) -> Result<Box<dyn crate::model::cuda::ExpertSource>> {
    use crate::offload::{experts::ExpertStream, CpuOffloadDevice};
    let d = CpuOffloadDevice::<half::bf16>::new(0.0, cfg.sanitize, 1)?;
    Ok(Box::new(ExpertStream::new(d, model, cfg)?))
}

/// The serving engine the emulated CUDA model pairs with: its KV pages on the CPU device
/// in bf16 (host memory the emulated kernels read; copy streams on worker threads, random
/// copy delays under the sanitizer, the link throttled as configured).
pub fn emulator_serve_engine(
    model: &Arc<crate::model::Model>,
    cfg: &crate::serve::EngineConfig,
) -> Result<crate::serve::Engine> {
    use crate::offload::CpuOffloadDevice;
    let exec: Arc<dyn Exec> = Arc::new(EmuExec::new()?);
    let d = CpuOffloadDevice::<half::bf16>::new(cfg.link_gbps, cfg.sanitize, 1)?;
    crate::serve::setup::cuda_model_engine(model, cfg, exec, d)
}
