//! Files at paths the user or a directory controls (docs/errors.md, "Files"): strata opens
//! them as regular files only, bounds what it reads, and never writes through a link.
//!
//! - `read_regular` reads a file of at most a bound. The path's type is looked at before
//!   the open (a device is never opened: opening some has side effects), the open is
//!   non-blocking (a FIFO swapped in meanwhile cannot block it), the *opened* handle must be
//!   a regular file within the bound, and at most bound + 1 bytes are read, so a file that
//!   grows underneath is caught too. `Links::Refuse` adds `O_NOFOLLOW` for files inside a
//!   directory strata owns (the disk tier's index), where a link is never legitimate.
//! - `create_private` creates or truncates a file strata writes: `O_NOFOLLOW | O_CREAT`,
//!   mode 0600; refused if the name is a symbolic link, not a regular file, or has another
//!   hard link (writing it would change another file); truncated only after those checks.
//! - `open_private` opens (creating) a file strata reads and writes in place (the disk
//!   tier's slot file) the same way, without truncating.
//!
//! Every error is one line naming `what` and the path, e.g.
//! `--prompt-file /dev/zero: not a regular file (a character device)`.

use std::fs::{File, Metadata, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Whether a symbolic link at the path itself may be followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// A path the user named (`--prompt-file`): a link to a regular file is fine.
    Follow,
    /// A file inside a directory strata owns: a link there is refused.
    Refuse,
}

/// What a non-regular entry is, for the error line.
fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}

fn not_regular(what: &str, path: &Path, meta: &Metadata) -> anyhow::Error {
    anyhow::anyhow!(
        "{what} {}: not a regular file ({})",
        path.display(),
        kind(meta)
    )
}

/// `n` bytes in the unit that reads best (`1.5 GiB`, `300 B`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// An open's error, explained: a link refused by `O_NOFOLLOW` reads as ELOOP, a FIFO
/// without a reader opened for writing as ENXIO.
fn open_error(verb: &str, what: &str, path: &Path, e: std::io::Error) -> anyhow::Error {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_symlink() && e.raw_os_error() == Some(libc::ELOOP) {
            return anyhow::anyhow!(
                "{what} {}: a symbolic link, which strata does not follow here",
                path.display()
            );
        }
        if !meta.is_file() && !meta.file_type().is_symlink() {
            return not_regular(what, path, &meta);
        }
    }
    anyhow::Error::new(e).context(format!("cannot {verb} {what} {}", path.display()))
}

/// Clears `O_NONBLOCK` on an opened regular file (IO on it is ordinary from here on).
fn clear_nonblock(f: &File) {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

/// Opens `path` for reading if it is a regular file of at most `max_bytes`; returns the
/// file and its length.
pub fn open_regular(path: &Path, max_bytes: u64, what: &str, links: Links) -> Result<(File, u64)> {
    // Look before opening: a device or a FIFO is refused without being opened.
    let before = match links {
        Links::Follow => std::fs::metadata(path),
        Links::Refuse => std::fs::symlink_metadata(path),
    };
    match before {
        Ok(m) if m.file_type().is_symlink() => bail!(
            "{what} {}: a symbolic link, which strata does not follow here",
            path.display()
        ),
        Ok(m) if !m.is_file() => return Err(not_regular(what, path, &m)),
        Ok(_) => {}
        Err(e) => return Err(open_error("read", what, path, e)),
    }
    let mut flags = libc::O_NONBLOCK | libc::O_CLOEXEC;
    if links == Links::Refuse {
        flags |= libc::O_NOFOLLOW;
    }
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| open_error("read", what, path, e))?;
    // The handle decides: the entry may have been swapped since it was looked at.
    let meta = f
        .metadata()
        .with_context(|| format!("cannot stat {what} {}", path.display()))?;
    if !meta.is_file() {
        return Err(not_regular(what, path, &meta));
    }
    if meta.len() > max_bytes {
        bail!(
            "{what} {}: {} bytes ({}) is more than the limit of {} ({})",
            path.display(),
            meta.len(),
            human_bytes(meta.len()),
            max_bytes,
            human_bytes(max_bytes)
        );
    }
    clear_nonblock(&f);
    Ok((f, meta.len()))
}

/// The bytes of the regular file `path`, at most `max_bytes` of them (see the module).
pub fn read_regular(path: &Path, max_bytes: u64, what: &str, links: Links) -> Result<Vec<u8>> {
    let (f, len) = open_regular(path, max_bytes, what, links)?;
    let mut bytes = Vec::with_capacity(len.min(max_bytes) as usize);
    // One byte more than the bound: a file that grew since the check is caught.
    f.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {what} {}", path.display()))?;
    if bytes.len() as u64 > max_bytes {
        bail!(
            "{what} {}: grew past the limit of {max_bytes} bytes ({}) while being read",
            path.display(),
            human_bytes(max_bytes)
        );
    }
    Ok(bytes)
}

/// `read_regular` as UTF-8 text.
pub fn read_regular_text(path: &Path, max_bytes: u64, what: &str, links: Links) -> Result<String> {
    let bytes = read_regular(path, max_bytes, what, links)?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} {}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Opens (creating, mode 0600) a file strata writes, read-write, refusing a symbolic link,
/// anything but a regular file, and a file with another hard link. Nothing is truncated.
pub fn open_private(path: &Path, what: &str) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| open_error("write", what, path, e))?;
    let meta = f
        .metadata()
        .with_context(|| format!("cannot stat {what} {}", path.display()))?;
    if !meta.is_file() {
        return Err(not_regular(what, path, &meta));
    }
    if meta.nlink() > 1 {
        bail!(
            "{what} {}: has {} hard links; strata does not write a file another name shares",
            path.display(),
            meta.nlink()
        );
    }
    clear_nonblock(&f);
    Ok(f)
}

/// What `open_private` would refuse about an existing `path`, looked up without opening
/// it (a check before anything is allocated for the file); a missing file is fine.
pub fn check_private(path: &Path, what: &str) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        bail!(
            "{what} {}: a symbolic link, which strata does not follow here",
            path.display()
        );
    }
    if !meta.is_file() {
        return Err(not_regular(what, path, &meta));
    }
    if meta.nlink() > 1 {
        bail!(
            "{what} {}: has {} hard links; strata does not write a file another name shares",
            path.display(),
            meta.nlink()
        );
    }
    Ok(())
}

/// Creates or truncates a file strata writes (see `open_private`): the checks come first,
/// so a link or another kind of file is never truncated.
pub fn create_private(path: &Path, what: &str) -> Result<File> {
    let f = open_private(path, what)?;
    f.set_len(0)
        .with_context(|| format!("cannot truncate {what} {}", path.display()))?;
    Ok(f)
}

/// The same file (device and inode) as `meta`: for a file reopened by name.
pub fn same_file(a: &Metadata, b: &Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// Bytes free to an unprivileged writer on the file system holding `dir` (statvfs).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct for a valid C string path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    (s.f_bavail as u64).checked_mul(s.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("strata-safe-file-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn only_regular_files_within_the_bound_are_read() {
        let d = scratch("read");
        let ok = d.join("ok");
        std::fs::write(&ok, "hello").unwrap();
        assert_eq!(read_regular(&ok, 5, "x", Links::Follow).unwrap(), b"hello");
        let e = read_regular(&ok, 4, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("5 bytes (5 B) is more than the limit of 4"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            read_regular(Path::new("/dev/zero"), 9, "x", Links::Follow).unwrap_err()
        );
        assert_eq!(e, "x /dev/zero: not a regular file (a character device)");
        let e = read_regular(&d, 9, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("not a regular file (a directory)"), "{e}");
        let fifo = d.join("fifo");
        mkfifo(&fifo);
        let e = read_regular(&fifo, 9, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("not a regular file (a FIFO)"), "{e}");
        // A link: followed to a regular file, refused where links are.
        let link = d.join("link");
        std::os::unix::fs::symlink(&ok, &link).unwrap();
        assert_eq!(
            read_regular(&link, 5, "x", Links::Follow).unwrap(),
            b"hello"
        );
        let e = read_regular(&link, 5, "x", Links::Refuse)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a symbolic link"), "{e}");
        let zero = d.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_regular(&zero, 5, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("(a character device)"), "{e}");
        // A sparse file far past the bound is refused by its size, not read.
        let sparse = d.join("sparse");
        File::create(&sparse).unwrap().set_len(8 << 30).unwrap();
        let e = read_regular(&sparse, 1 << 20, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8589934592 bytes (8.0 GiB) is more than the limit"),
            "{e}"
        );
        let bad = d.join("bad");
        std::fs::write(&bad, b"ab\xffcd").unwrap();
        let e = read_regular_text(&bad, 9, "x", Links::Follow)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("not UTF-8 text (invalid byte at offset 2)"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn private_files_never_write_through_a_link() {
        let d = scratch("create");
        let victim = d.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let link = d.join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = create_private(&link, "out").unwrap_err().to_string();
        assert!(e.contains("a symbolic link"), "{e}");
        let hard = d.join("hard");
        std::fs::hard_link(&victim, &hard).unwrap();
        let e = create_private(&hard, "out").unwrap_err().to_string();
        assert!(e.contains("has 2 hard links"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        let fifo = d.join("fifo");
        mkfifo(&fifo);
        let e = create_private(&fifo, "out").unwrap_err().to_string();
        assert!(e.ends_with("not a regular file (a FIFO)"), "{e}");
        let e = create_private(&d, "out").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let new = d.join("new");
        std::fs::write(&new, "old contents").unwrap();
        create_private(&new, "out").unwrap();
        assert_eq!(std::fs::metadata(&new).unwrap().len(), 0);
        let fresh = d.join("fresh");
        create_private(&fresh, "out").unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
