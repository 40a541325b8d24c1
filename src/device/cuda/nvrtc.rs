//! Run-time kernel compilation: NVRTC turns an embedded `kernels/*.cu` into a CUBIN for
//! one architecture, cached on disk under a key of source hash + arch + NVRTC version,
//! so a second start skips the compile. The same path serves the runtime and CI's
//! compile test, so a kernel that compiles in CI compiles on the GPU machine.

use super::libs::{self, Lib};
use crate::safe_file::Links;
use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::sys;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}
pub use embedded::{HEADERS, SOURCES};

/// Loads NVRTC and returns its `(major, minor)` version, or a one-line error naming it.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    libs::load(Lib::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (above); the out-pointers are valid for the call.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion failed: {e:?}"))?;
    Ok((major, minor))
}

/// A cached CUBIN larger than this is not one of ours (ours are well under 1 MiB).
const MAX_CUBIN_BYTES: u64 = 64 << 20;

/// CUBIN of `kernels/<source_name>` for `arch` (`sm_80`, `sm_90`, ...), from the on-disk
/// cache when present (`STRATA_KERNEL_CACHE`: a directory, or `off`).
pub fn compile_kernel(source_name: &str, arch: &str) -> Result<Vec<u8>> {
    compile_kernel_cached(source_name, arch, default_cache_dir().as_deref())
}

/// As [`compile_kernel`], with an explicit cache directory (`None`: always compile).
pub fn compile_kernel_cached(
    source_name: &str,
    arch: &str,
    cache: Option<&Path>,
) -> Result<Vec<u8>> {
    let src = source(source_name)?;
    let version = nvrtc_version()?;
    let opts = options(arch, true)?;
    let file = cache.map(|dir| dir.join(cache_name(source_name, src, arch, version, &opts)));
    // Strata's own directory: a link, a FIFO or an oversized entry there is not a CUBIN
    // (it is compiled again, and the entry replaced).
    let cached = file.as_ref().and_then(|f| {
        crate::safe_file::read_regular(f, MAX_CUBIN_BYTES, "kernel cache entry", Links::Refuse).ok()
    });
    if let Some(bytes) = cached {
        return Ok(bytes);
    }
    let cubin = compile(source_name, src, &opts, true)?;
    if let Some(f) = file {
        // A cache that cannot be written only costs the next start a compile.
        let _ = write_atomic(&f, &cubin);
    }
    Ok(cubin)
}

/// PTX of `kernels/<source_name>` for the virtual arch matching `arch` (for ptxas reports).
pub fn compile_ptx(source_name: &str, arch: &str) -> Result<String> {
    let src = source(source_name)?;
    nvrtc_version()?;
    let ptx = compile(source_name, src, &options(arch, false)?, false)?;
    Ok(String::from_utf8_lossy(&ptx)
        .trim_end_matches('\0')
        .to_string())
}

fn source(name: &str) -> Result<&'static str> {
    SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .ok_or_else(|| anyhow!("no embedded kernel source {name:?}"))
}

fn options(arch: &str, cubin: bool) -> Result<Vec<String>> {
    let Some(num) = arch
        .strip_prefix("sm_")
        .filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric()))
    else {
        bail!("bad GPU architecture {arch:?}: expected sm_<major><minor>, e.g. sm_90");
    };
    // A real arch (sm_XX) makes NVRTC emit a CUBIN; a virtual one (compute_XX) emits PTX.
    let gpu = if cubin {
        format!("sm_{num}")
    } else {
        format!("compute_{num}")
    };
    Ok(vec![
        format!("--gpu-architecture={gpu}"),
        "-default-device".into(), // no __device__/__global__ needed on helpers
        "--std=c++17".into(),
        "-lineinfo".into(), // source lines in profiler views; no runtime cost
    ])
}

/// One NVRTC compile; the error carries NVRTC's log.
fn compile(name: &str, src: &str, opts: &[String], cubin: bool) -> Result<Vec<u8>> {
    let csrc = CString::new(src).context("kernel source contains a NUL byte")?;
    let cname = CString::new(name)?;
    let hdr_src: Vec<CString> = HEADERS
        .iter()
        .map(|(_, s)| CString::new(*s).unwrap())
        .collect();
    let hdr_name: Vec<CString> = HEADERS
        .iter()
        .map(|(n, _)| CString::new(*n).unwrap())
        .collect();
    let hdr_src_p: Vec<*const c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
    let hdr_name_p: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live, NUL-terminated CString held above, for the
    // whole life of `prog`, which is destroyed before they drop.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            csrc.as_ptr(),
            cname.as_ptr(),
            HEADERS.len() as i32,
            hdr_src_p.as_ptr(),
            hdr_name_p.as_ptr(),
        )
        .result()
        .map_err(|e| anyhow!("nvrtcCreateProgram({name}) failed: {e:?}"))?;
        let result = compile_program(prog, opts, cubin);
        let log = program_log(prog);
        let _ = sys::nvrtcDestroyProgram(&mut prog);
        result.map_err(|e| {
            let arch = opts[0].trim_start_matches("--gpu-architecture=");
            anyhow!(
                "NVRTC could not compile {name} for {arch}: {e}\n{}",
                log.trim()
            )
        })
    }
}

/// SAFETY: `prog` is a live program.
unsafe fn compile_program(
    prog: sys::nvrtcProgram,
    opts: &[String],
    cubin: bool,
) -> Result<Vec<u8>> {
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).unwrap())
        .collect();
    let popts: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    sys::nvrtcCompileProgram(prog, popts.len() as i32, popts.as_ptr())
        .result()
        .map_err(|e| anyhow!("{e:?}"))?;
    let mut size = 0usize;
    let mut out;
    if cubin {
        sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| anyhow!("{e:?}"))?;
        out = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char)
            .result()
            .map_err(|e| anyhow!("{e:?}"))?;
    } else {
        sys::nvrtcGetPTXSize(prog, &mut size)
            .result()
            .map_err(|e| anyhow!("{e:?}"))?;
        out = vec![0u8; size];
        sys::nvrtcGetPTX(prog, out.as_mut_ptr() as *mut c_char)
            .result()
            .map_err(|e| anyhow!("{e:?}"))?;
    }
    if out.is_empty() {
        bail!("NVRTC returned an empty image");
    }
    Ok(out)
}

/// SAFETY: `prog` is a live program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size)
        .result()
        .is_err()
        || size <= 1
    {
        return String::new();
    }
    let mut buf = vec![0 as c_char; size];
    if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr())
        .result()
        .is_err()
    {
        return String::new();
    }
    CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
}

/// `STRATA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/strata/kernels`, else
/// `~/.cache/strata/kernels`; `STRATA_KERNEL_CACHE=off` disables the cache.
pub fn default_cache_dir() -> Option<PathBuf> {
    match std::env::var_os("STRATA_KERNEL_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("strata").join("kernels")),
    }
}

/// `<stem>-<arch>-nvrtc<major>.<minor>-<hash>.cubin`; the hash covers the source, every
/// header and the options, so any edit makes a new entry.
fn cache_name(name: &str, src: &str, arch: &str, v: (i32, i32), opts: &[String]) -> String {
    let mut h = Fnv::default();
    h.write(src.as_bytes());
    for (n, s) in HEADERS {
        h.write(n.as_bytes());
        h.write(s.as_bytes());
    }
    for o in opts {
        h.write(o.as_bytes());
    }
    let stem = name.trim_end_matches(".cu");
    format!("{stem}-{arch}-nvrtc{}.{}-{:016x}.cubin", v.0, v.1, h.0)
}

/// FNV-1a 64: a hash that is stable across Rust versions, unlike `DefaultHasher`.
pub(crate) struct Fnv(pub(crate) u64);
impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}
impl Fnv {
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// Write then rename, so a concurrent reader never sees half a CUBIN; the temporary file is
/// created as strata creates every file it writes (never through a link: a name planted in
/// the cache cannot redirect the write to another file).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = crate::safe_file::create_private(&tmp, "kernel cache entry")?;
    std::io::Write::write_all(&mut f, bytes)?;
    drop(f);
    std::fs::rename(tmp, path)?;
    Ok(())
}
