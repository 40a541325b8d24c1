//! Tokenizer and chat template, from a Hugging Face directory or from GGUF metadata.
//!
//! GGUF tokenizers are rebuilt from the file's vocab + merges according to
//! `tokenizer.ggml.pre`; an unknown `pre` type is refused rather than guessed, since a
//! wrong pre-tokenizer silently produces different token ids.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::{config, files};
use candle_core::quantized::gguf_file::Value;
use tokenizers::{
    decoders::{
        byte_fallback::ByteFallback, byte_level::ByteLevel as ByteLevelDecoder, fuse::Fuse,
        sequence::Sequence as DecoderSequence, strip::Strip, DecoderWrapper,
    },
    models::bpe::BPE,
    normalizers::{
        prepend::Prepend, replace::Replace, unicode::NFC, NormalizerWrapper,
        Sequence as NormalizerSequence,
    },
    pre_tokenizers::{
        byte_level::ByteLevel, digits::Digits, sequence::Sequence, split::Split,
        split::SplitPattern, PreTokenizerWrapper,
    },
    processors::{
        byte_level::ByteLevel as ByteLevelProcessor, sequence::Sequence as PostSequence,
        template::TemplateProcessing, PostProcessorWrapper,
    },
    AddedToken, SplitDelimiterBehavior,
};

/// A chat template and where it came from (named in its errors).
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// E.g. "tokenizer_config.json chat_template" or "GGUF tokenizer.chat_template".
    pub source: String,
    pub text: String,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Prepend BOS to plain (non-chat) prompts (GGUF `add_bos_token`; HF does it in its post-processor).
    add_bos: Option<u32>,
    /// Ids that end generation (from generation_config / tokenizer metadata).
    pub eos_token_ids: Vec<u32>,
}

/// The regexes llama.cpp names by `tokenizer.ggml.pre` (same as the models' tokenizer.json).
const REGEX_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's (llama.cpp's `qwen35`): Qwen2's with combining marks (`\p{M}`) kept in words.
const REGEX_QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const REGEX_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// o200k (gpt-oss, GPT-4o; llama.cpp's `gpt-4o` / `llama4`): gpt-oss's tokenizer.json regex.
const REGEX_O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn regex_then_bytelevel(regex: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| anyhow::anyhow!("tokenizer regex: {e}"))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])
    .into())
}

fn gguf_strings(md: &HashMap<String, Value>, key: &str) -> Result<Vec<String>> {
    let arr = md
        .get(key)
        .with_context(|| format!("GGUF metadata is missing {key}"))?;
    let arr = arr
        .to_vec()
        .map_err(|_| anyhow::anyhow!("GGUF {key} is not an array"))?;
    arr.iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|_| anyhow::anyhow!("GGUF {key} holds a non-string"))
        })
        .collect()
}

fn gguf_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key).and_then(|v| match v {
        Value::U32(x) => Some(*x),
        Value::I32(x) => u32::try_from(*x).ok(),
        Value::U64(x) => u32::try_from(*x).ok(),
        Value::I64(x) => u32::try_from(*x).ok(),
        Value::U16(x) => Some(*x as u32),
        Value::U8(x) => Some(*x as u32),
        _ => None,
    })
}

/// The chat template of an architecture whose GGUF files usually carry none (base-model
/// conversions): Gemma 3's published template (google/gemma-3-*-it `chat_template`).
fn builtin_chat_template(arch: Option<&str>) -> Option<ChatTemplate> {
    match arch? {
        "gemma3" => Some(ChatTemplate {
            source: "strata's built-in Gemma 3 template (the GGUF has none)".into(),
            text: include_str!("template/gemma3.jinja").into(),
        }),
        _ => None,
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes: byte-level BPE (`gpt2`) or SentencePiece
    /// BPE (`llama`).
    pub fn from_gguf(md: &HashMap<String, Value>) -> Result<Self> {
        let model = md
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        let tokens = gguf_strings(md, "tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            bail!("GGUF tokenizer.ggml.tokens is empty: the model has no vocabulary");
        }
        if u32::try_from(tokens.len()).is_err() {
            bail!("GGUF tokenizer.ggml.tokens has more than 2^32 entries");
        }
        let types = md
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok());
        if let Some(types) = types {
            if types.len() != tokens.len() {
                bail!(
                    "GGUF tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                    types.len(),
                    tokens.len()
                );
            }
        }
        let of_type = |want: i64| -> Vec<usize> {
            types
                .map(|t| {
                    t.iter()
                        .enumerate()
                        .filter(|(_, v)| match v {
                            Value::I32(x) => *x as i64 == want,
                            Value::U32(x) => *x as i64 == want,
                            _ => false,
                        })
                        .map(|(i, _)| i)
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut inner = match model {
            Some("gpt2") => byte_level_bpe(md, &tokens)?,
            Some("llama") => {
                let add_prefix = md
                    .get("tokenizer.ggml.add_space_prefix")
                    .and_then(|v| v.to_bool().ok())
                    .unwrap_or(true);
                let (inner, vocab) = sentencepiece_bpe(&tokens, add_prefix)?;
                // User-defined tokens (type 4: newline and tab runs, markup) are matched whole
                // before the model, as llama.cpp and transformers do.
                let user: Vec<AddedToken> = of_type(4)
                    .into_iter()
                    .filter(|&i| vocab.contains_key(&tokens[i]))
                    .map(|i| AddedToken::from(tokens[i].clone(), false).normalized(false))
                    .collect();
                let mut inner = inner;
                inner
                    .add_tokens(user)
                    .map_err(|e| anyhow::anyhow!("adding user-defined tokens: {e}"))?;
                inner
            }
            other => bail!(
                "unsupported GGUF tokenizer model {:?} (supported: gpt2 byte-level BPE, llama SentencePiece BPE)",
                other.unwrap_or("none")
            ),
        };
        // Control tokens (type 3) are matched whole in text and skipped when decoding.
        let specials: Vec<AddedToken> = of_type(3)
            .into_iter()
            .map(|i| AddedToken::from(tokens[i].clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| anyhow::anyhow!("adding special tokens: {e}"))?;
        let bos_id = gguf_u32(md, "tokenizer.ggml.bos_token_id");
        let eos_id = gguf_u32(md, "tokenizer.ggml.eos_token_id");
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        let chat_template = md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .map(|text| ChatTemplate {
                source: "GGUF tokenizer.chat_template".into(),
                text: text.clone(),
            })
            .or_else(|| builtin_chat_template(arch));
        // A turn ends generation as the end of text does (llama.cpp's end-of-generation
        // tokens): Gemma's instruction-tuned models end their turn with <end_of_turn>.
        let end_of_turn = ["<end_of_turn>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t));
        Ok(Self {
            chat_template,
            bos_token: name(bos_id),
            eos_token: name(eos_id),
            add_bos: if add_bos { bos_id } else { None },
            eos_token_ids: eos_id.into_iter().chain(end_of_turn).collect(),
            inner,
        })
    }
    /// Loads `tokenizer.json`, `tokenizer_config.json` (or `chat_template.jinja`) and
    /// `generation_config.json` from a Hugging Face model directory. Token ids they name
    /// must lie below `vocab_size` (the model's).
    pub fn from_hf_dir(dir: &Path, config_eos: &[u32], vocab_size: usize) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = files::read_text(&path)?;
        let inner: tokenizers::Tokenizer =
            crate::errors::contain_panic(&path.display().to_string(), || {
                text.parse()
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
            })?;
        if inner.get_vocab_size(true) == 0 {
            bail!("{}: the vocabulary is empty", path.display());
        }
        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let p = dir.join(name);
            if !files::exists(&p) {
                return Ok(None);
            }
            let text = files::read_text(&p)?;
            Ok(Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("malformed {}", p.display()))?,
            ))
        };
        let tok_cfg = read_json("tokenizer_config.json")?.unwrap_or_default();
        let gen_cfg = read_json("generation_config.json")?.unwrap_or_default();
        let token_str = |v: Option<&serde_json::Value>| -> Option<String> {
            match v? {
                serde_json::Value::String(s) => Some(s.clone()),
                obj => obj
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(String::from),
            }
        };
        let mut chat_template = match tok_cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        }
        .map(|text| ChatTemplate {
            source: "tokenizer_config.json chat_template".into(),
            text,
        });
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && files::exists(&jinja) {
            chat_template = Some(ChatTemplate {
                source: "chat_template.jinja".into(),
                text: files::read_text(&jinja)?,
            });
        }
        let eos_token = token_str(tok_cfg.get("eos_token"));
        let gen_path = dir.join("generation_config.json");
        let mut eos_token_ids = config::json_token_ids("eos_token_id", gen_cfg.get("eos_token_id"))
            .with_context(|| format!("{}", gen_path.display()))?;
        if let Some(id) = eos_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
            bail!(
                "{}: eos_token_id {id} is outside the vocabulary ({vocab_size} tokens)",
                gen_path.display()
            );
        }
        if eos_token_ids.is_empty() {
            eos_token_ids = config_eos.to_vec();
        }
        if eos_token_ids.is_empty() {
            eos_token_ids.extend(eos_token.as_deref().and_then(|t| inner.token_to_id(t)));
        }
        Ok(Self {
            chat_template,
            bos_token: token_str(tok_cfg.get("bos_token")),
            eos_token,
            add_bos: None,
            eos_token_ids,
            inner,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes a prompt. `special` adds the model's own special tokens (BOS) for plain
    /// text; a rendered chat template already carries them.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, special)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if let (true, Some(bos)) = (special, self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// The bytes token `id` stands for (log-probabilities report them, as a piece of a
    /// character may be all a token holds): an added token's text as written; a
    /// byte-level BPE token's characters mapped back through GPT-2's byte table; a
    /// SentencePiece token with `▁` as a space and `<0xHH>` as its byte. Empty for an id
    /// outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Some(added) = self.inner.get_added_tokens_decoder().get(&id) {
            return added.content.as_bytes().to_vec();
        }
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        if self.byte_level() {
            if let Some(bytes) = piece.chars().map(byte_level_byte).collect() {
                return bytes;
            }
        }
        let hex = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| h.len() == 2);
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) => vec![b],
            None => piece.replace('\u{2581}', " ").into_bytes(),
        }
    }

    /// Whether tokens are GPT-2 byte-level strings (its decoder or pre-tokenizer says so).
    fn byte_level(&self) -> bool {
        let says = |v: Option<String>| v.is_some_and(|s| s.contains("\"ByteLevel\""));
        says(
            self.inner
                .get_decoder()
                .and_then(|d| serde_json::to_string(d).ok()),
        ) || says(
            self.inner
                .get_pre_tokenizer()
                .and_then(|p| serde_json::to_string(p).ok()),
        )
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow::anyhow!("detokenizing: {e}"))
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template with the prompt as one user turn, ready for generation.
    pub fn apply_chat_template(&self, user: &str) -> Result<String> {
        self.render_chat(&[ChatMessage {
            role: "user".into(),
            content: user.into(),
        }])
    }

    /// Renders the chat template over a conversation, ready for the assistant's next turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .context("the model has no chat template")?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        render_template(&template.source, &template.text, ctx)
    }

    /// This tokenizer as Hugging Face files say it, for frameworks that tokenize in front
    /// of strata (`server::model_card`): `tokenizer.json`, which encodes with special tokens
    /// exactly as `encode(text, true)` does (a GGUF `add_bos_token` becomes a template
    /// post-processor), and the `tokenizer_config.json` fields a frontend reads.
    pub fn to_hf_json(&self) -> Result<(serde_json::Value, serde_json::Value)> {
        let mut inner = self.inner.clone();
        if let Some(bos) = self.add_bos {
            let name = self
                .inner
                .id_to_token(bos)
                .with_context(|| format!("BOS id {bos} is not in the vocabulary"))?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{name} $A"))
                .and_then(|b| b.try_pair(format!("{name} $A $B")))
                .map_err(|e| anyhow::anyhow!("BOS template: {e}"))?
                .special_tokens(vec![(name, bos)])
                .build()
                .map_err(|e| anyhow::anyhow!("BOS template: {e}"))?;
            let processors: Vec<PostProcessorWrapper> = inner
                .get_post_processor()
                .cloned()
                .into_iter()
                .chain([template.into()])
                .collect();
            inner.with_post_processor(Some(PostSequence::new(processors)));
        }
        let text = inner
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("serializing the tokenizer: {e}"))?;
        let tokenizer_json = serde_json::from_str(&text)?;
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos.is_some(),
        });
        let fields = [
            ("bos_token", self.bos_token.clone()),
            ("eos_token", self.eos_token.clone()),
            (
                "chat_template",
                self.chat_template.as_ref().map(|t| t.text.clone()),
            ),
        ];
        for (key, value) in fields {
            if let Some(v) = value {
                config[key] = v.into();
            }
        }
        Ok((tokenizer_json, config))
    }
}

pub use super::template::render_template;

/// One turn of a conversation, as chat templates read it (`message.role`, `message.content`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`) with the merges the file lists and the
/// pre-tokenizer its `pre` names.
fn byte_level_bpe(md: &HashMap<String, Value>, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    let merges: Vec<(String, String)> = gguf_strings(md, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .context("malformed GGUF merge entry")
        })
        .collect::<Result<_>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| anyhow::anyhow!("building BPE from GGUF: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);

    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("default");
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        // SmolLM2's tokenizer.json: Digits(individual) then ByteLevel(add_prefix_space=false).
        "smollm" => {
            Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into()
        }
        "qwen2" => {
            inner.with_normalizer(Some(NFC)).map_err(|e| anyhow::anyhow!("{e}"))?;
            regex_then_bytelevel(REGEX_QWEN2)?
        }
        "qwen35" => {
            inner.with_normalizer(Some(NFC)).map_err(|e| anyhow::anyhow!("{e}"))?;
            regex_then_bytelevel(REGEX_QWEN35)?
        }
        "llama-bpe" | "llama3" | "smaug-bpe" => regex_then_bytelevel(REGEX_LLAMA3)?,
        "gpt-4o" | "llama4" => regex_then_bytelevel(REGEX_O200K)?,
        other => bail!("unsupported GGUF tokenizer pre-tokenizer `{other}` (supported: smollm, qwen2, qwen35, llama-bpe, gpt-4o)"),
    };
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    inner.with_post_processor(Some(ByteLevelProcessor::new(false, false, false)));
    Ok(inner)
}

/// Longest piece (in characters) that merges are derived for: SentencePiece's pieces are
/// short (its default limit is 16; Gemma's whitespace runs reach 31), and a hostile file's
/// megabyte-long token must not cost quadratic work.
const MAX_MERGED_PIECE_CHARS: usize = 128;

/// SentencePiece BPE (`tokenizer.ggml.model = llama`: Gemma, Llama 2, Mistral), built as
/// transformers' GGUF loader builds Gemma's: the merges, which the file does not list, are
/// every split of a token into two tokens,
/// ranked by the token's position (earlier first; in a split, the longer left piece
/// first); a space is written `▁` (and one is prepended when the file's
/// `add_space_prefix` says so), unknown characters fall back to `<0xHH>` byte tokens, and
/// decoding undoes both. Gemma's runs of spaces are user-defined tokens written with real
/// spaces, matched whole before the model (llama.cpp's way; transformers respells them
/// with `▁` and reaches the same ids). Returns the tokenizer and its vocabulary.
fn sentencepiece_bpe(
    tokens: &[String],
    add_prefix: bool,
) -> Result<(tokenizers::Tokenizer, tokenizers::models::bpe::Vocab)> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut merges = Vec::new();
    for t in tokens {
        let chars: Vec<(usize, char)> = t.char_indices().collect();
        if chars.len() < 2 || chars.len() > MAX_MERGED_PIECE_CHARS {
            continue;
        }
        let mut local: Vec<(&str, &str)> = chars[1..]
            .iter()
            .map(|&(at, _)| t.split_at(at))
            .filter(|(l, r)| vocab.contains_key(*l) && vocab.contains_key(*r))
            .collect();
        // transformers: within a token by (left id, right id); across tokens by the
        // token's position, then the longer left piece, then the longer right piece.
        local.sort_by_key(|(l, r)| (vocab[*l], vocab[*r]));
        local.sort_by_key(|(l, r)| {
            (
                std::cmp::Reverse(l.chars().count()),
                std::cmp::Reverse(r.chars().count()),
            )
        });
        merges.extend(
            local
                .into_iter()
                .map(|(l, r)| (l.to_string(), r.to_string())),
        );
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .byte_fallback(true)
        .fuse_unk(true)
        .unk_token("<unk>".into())
        .build()
        .map_err(|e| anyhow::anyhow!("building SentencePiece BPE from GGUF: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space = Replace::new(" ", "\u{2581}").map_err(|e| anyhow::anyhow!("{e}"))?;
    let normalizer: NormalizerWrapper = if add_prefix {
        NormalizerSequence::new(vec![Prepend::new("\u{2581}".into()).into(), space.into()]).into()
    } else {
        space.into()
    };
    inner
        .with_normalizer(Some(normalizer))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let unspace = Replace::new("\u{2581}", " ").map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        unspace.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok((inner, vocab))
}

/// GPT-2's byte-level alphabet read backwards: the printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100 onwards, in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    match u32::from(c) {
        n @ 0..=255 if printable(n as u8) => Some(n as u8),
        n @ 256..=323 => (0..=255u8).filter(|&b| !printable(b)).nth(n as usize - 256),
        _ => None,
    }
}

/// Turns a growing list of token ids into text pieces as soon as they are complete UTF-8,
/// so multi-token characters (emoji, CJK) print whole.
pub struct StreamDecoder {
    ids: Vec<u32>,
    printed: usize, // bytes of the decoded text already emitted
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            printed: 0,
        }
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = tok.decode(&self.ids, true)?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.printed {
            return Ok(None);
        }
        let Some(piece) = text.get(self.printed..).map(String::from) else {
            return Ok(None);
        };
        self.printed = text.len();
        Ok(Some(piece))
    }
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece BPE vocabulary as Llama 2's GGUF files write one (`llama`, with a
    /// space prefix): SentencePiece's own rules say "Hello world" is `▁Hello ▁world`, an
    /// unknown character falls back to its UTF-8 bytes, and decoding drops the prefix.
    #[test]
    fn sentencepiece_with_a_space_prefix_splits_and_decodes_as_sentencepiece_does() {
        let s = |x: &str| Value::String(x.into());
        let mut tokens = vec!["<unk>", "<s>", "</s>"];
        let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(bytes.iter().map(String::as_str));
        // Merge ranks follow the order: ll, llo, He, Hello, ▁Hello, or, ld, orld, ▁w, ▁world.
        let words = [
            "▁", "H", "e", "l", "o", "w", "r", "d", "ll", "llo", "He", "Hello", "▁Hello", "or",
            "ld", "orld", "▁w", "▁world",
        ];
        tokens.extend(words);
        // SentencePiece's types: unknown 2, control 3, byte 6, normal 1.
        let types = [2, 3, 3].into_iter().chain([6; 256]).chain([1; 18]);
        let md = HashMap::from([
            ("tokenizer.ggml.model".into(), s("llama")),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(types.map(Value::I32).collect()),
            ),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ]);
        let tok = Tokenizer::from_gguf(&md).unwrap();
        let id = |t: &str| tokens.iter().position(|x| *x == t).unwrap() as u32;
        let ids = tok.encode("Hello world", true).unwrap();
        assert_eq!(ids, [1, id("▁Hello"), id("▁world")]);
        assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world");
        // "é" is not in the vocabulary: its two UTF-8 bytes, and back.
        let ids = tok.encode("é", false).unwrap();
        assert_eq!(ids, [id("▁"), id("<0xC3>"), id("<0xA9>")]);
        assert_eq!(tok.decode(&ids, true).unwrap(), "é");
        assert_eq!(tok.token_bytes(id("▁world")), b" world");
    }

    /// Qwen3.5's pre-tokenizer (`qwen35`) keeps a combining mark in its word, Qwen2's splits
    /// it off (their tokenizer.json regexes as llama.cpp quotes them): "x\u{301}" (no
    /// precomposed form, so NFC leaves it) merges into one token only under `qwen35`.
    #[test]
    fn the_qwen35_pre_tokenizer_keeps_combining_marks_in_words() {
        let s = |x: &str| Value::String(x.into());
        // Byte-level symbols: 0xCC is `Ì`, 0x81 is `ģ` (GPT-2's byte-to-unicode table).
        let tokens = [
            "<s>",
            "</s>",
            "x",
            "\u{cc}",
            "\u{123}",
            "\u{cc}\u{123}",
            "x\u{cc}\u{123}",
        ];
        let md = |pre: &str| {
            HashMap::from([
                ("tokenizer.ggml.model".into(), s("gpt2")),
                ("tokenizer.ggml.pre".into(), s(pre)),
                (
                    "tokenizer.ggml.tokens".into(),
                    Value::Array(tokens.iter().map(|t| s(t)).collect()),
                ),
                (
                    "tokenizer.ggml.token_type".into(),
                    Value::Array([3, 3, 1, 1, 1, 1, 1].map(Value::I32).to_vec()),
                ),
                (
                    "tokenizer.ggml.merges".into(),
                    Value::Array(vec![s("\u{cc} \u{123}"), s("x \u{cc}\u{123}")]),
                ),
            ])
        };
        let encode = |pre: &str| {
            let tok = Tokenizer::from_gguf(&md(pre)).unwrap();
            tok.encode("x\u{301}", false).unwrap()
        };
        assert_eq!(encode("qwen35"), [6]);
        assert_eq!(encode("qwen2"), [2, 5]);
    }

    /// A four-letter byte-level vocabulary with a BOS that GGUF says to add.
    fn bos_gguf() -> HashMap<String, Value> {
        let s = |x: &str| Value::String(x.into());
        let tokens = ["<s>", "</s>", "a", "b", "ab", "\u{120}"];
        HashMap::from([
            ("tokenizer.ggml.model".into(), s("gpt2")),
            ("tokenizer.ggml.pre".into(), s("smollm")),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array([3, 3, 1, 1, 1, 1].map(Value::I32).to_vec()),
            ),
            ("tokenizer.ggml.merges".into(), Value::Array(vec![s("a b")])),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(0)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(1)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ])
    }

    #[test]
    fn the_exported_tokenizer_json_adds_bos_as_gguf_says() {
        let tok = Tokenizer::from_gguf(&bos_gguf()).unwrap();
        let (json, config) = tok.to_hf_json().unwrap();
        let exported: tokenizers::Tokenizer = json.to_string().parse().unwrap();
        for text in ["ab", "ab ab", "b a"] {
            let ours = tok.encode(text, true).unwrap();
            assert_eq!(ours[0], 0, "{text}: {ours:?}");
            let theirs = exported.encode(text, true).unwrap().get_ids().to_vec();
            assert_eq!(theirs, ours, "{text}");
            let plain = exported.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(plain, tok.encode(text, false).unwrap(), "{text}");
        }
        assert_eq!(config["bos_token"], "<s>");
        assert_eq!(config["eos_token"], "</s>");
        assert_eq!(config["add_bos_token"], true);
    }
}
