//! The house's layering, checked on the sources: `src/device/` is the bottom — devices,
//! memory, streams, events, kernels and their launchers — and names nothing of the runtime
//! above it (`model`, `kv`, `offload`, `engine`, `serve`, `server`, `session`, `sparse`,
//! `gpucheck`, …). docs/architecture.md, "Layers".

use std::path::Path;

/// Modules below `device` too: they name nothing of the crate (checked below), so the
/// bottom layer may use them (`safe_file`: the NVRTC cache's files are opened as every
/// other file strata reads or writes; `threads`: stream workers start as every thread).
const LEAVES: [&str; 2] = ["safe_file", "threads"];

/// Every `crate::<module>` a source names outside comments, `device` and `LEAVES` excepted.
fn upward_paths(source: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let tail = &rest[at + "crate::".len()..];
            let name: String = tail
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // `crate::{a, b}` names modules inside braces.
            let names: Vec<String> = if let Some(braced) = tail.strip_prefix('{') {
                let inner = braced.split('}').next().unwrap_or("");
                inner
                    .split(',')
                    .map(|p| p.trim().split("::").next().unwrap_or("").to_string())
                    .collect()
            } else {
                vec![name]
            };
            found.extend(
                names
                    .into_iter()
                    .filter(|n| !n.is_empty() && n != "device" && !LEAVES.contains(&n.as_str())),
            );
            rest = tail;
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_check_sees_an_upward_path_in_every_form() {
    assert_eq!(upward_paths("use crate::kv::KvRows;"), ["kv"]);
    assert_eq!(
        upward_paths("use crate::{device::DevPtr, model::Model};"),
        ["model"]
    );
    assert_eq!(upward_paths("let x = crate::serve::setup::f();"), ["serve"]);
    assert!(upward_paths("use crate::device::cpu::ops;").is_empty());
    assert!(upward_paths("// see crate::kv for the seam").is_empty());
    assert!(upward_paths("//! `crate::gpucheck` validates this device").is_empty());
}

#[test]
fn the_leaves_name_nothing_of_the_crate() {
    for leaf in LEAVES {
        let f = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("src/{leaf}.rs"));
        let src = std::fs::read_to_string(&f).unwrap();
        let named: Vec<&str> = src
            .lines()
            .filter(|l| l.split("//").next().unwrap_or("").contains("crate::"))
            .collect();
        assert!(named.is_empty(), "{leaf} must be a leaf: {named:?}");
    }
}

#[test]
fn nothing_in_device_reaches_up_into_the_runtime() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/device");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 10, "src/device has {} files", files.len());
    let mut bad = Vec::new();
    for f in files {
        let src = std::fs::read_to_string(&f).unwrap();
        for m in upward_paths(&src) {
            bad.push(format!("{} names crate::{m}", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "device/ must be a leaf:\n{}",
        bad.join("\n")
    );
}
