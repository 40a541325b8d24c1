//! The error contract of every strata binary (docs/errors.md): a failure prints exactly
//! one line, `error: <cause chain>`, on stderr and nothing on stdout. Usage errors
//! (the argument parser's) exit 2, every other failure exits 1.
//!
//! Error text often carries untrusted strings (an architecture name from a model file, a
//! chat template's `raise_exception` message), so the line is escaped here, once, for all
//! callers; and candle's errors are converted without the backtrace it attaches when
//! `RUST_BACKTRACE` is set.

use std::fmt::Write as _;
use std::process::ExitCode;

/// Exit status of a usage error (unknown flag, a value out of its documented range).
pub const EXIT_USAGE: u8 = 2;
/// Exit status of every other failure.
pub const EXIT_FAILURE: u8 = 1;

/// Longest error line printed; the rest is elided (an error can quote untrusted text).
const MAX_LINE_CHARS: usize = 2000;

/// `text` as one printable line: newlines, tabs and other control characters are escaped
/// (`\n`, `\t`, `\u{1b}`), and the line is cut at `MAX_LINE_CHARS` characters.
pub fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_LINE_CHARS));
    for (n, c) in text.chars().enumerate() {
        if n == MAX_LINE_CHARS {
            out.push('…');
            break;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            // Unicode bidi overrides can make a line read differently than it is.
            c if c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// The line printed for a failure: `error: ` and the escaped cause chain.
pub fn error_line(e: &anyhow::Error) -> String {
    format!("error: {}", one_line(&format!("{e:#}")))
}

/// A usage error found after parsing: a flag's value that only its combination with other
/// flags makes wrong (`--disk-offload-dir` without a capacity, a prefill chunk that is not a
/// multiple of the block size). Reported like the parser's own: exit 2.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// An error that is a usage error (exit 2).
pub fn usage(message: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(Usage(message.to_string()))
}

/// Whether `e` (or any error in its chain) is a usage error.
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<Usage>())
}

/// Prints the failure's one line on stderr and returns its exit status: 2 for a usage
/// error, 1 for everything else; a closed stdout (`output::OutputClosed`) ends quietly, 0.
pub fn report(e: &anyhow::Error) -> ExitCode {
    report_for(e, None)
}

/// As `report`; a usage error's line ends with ``(see `<command> --help`)``.
pub fn report_for(e: &anyhow::Error, command: Option<&str>) -> ExitCode {
    // The reader of our output went away (`| head`): nothing to say, nobody to say it to.
    if crate::output::is_closed(e) {
        return ExitCode::SUCCESS;
    }
    if is_usage(e) {
        match command {
            Some(cmd) => eprintln!("{} (see `{cmd} --help`)", error_line(e)),
            None => eprintln!("{}", error_line(e)),
        }
        return ExitCode::from(EXIT_USAGE);
    }
    eprintln!("{}", error_line(e));
    ExitCode::from(EXIT_FAILURE)
}

/// A candle error as an anyhow error holding only its message: candle appends a captured
/// backtrace to its `Display` when `RUST_BACKTRACE` is set, which must not reach the user.
pub fn candle(e: candle_core::Error) -> anyhow::Error {
    anyhow::Error::msg(candle_message(&e))
}

fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string(),
    }
}

thread_local! {
    /// Set while `contain_panic` runs: the panic hook stays quiet on this thread.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs third-party parsing code that may panic on malformed input (the `tokenizers`
/// crate `expect`s while deserialising a decoder): a panic becomes an error naming
/// `what`, and prints nothing.
pub fn contain_panic<T>(what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    quiet_catch(f).unwrap_or_else(|msg| anyhow::bail!("{what}: malformed ({msg})"))
}

/// Runs `f`; a panic inside it is caught without a word (no hook output, no backtrace)
/// and returned as its message.
pub fn quiet_catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                previous(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    out.map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// Parses the command line; on a usage error prints one line naming the problem and the
/// `--help` to read, and returns the exit status (`--help`/`--version` print as usual and
/// exit 0).
pub fn parse_args<T: clap::Parser>(program: &str) -> Result<T, ExitCode> {
    parse_args_from(program, std::env::args_os())
}

pub fn parse_args_from<T: clap::Parser>(
    program: &str,
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Result<T, ExitCode> {
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    match T::try_parse_from(&args) {
        Ok(t) => Ok(t),
        Err(e) => {
            use clap::error::ErrorKind as K;
            if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion) {
                let _ = e.print();
                return Err(ExitCode::SUCCESS);
            }
            eprintln!("{}", usage_error_line::<T>(program, &args, &e));
            Err(ExitCode::from(EXIT_USAGE))
        }
    }
}

/// `error: <clap's first line> (see `<program> <subcommands> --help`)`.
fn usage_error_line<T: clap::CommandFactory>(
    program: &str,
    args: &[std::ffi::OsString],
    e: &clap::Error,
) -> String {
    // clap's message is the lines before its usage block (tips left out), e.g.
    // "the following required arguments were not provided: --prompt <PROMPT>".
    let rendered = e.render().to_string();
    let message = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .collect::<Vec<_>>()
        .join(" ");
    let cause = match e.kind() {
        // clap renders the whole help for these: name the problem instead.
        clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => "missing subcommand",
        _ if message.is_empty() => "invalid arguments",
        _ => message.strip_prefix("error: ").unwrap_or(&message),
    };
    // The subcommand path the user named (`bench serve`), as far as it is valid.
    let mut cmd = program.to_string();
    let mut at = T::command();
    for word in args.iter().skip(1).map(|a| a.to_string_lossy()) {
        let Some(sub) = at.find_subcommand(word.as_ref()).cloned() else {
            break;
        };
        cmd = format!("{cmd} {}", sub.get_name());
        at = sub;
    }
    format!("error: {} (see `{cmd} --help`)", one_line(cause))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_into_one_line() {
        let s = one_line("arch `x\ny`\r\t\u{1b}[31m\u{202e}");
        assert_eq!(s, "arch `x\\ny`\\r\\t\\u{1b}[31m\\u{202e}");
        assert!(!s.contains('\n'));
    }

    #[test]
    fn contained_panics_are_errors() {
        let r: anyhow::Result<()> = contain_panic("tokenizer.json", || panic!("Helper"));
        assert_eq!(
            r.unwrap_err().to_string(),
            "tokenizer.json: malformed (Helper)"
        );
        assert_eq!(contain_panic("x", || Ok(5)).unwrap(), 5);
    }

    #[test]
    fn usage_errors_are_found_in_the_chain() {
        let e = usage("--a needs --b").context("checking the flags");
        assert!(is_usage(&e));
        assert!(!is_usage(&anyhow::anyhow!("bad model")));
        assert_eq!(error_line(&e), "error: checking the flags: --a needs --b");
    }

    #[test]
    fn long_messages_are_cut() {
        let s = one_line(&"x".repeat(10 * MAX_LINE_CHARS));
        assert_eq!(s.chars().count(), MAX_LINE_CHARS + 1);
    }

    #[test]
    fn candle_backtraces_are_dropped() {
        let e = candle_core::Error::Msg("bad tensor".into()).bt();
        // With RUST_BACKTRACE unset `bt` may not attach one: build the variant directly.
        let e = match e {
            b @ candle_core::Error::WithBacktrace { .. } => b,
            inner => candle_core::Error::WithBacktrace {
                inner: Box::new(inner),
                backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
            },
        };
        assert!(
            e.to_string().lines().count() > 1,
            "the plant carries a backtrace"
        );
        assert_eq!(candle(e).to_string(), "bad tensor");
    }
}
