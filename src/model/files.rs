//! Opening the files of a model as untrusted input: only regular files are read (a FIFO
//! or a device given as `--model` would block or never end), and text files are read
//! only up to a size bound.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Largest JSON or template file read (a real tokenizer.json is ~10–30 MB).
pub const MAX_TEXT_FILE_BYTES: u64 = 256 << 20;

/// Opens `path` for reading if it is a regular file. The open itself does not block:
/// it is non-blocking, and the file type is checked on the opened handle.
pub fn open_regular(path: &Path) -> Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("reading the metadata of {}", path.display()))?;
    if !meta.is_file() {
        bail!("{}: not a regular file", path.display());
    }
    Ok(file)
}

/// Reads a UTF-8 text file of at most `MAX_TEXT_FILE_BYTES`.
pub fn read_text(path: &Path) -> Result<String> {
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > MAX_TEXT_FILE_BYTES {
        bail!(
            "{}: {len} bytes is above the limit of {MAX_TEXT_FILE_BYTES} for a text file",
            path.display()
        );
    }
    let mut text = String::new();
    file.take(MAX_TEXT_FILE_BYTES)
        .read_to_string(&mut text)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(text)
}

/// Whether `path` names an existing entry (of any type: `read_text` checks the type).
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}
