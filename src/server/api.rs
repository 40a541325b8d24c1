//! The OpenAI request bodies we accept, their validation into an engine request, and the
//! response objects (whole and streamed) in the shapes OpenAI clients parse.

use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use crate::engine::SamplingParams;
use crate::model::config::GenerationDefaults;
use crate::model::tokenizer::ChatMessage;

/// At most this many stop strings, each at most `MAX_STOP_BYTES` long.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 1024;

/// Fields shared by `/v1/chat/completions` and `/v1/completions`. Unknown fields are
/// ignored (clients send many); a known field of the wrong type is a 400.
#[derive(Debug, Default, Deserialize)]
pub struct GenerationFields {
    pub model: String,
    pub max_tokens: Option<u64>,
    /// The chat endpoint's newer name for `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 or -1: no top-k cut.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Generate past end-of-sequence tokens up to `max_tokens` (vLLM's extension, for
    /// benchmarks with fixed output lengths).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Add the prompt's and the output's token ids to the response (vLLM's extension, for
    /// frameworks that speak token ids: `prompt_token_ids`, `token_ids`).
    pub return_token_ids: Option<bool>,
    /// Log-probabilities: an integer 0–20 on completions, `true` (with `top_logprobs`
    /// 0–20) on chat (`check_logprobs`).
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    /// Completions: the prompt echoed before the output (with its logprobs).
    pub echo: Option<Value>,
}

/// Most log-probabilities a token may carry (vLLM's and OpenAI's cap).
pub const MAX_LOGPROBS: u64 = 20;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub fields: GenerationFields,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<ContentIn>,
}

/// Message content: a string, or a list of parts of which only `text` parts are supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ContentIn {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Checked by `Prompt::parse` (its shapes are easier to tell apart by hand).
    pub prompt: Value,
    #[serde(flatten)]
    pub fields: GenerationFields,
}

/// A completion prompt, as OpenAI's API takes it: a string (or a list of one string), or
/// token ids (or a list of one list of them). Token ids are used as given: no BOS added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Reads the `prompt` field; token ids must lie in `0..vocab_size`.
    pub fn parse(v: &Value, vocab_size: usize) -> Result<Self, ApiError> {
        let shape = || {
            ApiError::bad_field(
                "prompt",
                "`prompt` must be a string, a list of one string, or a list of token ids",
            )
        };
        let one = |n: usize| {
            ApiError::bad_field(
                "prompt",
                format!("only one prompt per request is supported, got {n}"),
            )
        };
        let items = match v {
            Value::String(s) => return Ok(Prompt::Text(s.clone())),
            Value::Array(items) => items,
            _ => return Err(shape()),
        };
        match items.as_slice() {
            [] => Err(ApiError::bad_field("prompt", "the prompt is empty")),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(ids)] => Self::token_ids(ids, vocab_size),
            [first, ..] if first.is_number() => Self::token_ids(items, vocab_size),
            [Value::String(_) | Value::Array(_), ..] => Err(one(items.len())),
            _ => Err(shape()),
        }
    }

    fn token_ids(ids: &[Value], vocab_size: usize) -> Result<Self, ApiError> {
        if ids.is_empty() {
            return Err(ApiError::bad_field("prompt", "the prompt is empty"));
        }
        ids.iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&id| id < vocab_size as u64)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        ApiError::bad_field(
                            "prompt",
                            format!(
                                "token ids must be integers in 0..{vocab_size} (the vocabulary), got {v}"
                            ),
                        )
                    })
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(Prompt::Tokens)
    }
}

impl ChatRequest {
    /// The conversation as the chat template reads it.
    pub fn conversation(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_field("messages", "`messages` is empty"));
        }
        self.messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    None => String::new(),
                    Some(ContentIn::Text(s)) => s.clone(),
                    Some(ContentIn::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => s.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::bad_field(
                                        "messages",
                                        format!(
                                        "unsupported content part type {kind:?} (only \"text\")"
                                    ),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                Ok(ChatMessage {
                    role: m.role.clone(),
                    content,
                })
            })
            .collect()
    }
}

/// A validated request, ready for the engine once its prompt is tokenized.
#[derive(Debug, Clone)]
pub struct Generation {
    /// `None`: as many as the context leaves after the prompt.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub return_token_ids: bool,
    pub logprobs: LogprobsAsk,
}

/// The log-probabilities a request asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogprobsAsk {
    /// Of each output token, with this many alternatives (completions `logprobs: N`; chat
    /// `logprobs: true` with `top_logprobs: N`).
    pub top: Option<usize>,
    /// Completions `echo`: the prompt comes back before the output, with its tokens'
    /// log-probabilities when `top` is set.
    pub echo: bool,
}

impl LogprobsAsk {
    /// Alternatives per prompt token, when the prompt's log-probabilities are wanted.
    pub fn prompt(&self) -> Option<usize> {
        self.top.filter(|_| self.echo)
    }
}

impl GenerationFields {
    /// The log-probability fields for `endpoint`; out of range or of the wrong shape is a
    /// 400 naming the field.
    pub fn check_logprobs(&self, endpoint: Endpoint) -> Result<LogprobsAsk, ApiError> {
        let count = |v: &Value| {
            v.as_u64()
                .filter(|&n| n <= MAX_LOGPROBS)
                .map(|n| n as usize)
        };
        let range = |field: &'static str| {
            ApiError::bad_field(
                field,
                format!("{field} must be an integer from 0 to {MAX_LOGPROBS}"),
            )
        };
        let mut ask = LogprobsAsk::default();
        match (endpoint, &self.logprobs) {
            (_, None | Some(Value::Null | Value::Bool(false))) => {}
            (Endpoint::Chat, Some(Value::Bool(true))) => ask.top = Some(0),
            (Endpoint::Chat, Some(_)) => {
                return Err(ApiError::bad_field(
                    "logprobs",
                    "logprobs must be a boolean on chat completions (top_logprobs sets how many)",
                ))
            }
            (Endpoint::Completion, Some(v)) => {
                ask.top = Some(count(v).ok_or_else(|| range("logprobs"))?)
            }
        }
        if let Some(v) = self.top_logprobs.as_ref().filter(|v| !v.is_null()) {
            if endpoint == Endpoint::Completion {
                return Err(ApiError::bad_field(
                    "top_logprobs",
                    "top_logprobs is a chat field; completions take an integer logprobs",
                ));
            }
            let n = count(v).ok_or_else(|| range("top_logprobs"))?;
            match &mut ask.top {
                Some(top) => *top = n,
                None if n == 0 => {}
                None => {
                    return Err(ApiError::bad_field(
                        "top_logprobs",
                        "top_logprobs needs logprobs: true",
                    ))
                }
            }
        }
        match (&self.echo, endpoint) {
            (None | Some(Value::Null | Value::Bool(false)), _) => {}
            (Some(Value::Bool(true)), Endpoint::Completion) => ask.echo = true,
            (Some(Value::Bool(true)), Endpoint::Chat) => {
                return Err(ApiError::bad_field("echo", "echo is a completions field"))
            }
            (Some(_), _) => return Err(ApiError::bad_field("echo", "echo must be a boolean")),
        }
        Ok(ask)
    }

    /// Checks every field for `endpoint`; defaults come from the model's generation
    /// config.
    pub fn validate(
        &self,
        endpoint: Endpoint,
        defaults: &GenerationDefaults,
        random_seed: u64,
    ) -> Result<Generation, ApiError> {
        let logprobs = self.check_logprobs(endpoint)?;
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::bad_field(
                    "n",
                    format!("only n = 1 is supported, got {n}"),
                ));
            }
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) if !logprobs.echo => {
                return Err(ApiError::bad_field(
                    "max_tokens",
                    "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                ))
            }
            Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
            None => None,
        };
        let temperature = self.temperature.unwrap_or(defaults.temperature);
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::bad_field(
                "temperature",
                format!("temperature must be a number >= 0, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(defaults.top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad_field(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::bad_field(
                    "top_k",
                    format!("top_k must be -1, 0 (no cut) or positive, got {k}"),
                ))
            }
        };
        let stops = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_field(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    stops.len()
                ),
            ));
        }
        if let Some(s) = stops
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::bad_field(
                "stop",
                format!(
                    "stop strings must be 1 to {MAX_STOP_BYTES} bytes long, got {}",
                    s.len()
                ),
            ));
        }
        let include_usage = self
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        Ok(Generation {
            max_tokens,
            sampling: SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: self.seed.map_or(random_seed, |s| s as u64),
            },
            stops,
            stream: self.stream,
            include_usage,
            ignore_eos: self.ignore_eos,
            return_token_ids: self.return_token_ids.unwrap_or(false),
            logprobs,
        })
    }
}

/// Why a generation ended, as `finish_reason` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the server (shutdown grace period over).
    Abort,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Every token the engine generated for the response, an end-of-sequence token included.
    pub completion_tokens: usize,
}

impl Usage {
    pub fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// Which endpoint answers: it decides the object names and where the text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// What every response object of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// Token ids for a response (`return_token_ids`): the prompt's, and the output's (all of
/// them, or a chunk's new ones), placed where vLLM places them.
#[derive(Debug, Clone, Copy)]
pub struct TokenIds<'a> {
    /// `None` in every streamed chunk but the first.
    pub prompt: Option<&'a [u32]>,
    pub output: &'a [u32],
}

impl TokenIds<'_> {
    /// Completions carry both in the choice; chat carries the prompt's at the top level.
    fn place(&self, endpoint: Endpoint, response: &mut Value) {
        let choice = &mut response["choices"][0];
        choice["token_ids"] = json!(self.output);
        if let Some(p) = self.prompt {
            match endpoint {
                Endpoint::Completion => choice["prompt_token_ids"] = json!(p),
                Endpoint::Chat => response["prompt_token_ids"] = json!(p),
            }
        }
    }
}

impl ResponseMeta {
    /// The non-streamed response; `logprobs` in the endpoint's shape (`super::logprobs`),
    /// `null` when not asked for.
    pub fn full(
        &self,
        text: &str,
        finish: Finish,
        usage: Usage,
        ids: Option<TokenIds>,
        logprobs: Option<Value>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish.as_str(),
            }),
            Endpoint::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish.as_str(),
            }),
        };
        let mut v = json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat => "chat.completion",
                Endpoint::Completion => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.json(),
        });
        if let Some(ids) = ids {
            ids.place(self.endpoint, &mut v);
        }
        v
    }

    /// One streamed chunk: the role goes only in the first chat delta (`first`), the
    /// finish reason only in the last. `with_usage` adds `"usage": null`, as OpenAI does on
    /// every chunk before the usage chunk when `include_usage` is set. `logprobs`: those
    /// of the chunk's tokens.
    pub fn chunk(
        &self,
        text: &str,
        first: bool,
        finish: Option<Finish>,
        with_usage: bool,
        ids: Option<TokenIds>,
        logprobs: Option<Value>,
    ) -> Value {
        let reason = finish.map(Finish::as_str);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    (false, _) => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason})
            }
        };
        let mut v = self.chunk_frame(vec![choice]);
        if with_usage {
            v["usage"] = Value::Null;
        }
        if let Some(ids) = ids {
            ids.place(self.endpoint, &mut v);
        }
        v
    }

    /// The final chunk of `include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.chunk_frame(Vec::new());
        v["usage"] = usage.json();
        v
    }

    fn chunk_frame(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completion => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Result<Generation, ApiError> {
        let f: GenerationFields =
            serde_json::from_value(v).map_err(|e| ApiError::bad_request(e.to_string()))?;
        f.validate(Endpoint::Completion, &GenerationDefaults::default(), 7)
    }

    #[test]
    fn logprob_fields_are_read_or_refused_by_name() {
        use Endpoint::{Chat, Completion};
        let f = |v: &Value| serde_json::from_value::<GenerationFields>(v.clone()).unwrap();
        let check = |v: Value, e: Endpoint| f(&v).check_logprobs(e).err().and_then(|e| e.param);
        let ask = |top, echo| LogprobsAsk { top, echo };
        for (v, e, want) in [
            (json!({"model": "m"}), Completion, ask(None, false)),
            (
                json!({"model": "m", "logprobs": null, "echo": false}),
                Completion,
                ask(None, false),
            ),
            (
                json!({"model": "m", "logprobs": false, "top_logprobs": 0}),
                Chat,
                ask(None, false),
            ),
            (
                json!({"model": "m", "logprobs": 5}),
                Completion,
                ask(Some(5), false),
            ),
            (
                json!({"model": "m", "logprobs": 0}),
                Completion,
                ask(Some(0), false),
            ),
            (
                json!({"model": "m", "logprobs": 1, "echo": true}),
                Completion,
                ask(Some(1), true),
            ),
            (
                json!({"model": "m", "echo": true}),
                Completion,
                ask(None, true),
            ),
            (
                json!({"model": "m", "logprobs": true}),
                Chat,
                ask(Some(0), false),
            ),
            (
                json!({"model": "m", "logprobs": true, "top_logprobs": 20}),
                Chat,
                ask(Some(20), false),
            ),
        ] {
            assert_eq!(f(&v).check_logprobs(e).unwrap(), want, "{v}");
        }
        assert_eq!(ask(Some(2), true).prompt(), Some(2));
        assert_eq!(ask(Some(2), false).prompt(), None);
        assert_eq!(ask(None, true).prompt(), None);
        for (v, e, param) in [
            // Out of range or of the wrong shape.
            (
                json!({"model": "m", "logprobs": 21}),
                Completion,
                "logprobs",
            ),
            (
                json!({"model": "m", "logprobs": -1}),
                Completion,
                "logprobs",
            ),
            (
                json!({"model": "m", "logprobs": true}),
                Completion,
                "logprobs",
            ),
            (json!({"model": "m", "logprobs": 3}), Chat, "logprobs"),
            (
                json!({"model": "m", "logprobs": true, "top_logprobs": 21}),
                Chat,
                "top_logprobs",
            ),
            (
                json!({"model": "m", "top_logprobs": 3}),
                Chat,
                "top_logprobs",
            ),
            (
                json!({"model": "m", "top_logprobs": 3}),
                Completion,
                "top_logprobs",
            ),
            (json!({"model": "m", "echo": true}), Chat, "echo"),
            (json!({"model": "m", "echo": "yes"}), Completion, "echo"),
        ] {
            assert_eq!(check(v.clone(), e), Some(param), "{v}");
        }
        // max_tokens 0 asks for the prompt alone: only with echo.
        let zero = |echo| {
            f(&json!({"model": "m", "max_tokens": 0, "echo": echo, "logprobs": 1}))
                .validate(Completion, &GenerationDefaults::default(), 7)
                .map(|g| g.max_tokens)
                .map_err(|e| e.param)
        };
        assert_eq!(zero(true), Ok(Some(0)));
        assert_eq!(zero(false), Err(Some("max_tokens")));
    }

    #[test]
    fn n_other_than_one_is_refused() {
        let e = fields(json!({"model": "m", "n": 2})).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param, Some("n"));
        assert!(fields(json!({"model": "m", "n": 1})).is_ok());
    }

    #[test]
    fn out_of_range_sampling_fields_are_refused_and_named() {
        for (v, param) in [
            (json!({"model": "m", "temperature": -0.5}), "temperature"),
            (json!({"model": "m", "top_p": 0.0}), "top_p"),
            (json!({"model": "m", "top_p": 1.5}), "top_p"),
            (json!({"model": "m", "top_k": -2}), "top_k"),
            (json!({"model": "m", "max_tokens": 0}), "max_tokens"),
            (json!({"model": "m", "stop": [""]}), "stop"),
        ] {
            assert_eq!(fields(v.clone()).unwrap_err().param, Some(param), "{v}");
        }
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens_and_a_given_seed_is_kept() {
        let g =
            fields(json!({"model": "m", "max_tokens": 5, "max_completion_tokens": 9, "seed": 3}))
                .unwrap();
        assert_eq!(g.max_tokens, Some(9));
        assert_eq!(g.sampling.seed, 3);
        assert_eq!(fields(json!({"model": "m"})).unwrap().sampling.seed, 7);
    }

    #[test]
    fn chat_chunks_carry_the_role_first_and_the_finish_reason_last_only() {
        let meta = ResponseMeta {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let first = meta.chunk("", true, None, false, None, None);
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(first["choices"][0]["finish_reason"].is_null());
        let mid = meta.chunk("hi", false, None, false, None, None);
        assert!(mid["choices"][0]["delta"].get("role").is_none());
        let last = meta.chunk("", false, Some(Finish::Length), true, None, None);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert!(last["usage"].is_null() && last.get("usage").is_some());
        assert!(mid["choices"][0].get("token_ids").is_none());
    }

    #[test]
    fn token_ids_go_where_vllm_puts_them() {
        let ids = |prompt| TokenIds {
            prompt,
            output: &[7, 8],
        };
        let usage = Usage {
            prompt_tokens: 2,
            completion_tokens: 2,
        };
        let mut meta = ResponseMeta {
            endpoint: Endpoint::Completion,
            id: "cmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let v = meta.full("x", Finish::Stop, usage, Some(ids(Some(&[1, 2]))), None);
        assert_eq!(v["choices"][0]["token_ids"], json!([7, 8]));
        assert_eq!(v["choices"][0]["prompt_token_ids"], json!([1, 2]));
        let later = meta.chunk("x", false, None, false, Some(ids(None)), None);
        assert!(later["choices"][0].get("prompt_token_ids").is_none());
        meta.endpoint = Endpoint::Chat;
        let v = meta.chunk("", true, None, false, Some(ids(Some(&[1, 2]))), None);
        assert_eq!(v["prompt_token_ids"], json!([1, 2]));
        assert_eq!(v["choices"][0]["token_ids"], json!([7, 8]));
    }

    #[test]
    fn prompts_are_text_or_token_ids_and_bad_ids_are_named() {
        let p = |v: Value| Prompt::parse(&v, 100);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(
            p(json!([1, 2, 99])).unwrap(),
            Prompt::Tokens(vec![1, 2, 99])
        );
        assert_eq!(p(json!([[5, 6]])).unwrap(), Prompt::Tokens(vec![5, 6]));
        for (bad, says) in [
            (json!([1, 100]), "0..100"),
            (json!([1, -1]), "0..100"),
            (json!([1, 2.5]), "0..100"),
            (json!([1, "a"]), "0..100"),
            (json!([]), "empty"),
            (json!([[]]), "empty"),
            (json!(["a", "b"]), "only one prompt"),
            (json!([[1], [2]]), "only one prompt"),
            (json!(7), "must be a string"),
            (json!([{"a": 1}]), "must be a string"),
        ] {
            let e = p(bad.clone()).unwrap_err();
            assert_eq!(e.param, Some("prompt"), "{bad}");
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
