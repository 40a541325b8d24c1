//! Embeds every `kernels/*.cu` (and the `*.cuh` headers they include) into the binary, so
//! NVRTC compiles them at run time and adding a kernel file needs no code change.

use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    let mut sources = String::new();
    let mut headers = String::new();
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let entry = format!(
            "    ({name:?}, include_str!({:?})),\n",
            path.display().to_string()
        );
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push_str(&entry),
            Some("cuh") => headers.push_str(&entry),
            _ => continue,
        }
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let out = format!(
        "/// `(file name, source)` of every `kernels/*.cu`, sorted by name.\n\
         pub const SOURCES: &[(&str, &str)] = &[\n{sources}];\n\
         /// `(file name, source)` of every `kernels/*.cuh`, given to NVRTC as headers.\n\
         pub const HEADERS: &[(&str, &str)] = &[\n{headers}];\n"
    );
    let dest = PathBuf::from(env::var("OUT_DIR").unwrap()).join("kernels.rs");
    fs::write(dest, out).unwrap();
}
