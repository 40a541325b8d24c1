//! Every embedded kernel compiles to CUBIN for sm_80 and sm_90 through the runtime's own
//! NVRTC path. Without NVRTC the test fails under CI=true (CI installs the wheel into
//! `.cuda/`) and is skipped with a note elsewhere.

use strata::device::cuda::nvrtc::{self, SOURCES};

const ARCHES: &[&str] = &["sm_80", "sm_90"];

/// NVRTC's version, or `None` (with a note) when it is absent outside CI.
fn nvrtc_or_skip() -> Option<(i32, i32)> {
    match nvrtc::nvrtc_version() {
        Ok(v) => Some(v),
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let Some(v) = nvrtc_or_skip() else { return };
    let mut failures = Vec::new();
    for (name, _) in SOURCES {
        for arch in ARCHES {
            match nvrtc::compile_kernel_cached(name, arch, None) {
                // A CUBIN is an ELF file.
                Ok(cubin) => assert_eq!(&cubin[..4], b"\x7fELF", "{name} {arch}: not an ELF CUBIN"),
                Err(e) => failures.push(format!("{e:#}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "NVRTC {}.{}:\n{}",
        v.0,
        v.1,
        failures.join("\n")
    );
    eprintln!(
        "NVRTC {}.{}: {} kernel files × {ARCHES:?} compiled",
        v.0,
        v.1,
        SOURCES.len()
    );
}

#[test]
fn every_kernel_file_is_embedded() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let embedded: Vec<String> = SOURCES.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(on_disk, embedded);
    assert!(nvrtc::HEADERS.iter().any(|(n, _)| *n == "common.cuh"));
}

#[test]
fn cubin_cache_round_trips() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("strata-kcache-{}", std::process::id()));
    let a = nvrtc::compile_kernel_cached("activation.cu", "sm_90", Some(&dir)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(files.len(), 1, "one cache entry");
    let b = nvrtc::compile_kernel_cached("activation.cu", "sm_90", Some(&dir)).unwrap();
    assert_eq!(a, b);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The cache directory is strata's own, but what is in it is not trusted: an entry that is
/// a FIFO, a link or a device is compiled around (no hang, no read of /dev/zero), and a
/// link planted at the temporary name does not redirect the write to another file.
#[test]
fn cubin_cache_never_reads_or_writes_through_what_is_planted_in_it() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("strata-kcache-hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let good = nvrtc::compile_kernel_cached("activation.cu", "sm_90", Some(&dir)).unwrap();
    let entry = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let victim = dir.with_extension("victim");
    std::fs::write(&victim, b"not yours").unwrap();
    let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
    let fifo = std::ffi::CString::new(entry.as_os_str().as_encoded_bytes()).unwrap();
    type Plant<'a> = Box<dyn Fn() + 'a>;
    let plants: [(&str, Plant); 3] = [
        (
            "a FIFO",
            Box::new(|| {
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
            }),
        ),
        (
            "a link to /dev/zero",
            Box::new(|| std::os::unix::fs::symlink("/dev/zero", &entry).unwrap()),
        ),
        (
            "a link at the temporary name",
            Box::new(|| std::os::unix::fs::symlink(&victim, &tmp).unwrap()),
        ),
    ];
    for (what, plant) in plants {
        let _ = std::fs::remove_file(&entry);
        plant();
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let _ = tx.send(nvrtc::compile_kernel_cached(
                "activation.cu",
                "sm_90",
                Some(&d),
            ));
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("{what}: the cache hung"));
        assert_eq!(got.unwrap(), good, "{what}: not the kernel's CUBIN");
        assert_eq!(
            std::fs::read(&victim).unwrap(),
            b"not yours",
            "{what}: wrote through it"
        );
        let _ = std::fs::remove_file(&tmp);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_file(&victim).unwrap();
}

#[test]
fn bad_arch_and_unknown_source_are_one_line_errors() {
    let e = nvrtc::compile_kernel_cached("activation.cu", "90", None).unwrap_err();
    assert!(!format!("{e:#}").contains('\n'), "{e:#}");
    let e = nvrtc::compile_kernel_cached("nope.cu", "sm_90", None).unwrap_err();
    assert!(format!("{e:#}").contains("nope.cu"));
}

/// Writes each kernel's PTX for `STRATA_PTX_ARCH` (default sm_90) into `STRATA_PTX_OUT`;
/// `scripts/kernel-report.sh` runs it and feeds the PTX to ptxas.
#[test]
#[ignore]
fn dump_ptx() {
    let out = std::env::var("STRATA_PTX_OUT").expect("set STRATA_PTX_OUT");
    let arch = std::env::var("STRATA_PTX_ARCH").unwrap_or_else(|_| "sm_90".into());
    std::fs::create_dir_all(&out).unwrap();
    for (name, _) in SOURCES {
        let ptx = nvrtc::compile_ptx(name, &arch).unwrap();
        let path = std::path::Path::new(&out).join(name.replace(".cu", ".ptx"));
        std::fs::write(path, ptx).unwrap();
    }
}
