//! Mutations: structure-aware ones per format (GGUF fields and tensor layout, JSON values,
//! template syntax) stacked with byte-level ones (flips, boundary integers, truncation).

use std::sync::OnceLock;

use candle_core::quantized::gguf_file::Value as G;
use rand::{rngs::StdRng, Rng};
use serde_json::Value as J;

use super::corpus;
use super::gguf_writer::GgufDoc;
use super::{Case, Target};

/// Integers at the edges that break size arithmetic.
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    3,
    7,
    255,
    4096,
    65535,
    65536,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 53,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX,
];

pub(super) fn interesting(rng: &mut StdRng) -> u64 {
    INTERESTING[rng.random_range(0..INTERESTING.len())]
}

const FLOATS: [f64; 10] = [
    0.0,
    -0.0,
    -1.0,
    0.5,
    1e-300,
    1e30,
    1e308,
    f64::INFINITY,
    f64::NEG_INFINITY,
    f64::NAN,
];

const STRINGS: [&str; 12] = [
    "",
    "llama",
    "gemma3",
    "a\nb\r\u{1b}[31m",
    "\u{202e}llama",
    "yarn",
    "linear",
    "llama3",
    "none",
    "gpt2",
    "{{",
    " ",
];

pub fn mutate(target: Target, pick: &Case, base: &[Case], rng: &mut StdRng) -> Case {
    let mut case = pick.clone();
    let rounds = rng.random_range(1..=4);
    for _ in 0..rounds {
        match target {
            Target::Gguf => mutate_gguf(&mut case, rng),
            Target::Safetensors => mutate_hf_dir(&mut case, rng),
            Target::Tokenizer => mutate_tokenizer_files(&mut case, rng),
            Target::Http => super::http::mutate_http(&mut case, rng),
            Target::Disk => super::disk::mutate_disk(&mut case, rng),
            Target::Flags => super::flags::mutate_flags(&mut case, rng),
            Target::GgufMeta => super::gguf_meta::mutate_gguf_meta(&mut case, rng),
            Target::HttpPipelined => super::http::mutate_pipelined(&mut case, rng),
            Target::KvEvents => super::kv_events::mutate_kv_events(&mut case, rng),
            Target::Template => {
                let other = &base[rng.random_range(0..base.len())];
                let text = mutate_text(case.get("template").unwrap_or_default(), other, rng);
                case.set("template", text);
            }
        }
    }
    case
}

// ---------------------------------------------------------------------------------------
// bytes

pub fn mutate_bytes(data: &mut Vec<u8>, rng: &mut StdRng) {
    if data.is_empty() {
        data.push(rng.random());
        return;
    }
    let at = rng.random_range(0..data.len());
    match rng.random_range(0..7) {
        0 => data[at] ^= 1 << rng.random_range(0..8),
        1 => data[at] = [0u8, 0xff, 0x7f, 0x80, b'\n', b'"'][rng.random_range(0..6)],
        2 => data.truncate(at),
        3 => {
            let n = rng.random_range(1..64).min(data.len() - at);
            let chunk = data[at..at + n].to_vec();
            let to = rng.random_range(0..data.len());
            data.splice(to..to, chunk);
        }
        4 => {
            // A boundary integer, little-endian, 4 or 8 bytes wide.
            let v = interesting(rng).to_le_bytes();
            let w = if rng.random() { 4 } else { 8 };
            for (i, b) in v.iter().take(w).enumerate() {
                if let Some(x) = data.get_mut(at + i) {
                    *x = *b;
                }
            }
        }
        5 => {
            let n = rng.random_range(1..16).min(data.len() - at);
            data.drain(at..at + n);
        }
        _ => {
            let n = rng.random_range(1..16);
            let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            data.splice(at..at, junk);
        }
    }
}

// ---------------------------------------------------------------------------------------
// GGUF

fn gguf_docs() -> &'static [GgufDoc; corpus::GGUF_ARCHS.len()] {
    static DOCS: OnceLock<[GgufDoc; corpus::GGUF_ARCHS.len()]> = OnceLock::new();
    DOCS.get_or_init(|| corpus::GGUF_ARCHS.map(corpus::gguf_doc))
}

/// Structural mutations happen on the document; once serialised, later rounds mutate bytes.
fn mutate_gguf(case: &mut Case, rng: &mut StdRng) {
    let bytes = case.get("model.gguf").unwrap_or_default().to_vec();
    let docs = gguf_docs();
    let pristine = docs.iter().find(|d| d.to_bytes() == bytes);
    let out = match pristine {
        Some(doc) if rng.random_range(0..10) < 8 => {
            let mut doc = doc.clone();
            for _ in 0..rng.random_range(1..=3) {
                mutate_gguf_doc(&mut doc, rng);
            }
            doc.to_bytes()
        }
        _ => {
            let mut b = bytes;
            mutate_bytes(&mut b, rng);
            b
        }
    };
    case.set("model.gguf", out);
}

fn gguf_value(rng: &mut StdRng, like: &G) -> G {
    let n = interesting(rng);
    let f = FLOATS[rng.random_range(0..FLOATS.len())];
    match rng.random_range(0..12) {
        0 => G::U8(n as u8),
        1 => G::I8(n as i8),
        2 => G::U16(n as u16),
        3 => G::I32(n as i32),
        4 => G::U64(n),
        5 => G::I64(n as i64),
        6 => G::F32(f as f32),
        7 => G::F64(f),
        8 => G::Bool(rng.random()),
        9 => G::String(STRINGS[rng.random_range(0..STRINGS.len())].into()),
        10 => G::Array(vec![]),
        // The same type as before, a boundary value.
        _ => match like {
            G::U32(_) => G::U32(n as u32),
            G::F32(_) => G::F32(f as f32),
            other => other.clone(),
        },
    }
}

/// Keys a hostile file might add (or double): they change sizes and dispatch.
fn gguf_extra_key(rng: &mut StdRng, arch: &str) -> String {
    let keys = [
        "general.alignment",
        "general.architecture",
        "block_count",
        "attention.key_length",
        "vocab_size",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.freq_base",
        "context_length",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
        "tokenizer.ggml.add_bos_token",
    ];
    let k = keys[rng.random_range(0..keys.len())];
    if k.contains('.') && (k.starts_with("general") || k.starts_with("tokenizer")) {
        k.to_string()
    } else {
        format!("{arch}.{k}")
    }
}

fn mutate_gguf_doc(doc: &mut GgufDoc, rng: &mut StdRng) {
    let arch = match doc
        .metadata
        .iter()
        .find(|(k, _)| k == "general.architecture")
    {
        Some((_, G::String(s))) => s.clone(),
        _ => "llama".into(),
    };
    match rng.random_range(0..12) {
        0..=2 => {
            let i = rng.random_range(0..doc.metadata.len().max(1));
            if let Some((_, v)) = doc.metadata.get_mut(i) {
                *v = gguf_value(rng, v);
            }
        }
        3 => {
            if !doc.metadata.is_empty() {
                let i = rng.random_range(0..doc.metadata.len());
                doc.metadata.remove(i);
            }
        }
        4 => {
            let key = gguf_extra_key(rng, &arch);
            let v = gguf_value(rng, &G::U32(0));
            doc.metadata.push((key, v));
        }
        5 => {
            // Arrays: the vocabulary, token types and merges change length or content.
            let arrays: Vec<usize> = (0..doc.metadata.len())
                .filter(|&i| matches!(doc.metadata[i].1, G::Array(_)))
                .collect();
            if let Some(&i) = arrays.get(rng.random_range(0..arrays.len().max(1))) {
                if let G::Array(items) = &mut doc.metadata[i].1 {
                    match rng.random_range(0..4) {
                        0 => items.truncate(rng.random_range(0..=items.len())),
                        1 => {
                            let extra = items.last().cloned().unwrap_or(G::I32(3));
                            items.extend(std::iter::repeat_n(extra, rng.random_range(1..40)));
                        }
                        2 if !items.is_empty() => {
                            let j = rng.random_range(0..items.len());
                            items[j] = gguf_value(rng, &items[j].clone());
                        }
                        _ => items.clear(),
                    }
                }
            }
        }
        6..=8 => {
            let i = rng.random_range(0..doc.tensors.len().max(1));
            let Some(t) = doc.tensors.get_mut(i) else {
                return;
            };
            match rng.random_range(0..6) {
                0 => {
                    if !t.dims.is_empty() {
                        let d = rng.random_range(0..t.dims.len());
                        t.dims[d] = if rng.random() {
                            interesting(rng)
                        } else {
                            t.dims[d] * 2
                        };
                    }
                }
                1 => t.dims.push(interesting(rng)),
                2 => {
                    t.ggml_type =
                        [0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 14, 15, 30, 99][rng.random_range(0..14)]
                }
                3 => t.offset = Some(interesting(rng)),
                4 => {
                    let n = t.data.len();
                    t.data.truncate(rng.random_range(0..=n));
                }
                _ => t.dims.reverse(),
            }
        }
        9 => {
            // Layout: a misaligned or overlapping offset.
            let n = doc.tensors.len();
            if n >= 2 {
                let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
                let base = doc.tensors[..b]
                    .iter()
                    .map(|t| t.data.len() as u64)
                    .sum::<u64>();
                doc.tensors[a].offset = Some(if rng.random() { base } else { base + 1 });
            }
        }
        10 => {
            if !doc.tensors.is_empty() {
                let i = rng.random_range(0..doc.tensors.len());
                if rng.random() {
                    doc.tensors.remove(i);
                } else {
                    let t = doc.tensors[i].clone();
                    doc.tensors.push(t);
                }
            }
        }
        _ => {
            if rng.random() {
                doc.version = [1, 2, 3, 4][rng.random_range(0..4)];
            } else {
                doc.layout_alignment = [1, 8, 32, 64, 4096][rng.random_range(0..5)];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// JSON

fn json_value(rng: &mut StdRng) -> J {
    match rng.random_range(0..9) {
        0 | 1 => J::from(interesting(rng)),
        2 => J::from(-(interesting(rng) as i64).abs().max(1)),
        3 => serde_json::Number::from_f64(FLOATS[rng.random_range(0..7)])
            .map(J::Number)
            .unwrap_or(J::Null),
        4 => J::from(STRINGS[rng.random_range(0..STRINGS.len())]),
        5 => J::Null,
        6 => J::Bool(rng.random()),
        7 => J::Array(vec![J::from(interesting(rng)), J::from("x")]),
        _ => J::Object(Default::default()),
    }
}

/// Every value's position in the tree, as a JSON pointer.
fn pointers(v: &J, at: String, out: &mut Vec<String>) {
    match v {
        J::Object(m) => {
            for (k, x) in m {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        J::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(x, p, out);
            }
        }
        _ => {}
    }
}

pub fn mutate_json(v: &mut J, rng: &mut StdRng) {
    let mut ptrs = Vec::new();
    pointers(v, String::new(), &mut ptrs);
    if ptrs.is_empty() {
        *v = json_value(rng);
        return;
    }
    let p = ptrs[rng.random_range(0..ptrs.len())].clone();
    match rng.random_range(0..6) {
        0 => {
            // Remove the member (or element).
            let (parent, last) = p.rsplit_once('/').unwrap_or(("", &p));
            let last = last.replace("~1", "/").replace("~0", "~");
            match v.pointer_mut(parent) {
                Some(J::Object(m)) => {
                    m.remove(&last);
                }
                Some(J::Array(a)) => {
                    if let Ok(i) = last.parse::<usize>() {
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                }
                _ => {}
            }
        }
        1 => {
            // Numbers scaled or pushed past a boundary.
            if let Some(x) = v.pointer_mut(&p) {
                if let Some(n) = x.as_u64() {
                    *x = J::from(n.saturating_mul([2, 1000, 1 << 20][rng.random_range(0..3)]));
                } else if let Some(f) = x.as_f64() {
                    *x = serde_json::Number::from_f64(-f)
                        .map(J::Number)
                        .unwrap_or(J::Null);
                } else {
                    *x = json_value(rng);
                }
            }
        }
        2 => {
            if let Some(J::String(s)) = v.pointer_mut(&p) {
                let mut b = s.clone().into_bytes();
                mutate_bytes(&mut b, rng);
                *s = String::from_utf8_lossy(&b).into_owned();
            } else if let Some(x) = v.pointer_mut(&p) {
                *x = json_value(rng);
            }
        }
        _ => {
            if let Some(x) = v.pointer_mut(&p) {
                *x = json_value(rng);
            }
        }
    }
}

/// Mutates a JSON file of the case structurally (or its bytes when it does not parse).
fn mutate_json_file(case: &mut Case, name: &str, rng: &mut StdRng) {
    let bytes = case.get(name).unwrap_or_default().to_vec();
    let out = match serde_json::from_slice::<J>(&bytes) {
        Ok(mut v) if rng.random_range(0..10) < 8 => {
            mutate_json(&mut v, rng);
            v.to_string().into_bytes()
        }
        _ => {
            let mut b = bytes;
            mutate_bytes(&mut b, rng);
            b
        }
    };
    case.set(name, out);
}

/// safetensors: a header (u64 length, JSON of dtypes, shapes and data offsets), then data.
fn mutate_safetensors(data: &mut Vec<u8>, rng: &mut StdRng) {
    let header = data
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize)
        .and_then(|n| data.get(8..8usize.checked_add(n)?))
        .and_then(|h| serde_json::from_slice::<J>(h).ok());
    match header {
        Some(mut h) if rng.random_range(0..10) < 7 => {
            let old_len = 8 + serde_json::to_vec(&h).map_or(0, |v| v.len());
            mutate_json(&mut h, rng);
            let new = serde_json::to_vec(&h).unwrap_or_default();
            let body = data
                .get(old_len.min(data.len())..)
                .unwrap_or_default()
                .to_vec();
            let mut out = (new.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&new);
            out.extend_from_slice(&body);
            *data = out;
        }
        _ => mutate_bytes(data, rng),
    }
}

fn mutate_hf_dir(case: &mut Case, rng: &mut StdRng) {
    match rng.random_range(0..10) {
        0..=3 => mutate_json_file(case, "config.json", rng),
        4..=6 => {
            let mut st = case.get("model.safetensors").unwrap_or_default().to_vec();
            mutate_safetensors(&mut st, rng);
            case.set("model.safetensors", st);
        }
        7 => mutate_json_file(case, "generation_config.json", rng),
        8 => mutate_json_file(case, "tokenizer_config.json", rng),
        _ => mutate_json_file(case, "tokenizer.json", rng),
    }
}

fn mutate_tokenizer_files(case: &mut Case, rng: &mut StdRng) {
    match rng.random_range(0..10) {
        0..=3 => mutate_json_file(case, "tokenizer.json", rng),
        4..=5 => mutate_json_file(case, "tokenizer_config.json", rng),
        6..=7 => mutate_json_file(case, "generation_config.json", rng),
        _ => {
            let base = Case {
                files: vec![("template".into(), corpus::CHATML.into())],
            };
            let text = match case.get("chat_template.jinja") {
                Some(t) => mutate_text(t, &base, rng),
                None => mutate_text(corpus::CHATML.as_bytes(), &base, rng),
            };
            case.set("chat_template.jinja", text);
        }
    }
}

// ---------------------------------------------------------------------------------------
// templates

/// Pieces of template syntax that stress the engine: loops, recursion, huge values,
/// exceptions with control characters, broken syntax.
const SNIPPETS: [&str; 34] = [
    "{% for i in range(100000) %}",
    "{% endfor %}",
    "{% for x in range(99999) %}{% for y in range(99999) %}{{ x }}{% endfor %}{% endfor %}",
    "{{ 'a' * 100000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "{{ raise_exception('boom\nsecond line\u{1b}[2J') }}",
    "{{ messages[0]['content'] * 99999999 }}",
    "{% if %}",
    "{{",
    "}}",
    "{%",
    "%}",
    "{{ messages|tojson }}",
    "{{ (messages * 100000)|length }}",
    "{{ 10 ** 100 }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ '%s %s'|format(messages, 1) }}",
    "{{ undefined_var.attr.more }}",
    "{{ messages[9999] }}",
    "{{ 1 / 0 }}{{ 1 // 0 }}",
    "{% include 'x' %}",
    "{% extends 'chat' %}",
    "{% import 'chat' as c %}",
    "{% filter upper %}{{ 'a' * 1000000 }}{% endfilter %}",
    "{{ eos_token.ljust(100000000) }}",
    "{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
    "{{ lipsum(100000) }}",
    "{{ 'a'.replace('', 'bb') }}",
    "{{ bos_token.split('')|list }}",
    "{{ (range(99999)|list * 99999)|length }}",
    "{{ messages|map(attribute='content')|join('\n' * 1000000) }}",
    "{{ 'x' ~ messages ~ 'y' }}{{ -9223372036854775808 - 1 }}",
    "{{ ''.join(['a'] * 99999999) }}",
];

pub fn mutate_text(text: &[u8], other: &Case, rng: &mut StdRng) -> Vec<u8> {
    let mut t = text.to_vec();
    let at = |rng: &mut StdRng, t: &Vec<u8>| rng.random_range(0..=t.len());
    match rng.random_range(0..8) {
        0..=2 => {
            let s = SNIPPETS[rng.random_range(0..SNIPPETS.len())].as_bytes();
            let i = at(rng, &t);
            t.splice(i..i, s.iter().copied());
        }
        3 => {
            let (a, b) = (at(rng, &t), at(rng, &t));
            t.drain(a.min(b)..a.max(b));
        }
        4 => {
            let (a, b) = (at(rng, &t), at(rng, &t));
            let chunk = t[a.min(b)..a.max(b)].to_vec();
            let i = at(rng, &t);
            t.splice(i..i, chunk);
        }
        5 => {
            // Splice in a piece of another template.
            let o = other.get("template").unwrap_or_default();
            let (a, b) = (rng.random_range(0..=o.len()), rng.random_range(0..=o.len()));
            let i = at(rng, &t);
            t.splice(i..i, o[a.min(b)..a.max(b)].iter().copied());
        }
        6 => {
            // A number literal made huge.
            if let Some(i) = t.iter().position(|c| c.is_ascii_digit()) {
                let n = interesting(rng).to_string();
                t.splice(i..i + 1, n.bytes());
            } else {
                mutate_bytes(&mut t, rng);
            }
        }
        _ => mutate_bytes(&mut t, rng),
    }
    t
}
