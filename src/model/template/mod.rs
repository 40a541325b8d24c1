//! Chat-template rendering under a budget. A model file is untrusted input, and the server
//! renders its template for network clients, so no template may take the process down.
//!
//! Limits sit where they can be enforced:
//! - the template's *shape*, checked on its text before minijinja parses it
//!   (`check_shape`): minijinja's compiler and its drop of the syntax tree recurse once per
//!   link of a chain and per nested block, and a stack overflow aborts the process (there is
//!   no error to return from one). Its parser already bounds parenthesised nesting (150).
//! - instructions, output bytes, memory and time, while rendering (`bounded::run`);
//! - values nested at run time by the fuel, on a thread whose stack holds what it allows;
//! - a panic inside the engine (a capacity that overflows) becomes an error;
//! - what no budget can bound (a value nested millions deep, built within the fuel, then
//!   printed or dropped recursively): binaries that render for others (`strata`, `needle`,
//!   `fuzz`) render in worker processes (`worker`), whose death is one more error.

pub mod worker;

use anyhow::{bail, Context, Result};

/// Budget of one chat-template rendering: a model file is untrusted input (and the server
/// renders templates for network clients). Far above what any real template needs for a
/// long conversation.
pub mod template_limits {
    /// minijinja instructions (a ChatML turn takes ~30).
    pub const FUEL: u64 = 5_000_000;
    /// Bytes of rendered text.
    pub const MAX_OUTPUT_BYTES: usize = 64 << 20;
    /// Bytes the rendering may hold at once (values it builds but never prints included).
    pub const MAX_MEMORY_BYTES: usize = 256 << 20;
    /// Wall-clock backstop behind the fuel: one instruction can iterate a lazy sequence
    /// (`''.join(['a'] * 99999999)`) for seconds. Real templates take milliseconds.
    pub const MAX_SECONDS: u64 = 5;
    /// Bytes of template text (real chat templates are a few KiB; tool-calling ones ~20).
    pub const MAX_TEMPLATE_BYTES: usize = 256 << 10;
    /// Tokens in one `{{ … }}` or `{% … %}` tag: bounds the chains (`x|f|f…`, `a~b~c…`,
    /// `a.b.c…`) that minijinja's compiler and drop recurse through, one frame a link.
    /// Real templates' longest tags have under 100.
    pub const MAX_TAG_TOKENS: usize = 2000;
    /// Blocks open at once (`if`, `for`, `macro`, …; each `elif` of a chain counts one,
    /// as minijinja nests them). Real templates nest under 10.
    pub const MAX_BLOCK_DEPTH: usize = 100;
    /// Stack of the rendering thread. Values nested at run time (a namespace attribute
    /// wrapped in a list on every loop iteration) are printed, compared and dropped
    /// recursively; the fuel bounds how deep they can get, and this stack holds that depth
    /// (measured: `tests` below render the deepest the fuel allows).
    pub const STACK_BYTES: usize = 256 << 20;
}

/// A template could not be rendered for a reason of the process, not of the template (no
/// worker or thread could start: a process limit): a server says 503, and `/health` too
/// (`worker::available`).
#[derive(Debug)]
pub struct RendererUnavailable(pub String);

impl std::fmt::Display for RendererUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot render the chat template now: {}", self.0)
    }
}

impl std::error::Error for RendererUnavailable {}

/// Renders a chat template, the one way every template is rendered: Hugging Face's
/// extensions (`raise_exception`, Python string methods) and a budget (instructions,
/// output bytes, memory, time: `template_limits`). Errors are one cause naming `source`.
pub fn render_template(source: &str, template: &str, ctx: minijinja::Value) -> Result<String> {
    let rendered = check_shape(template).and_then(|()| match worker::exe() {
        Some(exe) => worker::render(exe, template, &ctx),
        None => render_here(template.to_string(), ctx),
    });
    rendered.map_err(|e| {
        if e.is::<RendererUnavailable>() {
            e // the server's condition, kept typed for the server to say so (503)
        } else {
            anyhow::anyhow!("chat template from {source}: {e:#}")
        }
    })
}

/// Renders on a bounded thread of this process (see the module's text for what it bounds;
/// a value nested past what `STACK_BYTES` holds still overflows it: binaries that serve
/// others render in workers instead).
pub fn render_here(template: String, ctx: minijinja::Value) -> Result<String> {
    use template_limits::*;
    let limits = crate::bounded::Limits {
        memory_bytes: MAX_MEMORY_BYTES,
        time: std::time::Duration::from_secs(MAX_SECONDS),
        stack_bytes: STACK_BYTES,
    };
    // A panic inside the engine (a size argument that overflows a capacity before any
    // allocation, e.g. `'a' * 2**62`) is the template's fault, not the process's: an error.
    let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::bounded::run(limits, move || render_unbounded(&template, ctx))
    }))
    .map_err(|panic| {
        anyhow::anyhow!(
            "rendering failed ({})",
            crate::bounded::panic_message(&*panic)
        )
    })?;
    match rendered {
        Ok(r) => r,
        Err(crate::bounded::Exceeded::Memory) => {
            bail!("used more than {} MiB of memory", MAX_MEMORY_BYTES >> 20)
        }
        Err(crate::bounded::Exceeded::Time) => bail!("took longer than {MAX_SECONDS} s"),
        // The process's condition, not the template's: said so, typed.
        Err(crate::bounded::Exceeded::NoThread) => Err(anyhow::Error::new(RendererUnavailable(
            "no thread could be started to render it".into(),
        ))),
    }
}

/// The rendering itself, bounded by fuel and output size only (see `render_template`).
fn render_unbounded(template: &str, ctx: minijinja::Value) -> Result<String> {
    use template_limits::*;
    let mut env = minijinja::Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(FUEL));
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", strftime_now);
    env.add_template("chat", template)
        .map_err(|e| anyhow::anyhow!("invalid template: {e}"))?;
    let mut out = CappedWriter {
        buf: Vec::new(),
        cap: MAX_OUTPUT_BYTES,
        overflowed: false,
    };
    let result = env
        .get_template("chat")
        .and_then(|t| t.render_captured_to(ctx, &mut out).map(|_| ()));
    if out.overflowed {
        bail!("the rendered text passes {} MiB", MAX_OUTPUT_BYTES >> 20);
    }
    match result {
        Ok(()) => String::from_utf8(out.buf).context("the rendered text is not UTF-8"),
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
            bail!("ran out of its budget of {FUEL} instructions")
        }
        Err(e) => bail!("rendering: {e}"),
    }
}

/// transformers' `strftime_now(format)`: the local time now as C's `strftime` formats it
/// (gpt-oss's template writes `Current date: {{ strftime_now("%Y-%m-%d") }}`), at most
/// 256 bytes of it.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let err =
        |msg: &str| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg.to_string());
    let c_format = std::ffi::CString::new(format.as_str())
        .map_err(|_| err("strftime_now: the format holds a NUL byte"))?;
    let mut buf = [0u8; 256];
    // SAFETY: `time` with a null pointer only returns the time; `localtime_r` writes the
    // zeroed `tm` it is given; `strftime` writes at most `buf.len()` bytes into `buf` and
    // reads the NUL-terminated format and the filled `tm`.
    let n = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(err("strftime_now: the local time is unknown"));
        }
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm)
    };
    if n == 0 && !format.is_empty() {
        return Err(err(
            "strftime_now: the formatted time is empty or longer than 256 bytes",
        ));
    }
    String::from_utf8(buf[..n].to_vec())
        .map_err(|_| err("strftime_now: the formatted time is not UTF-8"))
}

/// Collects rendered text up to `cap` bytes; a write past it fails, which stops rendering.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.overflowed = true;
            return Err(std::io::Error::other("template output too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Refuses a template whose text could nest minijinja's recursion past its stack: too
/// long, a tag with too many tokens, or blocks nested too deep (`template_limits`). A
/// coarse lexer of Jinja's tags: it only needs an upper bound on nesting, so it counts
/// every word and punctuation mark of a tag, and `{% raw %}` bodies are skipped.
pub fn check_shape(template: &str) -> Result<()> {
    use template_limits::*;
    if template.len() > MAX_TEMPLATE_BYTES {
        bail!(
            "is {} KiB, more than the {} KiB a template may have",
            template.len() >> 10,
            MAX_TEMPLATE_BYTES >> 10
        );
    }
    let b = template.as_bytes();
    // Open blocks, each with how many levels it nests (an `if` with n `elif`s: n + 1).
    let mut open: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(at) = find(b, i, b"{") {
        let kind = b.get(at + 1).copied();
        let close: &[u8] = match kind {
            Some(b'{') => b"}}",
            Some(b'%') => b"%}",
            Some(b'#') => {
                i = find(b, at + 2, b"#}").map_or(b.len(), |e| e + 2);
                continue;
            }
            _ => {
                i = at + 1;
                continue;
            }
        };
        let tag = scan_tag(b, at + 2, close);
        if tag.tokens > MAX_TAG_TOKENS {
            bail!(
                "has a tag of more than {MAX_TAG_TOKENS} tokens (at byte {at}); chains that long nest past what rendering allows"
            );
        }
        i = tag.end;
        if kind != Some(b'%') {
            continue;
        }
        match tag.first_word.as_str() {
            "raw" => {
                // Everything up to `{% endraw %}` is text.
                i = find_endraw(b, i).unwrap_or(b.len());
            }
            "if" | "for" | "macro" | "call" | "filter" | "with" | "block" | "autoescape" => {
                open.push(1);
                depth += 1;
            }
            // `{% set x %}…{% endset %}` captures a block; `{% set x = … %}` does not.
            "set" if !tag.assigns => {
                open.push(1);
                depth += 1;
            }
            "elif" => {
                if let Some(top) = open.last_mut() {
                    *top += 1;
                    depth += 1;
                }
            }
            w if w.starts_with("end") => {
                depth -= open.pop().unwrap_or(0);
            }
            _ => {}
        }
        if depth > MAX_BLOCK_DEPTH {
            bail!("nests blocks more than {MAX_BLOCK_DEPTH} deep (at byte {at})");
        }
    }
    Ok(())
}

/// What `check_shape` needs of one tag.
struct Tag {
    /// Words and punctuation marks (a string literal counts one).
    tokens: usize,
    /// The tag's first word (`if`, `endfor`, …), empty if it starts otherwise.
    first_word: String,
    /// Whether an `=` (not `==`, `!=`, `<=`, `>=`) appears outside string literals.
    assigns: bool,
    /// Index just past the closing delimiter (or the end of the text).
    end: usize,
}

fn scan_tag(b: &[u8], start: usize, close: &[u8]) -> Tag {
    let mut tag = Tag {
        tokens: 0,
        first_word: String::new(),
        assigns: false,
        end: b.len(),
    };
    let mut i = start;
    // Whitespace control (`{%-`, `{{+`) is not a token.
    if matches!(b.get(i), Some(b'-' | b'+')) {
        i += 1;
    }
    while i < b.len() {
        let c = b[i];
        if b[i..].starts_with(close) {
            tag.end = i + close.len();
            break;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        tag.tokens += 1;
        if c == b'\'' || c == b'"' {
            i += 1;
            while i < b.len() && b[i] != c {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] >= 0x80) {
                i += 1;
            }
            if tag.tokens == 1 {
                tag.first_word = String::from_utf8_lossy(&b[s..i]).into_owned();
            }
        } else {
            if c == b'='
                && !matches!(b.get(i + 1), Some(b'='))
                && !matches!(
                    i.checked_sub(1).map(|p| b[p]),
                    Some(b'=' | b'!' | b'<' | b'>')
                )
            {
                tag.assigns = true;
            }
            i += 1;
        }
    }
    tag
}

fn find(b: &[u8], from: usize, pat: &[u8]) -> Option<usize> {
    b.get(from..)?
        .windows(pat.len())
        .position(|w| w == pat)
        .map(|p| p + from)
}

/// Index just past the `{% endraw %}` (any whitespace control) at or after `from`.
fn find_endraw(b: &[u8], mut from: usize) -> Option<usize> {
    while let Some(at) = find(b, from, b"{%") {
        let tag = scan_tag(b, at + 2, b"%}");
        if tag.first_word == "endraw" {
            return Some(tag.end);
        }
        from = at + 2;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::template_limits::*;
    use super::*;

    fn render(t: &str) -> Result<String> {
        render_template(
            "test",
            t,
            minijinja::context! { messages => Vec::<()>::new() },
        )
    }

    /// gpt-oss's chat template (openai's, as llama.cpp ships it: `strftime_now`, macros,
    /// `namespace`, `tojson`) renders as transformers renders it (jinja2, recorded in
    /// tests/data/gpt_oss/chat_template_reference.json with the date fixed).
    #[test]
    fn gpt_oss_template_renders_as_transformers_does() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gpt_oss");
        let template = std::fs::read_to_string(format!("{dir}/chat_template.jinja")).unwrap();
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{dir}/chat_template_reference.json")).unwrap(),
        )
        .unwrap();
        let today = strftime_now("%Y-%m-%d".into()).unwrap();
        assert_eq!(today.len(), 10, "{today}");
        for (name, case) in reference["cases"].as_object().unwrap() {
            let ctx = minijinja::context! {
                messages => minijinja::Value::from_serialize(&case["messages"]),
                add_generation_prompt => true,
                bos_token => "<|startoftext|>",
                eos_token => "<|return|>",
            };
            let got = render_template("gpt-oss", &template, ctx).unwrap();
            let got = got.replace(
                &format!("Current date: {today}"),
                "Current date: 2026-01-02",
            );
            assert_eq!(got, case["rendered"].as_str().unwrap(), "{name}");
        }
    }

    #[test]
    fn strftime_now_formats_and_refuses_bad_formats() {
        let year: i32 = strftime_now("%Y".into()).unwrap().parse().unwrap();
        assert!((2024..3000).contains(&year));
        assert_eq!(strftime_now("".into()).unwrap(), "");
        assert!(strftime_now("a\0b".into()).is_err());
        assert!(strftime_now("%Y".repeat(100)).is_err()); // 400 bytes: over the cap
    }

    /// Every real template shipped with the reference models passes the shape check.
    #[test]
    fn real_templates_have_an_ordinary_shape() {
        let chatml = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        check_shape(chatml).unwrap();
        let with_raw = "{% raw %}{% endif %}{% endif %}{{ a|b|c }}{% endraw %}{% if x %}{% elif y %}{% else %}{% endif %}{% set s %}x{% endset %}{% set t = 1 %}";
        check_shape(with_raw).unwrap();
    }

    #[test]
    fn long_chains_and_deep_blocks_are_refused_before_parsing() {
        // Each would overflow a thread's stack inside minijinja (an abort, not a panic).
        let filters = format!("{{{{ 'x'{} }}}}", "|lower".repeat(200_000 / 6));
        let concat = format!("{{{{ 'a'{} }}}}", "~'a'".repeat(40_000));
        let attrs = format!("{{{{ x{} }}}}", ".y".repeat(60_000));
        let ifs = format!(
            "{}x{}",
            "{% if 1 %}".repeat(20_000),
            "{% endif %}".repeat(20_000)
        );
        let elifs = format!("{{% if 0 %}}{}{{% endif %}}", "{% elif 0 %}".repeat(20_000));
        for (what, t) in [
            ("filters", filters),
            ("concat", concat),
            ("attrs", attrs),
            ("ifs", ifs),
            ("elifs", elifs),
        ] {
            let e = render(&t).expect_err(what).to_string();
            assert!(e.starts_with("chat template from test: "), "{what}: {e}");
        }
        // Raw blocks cannot hide closers that would reset the count.
        let cheat = format!(
            "{}{{% raw %}}{}{{% endraw %}}{}",
            "{% if 1 %}".repeat(90),
            "{% endif %}".repeat(90),
            "{% if 1 %}".repeat(20)
        );
        assert!(check_shape(&cheat).is_err());
        assert!(check_shape(&"x".repeat(MAX_TEMPLATE_BYTES + 1)).is_err());
    }

    #[test]
    fn shapes_at_the_limits_render_without_overflowing() {
        // The deepest the shape check lets through must render (or fail) cleanly.
        let chain = format!("{{{{ 'x'{} }}}}", "|lower".repeat(MAX_TAG_TOKENS / 2 - 2));
        assert_eq!(render(&chain).unwrap(), "x");
        let concat = format!("{{{{ 'a'{} }}}}", "~'a'".repeat(MAX_TAG_TOKENS / 2 - 2));
        assert_eq!(render(&concat).unwrap().len(), MAX_TAG_TOKENS / 2 - 1);
        let blocks = format!(
            "{}x{}",
            "{% if 1 %}".repeat(MAX_BLOCK_DEPTH),
            "{% endif %}".repeat(MAX_BLOCK_DEPTH)
        );
        assert_eq!(render(&blocks).unwrap(), "x");
    }

    #[test]
    fn values_nested_as_deep_as_the_fuel_allows_are_printed_and_dropped() {
        // One list level per loop iteration, as deep as the fuel lets a loop go; printing
        // and dropping them recurse once per level.
        for (body, show) in [
            ("{% set ns.x = [ns.x] %}", "{{ ns.x }}"),
            ("{% set ns.x = [ns.x] %}", "{{ ns.x|tojson }}"),
            ("{% set ns.x = {'a': ns.x} %}", "{{ ns.x == ns.x }}"),
        ] {
            let t = format!(
                "{{% set ns = namespace(x=[]) %}}{{% for i in range(100000) %}}{{% for j in range(100) %}}{body}{{% endfor %}}{{% endfor %}}{show}"
            );
            // Out of fuel or memory, or rendered: any of them, as long as it returns.
            let _ = render(&t);
        }
    }

    #[test]
    fn size_arguments_that_overflow_are_errors() {
        for t in [
            "{{ 'a' * 4611686018427387904 }}",
            "{{ [1, 2]|batch(4611686018427387904)|list }}",
            "{{ [1, 2]|slice(4611686018427387904)|list }}",
            "{{ '%9223372036854775807s'|format('x') }}",
            "{{ 'x'|indent(4611686018427387904) }}",
            "{{ 'x'|center(4611686018427387904) }}",
        ] {
            let e = render(t).expect_err(t).to_string();
            assert!(e.starts_with("chat template from test: "), "{t}: {e}");
        }
    }
}
