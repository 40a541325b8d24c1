//! The CLI's results on standard output, written so that a closed or full stdout is an
//! outcome, not a panic (`println!` panics on any write error):
//!
//! - a reader that went away (`strata generate … | head -c 100`, a broken pipe) ends the
//!   run quietly, exit 0, as `head` expects of the programs it reads (ripgrep does the
//!   same): `errors::report_for` recognises `OutputClosed`;
//! - any other failure (a full disk, `>/dev/full`) is the usual one `error:` line, exit 1.
//!
//! `strata serve` writes one line here (where it listens) and never depends on it, nor on
//! its stderr: its log lines go through `log!`, which drops what cannot be written.

use std::fmt::Display;
use std::io::{self, Write};

/// Standard output's reader has closed it (EPIPE).
#[derive(Debug)]
pub struct OutputClosed;

impl Display for OutputClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for OutputClosed {}

fn checked(r: io::Result<()>) -> anyhow::Result<()> {
    r.map_err(|e| match e.kind() {
        io::ErrorKind::BrokenPipe => anyhow::Error::new(OutputClosed),
        _ => anyhow::Error::new(e).context("writing to standard output"),
    })
}

/// Writes `text` and flushes (a token streamed as it is generated).
pub fn print(text: impl Display) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    checked(write!(out, "{text}").and_then(|()| out.flush()))
}

/// Writes `text` and a newline, and flushes.
pub fn println(text: impl Display) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    checked(writeln!(out, "{text}").and_then(|()| out.flush()))
}

/// Whether `e` is the reader having closed standard output.
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<OutputClosed>())
}

/// `println!` through `output::println`: a `Result` to `?`.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::println(format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics: for code that runs inside a server, which must not die
/// because whoever read its stderr went away.
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
