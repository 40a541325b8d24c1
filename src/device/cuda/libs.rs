//! Finds the CUDA libraries where a CUDA install or PyPI's nvidia wheels put them and loads
//! them by full path. cudarc later `dlopen`s them by bare name (`libnvrtc.so.13`, ...);
//! the dynamic loader matches that name against the soname of a library already loaded,
//! so the copy found here is the one cudarc uses. `LD_LIBRARY_PATH` cannot be changed
//! after start-up, hence the preload.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A CUDA library the device needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lib {
    Driver,
    Nvrtc,
    Cublas,
}

impl Lib {
    /// File names to look for, preferred first (CUDA 13 sonames, then unversioned).
    fn file_names(self) -> &'static [&'static str] {
        match self {
            // The driver comes with the GPU driver install, never from a wheel.
            Lib::Driver => &["libcuda.so.1", "libcuda.so"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            Lib::Cublas => &["libcublas.so.13", "libcublas.so"],
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Lib::Driver => "CUDA driver",
            Lib::Nvrtc => "NVRTC",
            Lib::Cublas => "cuBLAS",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Lib::Driver => "install the NVIDIA driver, or use --device cpu",
            Lib::Nvrtc => "install the CUDA 13 toolkit or `pip install nvidia-cuda-nvrtc==13.0.*`, or set STRATA_CUDA_LIBS",
            Lib::Cublas => "install the CUDA 13 toolkit or `pip install nvidia-cublas==13.0.*`, or set STRATA_CUDA_LIBS",
        }
    }
}

/// Directories searched, in order: `STRATA_CUDA_LIBS` (colon-separated), `CUDA_HOME` and
/// `CUDA_PATH`, `/usr/local/cuda*`, Python environments' `nvidia/*/lib` (wheels), this
/// project's `.cuda/` (CI installs the wheels there), then the `ldconfig` cache.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(v) = std::env::var("STRATA_CUDA_LIBS") {
        dirs.extend(std::env::split_paths(&v));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            let root = PathBuf::from(v);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut versioned = glob_dirs(Path::new("/usr/local"), |n| n.starts_with("cuda-"));
    versioned.sort();
    versioned.reverse(); // newest toolkit first
    dirs.extend(versioned.into_iter().map(|d| d.join("lib64")));
    for site in python_site_dirs() {
        dirs.extend(wheel_lib_dirs(&site));
    }
    for root in project_roots() {
        dirs.extend(wheel_lib_dirs(&root.join(".cuda")));
    }
    dirs.extend(ldconfig_dirs());
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// `<root>/nvidia/*/lib` (CUDA 13 wheels: `nvidia/cu13/lib`; older: `nvidia/cuda_nvrtc/lib`).
fn wheel_lib_dirs(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = glob_dirs(&root.join("nvidia"), |_| true)
        .into_iter()
        .map(|d| d.join("lib"))
        .filter(|d| d.is_dir())
        .collect();
    v.sort();
    v
}

fn glob_dirs(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| keep(&e.file_name().to_string_lossy()))
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// site-packages of the active virtualenv/conda env and of the usual system Pythons.
fn python_site_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    let mut sites = Vec::new();
    for p in prefixes {
        for py in glob_dirs(&p.join("lib"), |n| n.starts_with("python3")) {
            sites.push(py.join("site-packages"));
            sites.push(py.join("dist-packages"));
        }
    }
    sites
}

/// The working directory, the build's source tree, and the directories above the
/// executable (a binary carried next to a `.cuda/` folder finds it).
fn project_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(4).map(Path::to_path_buf));
    }
    roots
}

/// Directories of the CUDA libraries in the `ldconfig` cache.
fn ldconfig_dirs() -> Vec<PathBuf> {
    let out = ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|c| std::process::Command::new(c).arg("-p").output().ok());
    let Some(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            ["libcuda.so", "libnvrtc.so", "libcublas.so"]
                .iter()
                .any(|n| l.contains(n))
        })
        .filter_map(|l| l.rsplit("=> ").next())
        .filter_map(|p| Path::new(p.trim()).parent().map(Path::to_path_buf))
        .collect()
}

/// The first file for `lib` in the search directories.
pub fn find(lib: Lib) -> Option<PathBuf> {
    let dirs = search_dirs();
    lib.file_names()
        .iter()
        .flat_map(|n| dirs.iter().map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

/// Loads `lib` (once) and returns where it came from, or a one-line error naming it and
/// the directories searched. The library stays loaded for the life of the process.
pub fn load(lib: Lib) -> anyhow::Result<PathBuf> {
    static LOADED: OnceLock<Mutex<Vec<(Lib, PathBuf, libloading::Library)>>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| Mutex::new(Vec::new()));
    let mut loaded = loaded.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p, _)) = loaded.iter().find(|(l, _, _)| *l == lib) {
        return Ok(p.clone());
    }
    // A file on the search path first; else the loader's own search (LD_LIBRARY_PATH, cache).
    let mut candidates: Vec<PathBuf> = find(lib).into_iter().collect();
    candidates.extend(lib.file_names().iter().map(PathBuf::from));
    for c in candidates {
        // SAFETY: loading a CUDA library runs only its initialisers, which have no
        // preconditions; no symbol is called here.
        if let Ok(handle) = unsafe { libloading::Library::new(&c) } {
            if lib == Lib::Nvrtc {
                // NVRTC dlopens `libnvrtc-builtins.so.<major>.<minor>` by bare name at its
                // first compile; a wheel's copy sits beside it, off the loader's path.
                for b in builtins_beside(&c) {
                    // SAFETY: as above.
                    if let Ok(h) = unsafe { libloading::Library::new(&b) } {
                        loaded.push((lib, b, h));
                    }
                }
            }
            loaded.push((lib, c.clone(), handle));
            return Ok(c);
        }
    }
    let dirs: Vec<String> = search_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    anyhow::bail!(
        "no {} found: {} is in none of {} nor on the loader path; {}",
        lib.describe(),
        lib.file_names()[0],
        if dirs.is_empty() {
            "the CUDA directories".to_string()
        } else {
            dirs.join(":")
        },
        lib.hint()
    )
}

/// `libnvrtc-builtins.so.*` in the directory of a library found by path (not the `.alt`
/// variant, which NVRTC only uses on request).
fn builtins_beside(nvrtc: &Path) -> Vec<PathBuf> {
    let Some(dir) = nvrtc.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
