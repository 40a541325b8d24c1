//! The HTTP surface: routes, authentication, admission, and turning engine events into
//! OpenAI responses (whole or as server-sent events).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{
    ChatRequest, CompletionRequest, Endpoint, Finish, Generation, GenerationFields, Prompt,
    ResponseMeta, TokenIds, Usage,
};
use super::blocking::BlockingPool;
use super::engine_thread::{EngineClient, Event};
use super::error::ApiError;
use super::kv_events::pub_socket::PeerStats;
use super::logprobs::{self, Scored};
use super::metrics::Metrics;
use super::model_card::ModelCard;
use super::text::TextStream;
use crate::engine::logprobs::TokenLogprob;
use crate::model::config::GenerationDefaults;
use crate::model::template::RendererUnavailable;
use crate::model::Tokenizer;
use crate::serve::RequestParams;

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// What the server knows before the model is loaded.
pub struct ServerConfig {
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Requests admitted at once (running + waiting); more get 429.
    pub max_pending_requests: usize,
    /// How long a request's body may take to arrive (`--body-read-timeout`).
    pub body_read_timeout: std::time::Duration,
    /// Where the prefix cache's events are published (`--kv-events-endpoint`).
    pub kv_events: Option<KvEventsInfo>,
}

pub struct KvEventsInfo {
    /// The bound endpoint, `tcp://HOST:PORT`.
    pub endpoint: String,
    pub topic: String,
    /// The replay socket's bound endpoint, if there is one.
    pub replay_endpoint: Option<String>,
    /// The socket's peer counters, read into /metrics when it is scraped.
    pub peers: Arc<PeerStats>,
}

/// The engine's geometry, which a router registering this server needs.
pub struct EngineInfo {
    /// Where the model runs (`cpu`, `cuda`): what a framework registering it reports.
    pub device: crate::device::DeviceKind,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

/// What exists once the model is loaded.
pub struct Loaded {
    pub tokenizer: Arc<Tokenizer>,
    pub defaults: GenerationDefaults,
    pub engine: EngineClient,
    /// Prompt + output limit in tokens.
    pub max_model_len: usize,
    /// Token ids of prompts must lie below it.
    pub vocab_size: usize,
    pub info: EngineInfo,
    pub model_card: ModelCard,
}

pub struct AppState {
    pub cfg: ServerConfig,
    pub loaded: OnceLock<Loaded>,
    pub metrics: Arc<Metrics>,
    pending: AtomicUsize,
    /// Template renderings and tokenizations, one per core at once (each is CPU and memory
    /// in proportion to a prompt of up to `MAX_BODY_BYTES`); admitted requests queue here.
    tokenizers: BlockingPool,
}

impl AppState {
    /// `Err` when the tokenizing threads cannot start.
    pub fn new(cfg: ServerConfig, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        Ok(Self {
            cfg,
            loaded: OnceLock::new(),
            metrics,
            pending: AtomicUsize::new(0),
            tokenizers: BlockingPool::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )?,
        })
    }

    /// The cheap checks of a request, before it is admitted: the server is ready, the
    /// model is the one served, the sampling and log-probability fields are valid.
    fn check(
        &self,
        fields: &GenerationFields,
        endpoint: Endpoint,
    ) -> Result<(&Loaded, Generation), ApiError> {
        let loaded = self.ready()?;
        if fields.model != self.cfg.served_model_name {
            return Err(ApiError {
                param: Some("model"),
                ..ApiError::not_found(format!(
                    "the model `{}` does not exist; this server serves `{}`",
                    fields.model, self.cfg.served_model_name
                ))
            });
        }
        let gen = fields.validate(endpoint, &loaded.defaults, rand::random())?;
        Ok((loaded, gen))
    }

    /// Runs template rendering and tokenization of an admitted request off the async
    /// workers, at most one per core at a time.
    async fn tokenize<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        self.tokenizers.run(f).await
    }

    fn ready(&self) -> Result<&Loaded, ApiError> {
        match self.loaded.get() {
            None => Err(ApiError::unavailable("the model is still loading")),
            Some(l) if !l.engine.is_alive() => Err(ApiError::unavailable(
                "the engine has stopped; see the server log",
            )),
            Some(_) if crate::model::mapped::changed() => Err(ApiError::unavailable(
                "the model file was truncated or replaced while the server had it mapped; restart the server",
            )),
            Some(l) => Ok(l),
        }
    }

    /// Counts a request in, or refuses it when the server is at its limit.
    fn admit(self: &Arc<Self>) -> Result<Admitted, ApiError> {
        let limit = self.cfg.max_pending_requests;
        self.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| ApiError::overloaded(limit))?;
        Ok(Admitted(Arc::clone(self)))
    }
}

/// One admitted request; dropping it (response sent, or client gone) counts it out.
struct Admitted(Arc<AppState>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/strata/model_card", get(model_card))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            read_body,
        ))
        .with_state(state)
}

async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Reads a request's whole body before any handler runs, within `MAX_BODY_BYTES` and the
/// body timeout: a declared length past the limit is a 413 at once, a chunked body is
/// counted as it arrives (413 once past the limit), and one that stalls — a chunk
/// announcing 2^64 − 1 bytes, then silence — is a 408 when the time is up. Either way the
/// connection is closed after the answer.
async fn read_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    // A declared length is known before the body: refuse it at once, unread.
    let declared = axum::body::HttpBody::size_hint(&body).lower();
    let too_large = ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
        param: None,
    };
    let read = axum::body::to_bytes(body, MAX_BODY_BYTES);
    let outcome = if declared > MAX_BODY_BYTES as u64 {
        Ok(Err(None))
    } else {
        tokio::time::timeout(state.cfg.body_read_timeout, read)
            .await
            .map(|r| r.map_err(Some))
    };
    let refused = match outcome {
        Ok(Err(None)) => too_large,
        Ok(Ok(bytes)) => return next.run(Request::from_parts(parts, bytes.into())).await,
        Ok(Err(Some(e))) if is_length_limit(&e) => too_large,
        Ok(Err(Some(e))) => ApiError::bad_request(format!("could not read the request body: {e}")),
        Err(_) => ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {} s",
                state.cfg.body_read_timeout.as_secs()
            ),
            param: None,
        },
    };
    let mut response = refused.into_response();
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed on this endpoint".into(),
        param: None,
    }
}

/// 200 "ok" only while requests can be served: the model loaded, the engine thread
/// alive, and chat templates renderable (their workers can start).
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let renderable = || {
        crate::model::template::worker::available().map_err(|why| {
            ApiError::unavailable(format!("cannot render chat templates now: {why}"))
        })
    };
    match state.ready().and_then(|_| renderable()) {
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    if let Some(k) = &state.cfg.kv_events {
        state.metrics.kv_event_peers(&k.peers);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// One model, with (beyond OpenAI's fields, as vLLM adds `max_model_len`) what a router
/// registering this server needs: the KV geometry and where its KV events are published.
async fn models(State(state): State<Arc<AppState>>) -> Result<Json<serde_json::Value>, ApiError> {
    let loaded = state.ready()?;
    let info = &loaded.info;
    let kv_events = state.cfg.kv_events.as_ref().map(
        |k| json!({"endpoint": k.endpoint, "topic": k.topic, "replay_endpoint": k.replay_endpoint}),
    );
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": state.cfg.served_model_name,
            "object": "model",
            "created": unix_now(),
            "owned_by": "strata",
            "max_model_len": loaded.max_model_len,
            "device": info.device.to_string(),
            "kv_cache_block_size": info.block_size,
            "num_gpu_blocks": info.num_gpu_blocks,
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "kv_events": kv_events,
        }],
    })))
}

/// The tokenizer and config files a framework's frontend loads (`model_card`).
async fn model_card(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let loaded = state.ready()?;
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        loaded.model_card.body(),
    )
        .into_response())
}

/// vLLM's `POST /reset_prefix_cache`: drops the GPU prefix cache (KV-event subscribers
/// hear `AllBlocksCleared`). Only while no request holds KV: 409 otherwise.
async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let loaded = state.ready()?;
    match loaded.engine.reset_prefix_cache().await {
        Ok(true) => Ok(Json(json!({"reset": true})).into_response()),
        Ok(false) => Err(ApiError {
            status: StatusCode::CONFLICT,
            message: "requests are running: the prefix cache is reset only when idle".into(),
            param: None,
        }),
        Err(_) => Err(ApiError::unavailable("the engine has stopped")),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Parses a JSON body into `T`, with OpenAI-style errors for every failure.
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| ApiError {
        status: r.status(),
        message: format!("could not read the request body: {}", r.body_text()),
        param: None,
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    let conversation = req.conversation()?;
    let (loaded, gen) = state.check(&req.fields, Endpoint::Chat)?;
    let admitted = state.admit()?;
    let tokenizer = Arc::clone(&loaded.tokenizer);
    let prompt = state
        .tokenize(move || -> Result<Vec<u32>, ApiError> {
            let text = tokenizer.render_chat(&conversation).map_err(|e| match e
                .downcast_ref::<RendererUnavailable>()
            {
                Some(w) => ApiError::unavailable(w.to_string()),
                None => ApiError::bad_field("messages", format!("{e:#}")),
            })?;
            tokenizer
                .encode(&text, false)
                .map_err(|e| ApiError::bad_field("messages", format!("{e:#}")))
        })
        .await?;
    generate(state, admitted, Endpoint::Chat, gen, prompt, None).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    let (loaded, gen) = state.check(&req.fields, Endpoint::Completion)?;
    let parsed = Prompt::parse(&req.prompt, loaded.vocab_size)?;
    let admitted = state.admit()?;
    let echo = gen.logprobs.echo;
    let tokenizer = Arc::clone(&loaded.tokenizer);
    // The prompt's ids, and its text when echoed: as given, or decoded from the ids.
    let (prompt, echoed) = state
        .tokenize(move || {
            let bad = |e: anyhow::Error| ApiError::bad_field("prompt", format!("{e:#}"));
            match parsed {
                Prompt::Tokens(ids) => {
                    let text = if echo {
                        Some(tokenizer.decode(&ids, false).map_err(bad)?)
                    } else {
                        None
                    };
                    Ok((ids, text))
                }
                Prompt::Text(text) => {
                    let ids = tokenizer.encode(&text, true).map_err(bad)?;
                    Ok((ids, echo.then_some(text)))
                }
            }
        })
        .await?;
    generate(state, admitted, Endpoint::Completion, gen, prompt, echoed).await
}

/// Checks the prompt against the context, submits the admitted request, and answers.
/// `echoed`: the prompt's text, when the response starts with it (completions `echo`).
async fn generate(
    state: Arc<AppState>,
    admitted: Admitted,
    endpoint: Endpoint,
    gen: Generation,
    prompt: Vec<u32>,
    echoed: Option<String>,
) -> Result<Response, ApiError> {
    let loaded = state.ready()?;
    let max_tokens = context_budget(&gen, prompt.len(), loaded.max_model_len)?;
    // The prompt alone (`max_tokens: 0` with echo) is a prefill whose one sampled token
    // the response leaves out.
    let prompt_only = max_tokens == 0;
    let params = RequestParams {
        max_tokens: max_tokens.max(1),
        sampling: gen.sampling.clone(),
        ignore_eos: gen.ignore_eos,
        logprobs: gen.logprobs.top,
        prompt_logprobs: gen.logprobs.prompt(),
    };
    let prompt_ids = gen.return_token_ids.then(|| prompt.clone());
    let echo = echoed.map(|text| Echo {
        text,
        ids: gen.logprobs.prompt().map(|_| prompt.clone()),
    });
    let prompt_tokens = prompt.len();
    let events = loaded
        .engine
        .submit(prompt, params)
        .map_err(|_| ApiError::unavailable("the engine has stopped; see the server log"))?;
    let meta = ResponseMeta {
        endpoint,
        id: response_id(endpoint),
        created: unix_now(),
        model: state.cfg.served_model_name.clone(),
    };
    let text = TextStream::new(Arc::clone(&loaded.tokenizer), gen.stops.clone());
    let run = Run {
        events,
        text,
        tokenizer: Arc::clone(&loaded.tokenizer),
        endpoint,
        prompt_tokens,
        prompt_only,
        output_ids: Vec::new(),
        output_logprobs: gen.logprobs.top.map(|_| Vec::new()),
        sent: 0,
        prompt_ids,
        echo,
        prompt_logprobs: None,
        text_offset: 0,
        _admitted: admitted,
    };
    if gen.stream {
        Ok(stream_response(run, meta, gen).into_response())
    } else {
        let (text, finish, usage, mut run) = run.collect().await?;
        // The weights read zeros from the point a mapped model file shrank (`mapped`).
        if crate::model::mapped::changed() {
            return Err(state.ready().err().unwrap_or_else(|| {
                ApiError::unavailable("the model file changed while it was mapped")
            }));
        }
        let echoed = run.take_echo();
        let logprobs = run.logprobs(echoed.as_ref(), 0..run.output_ids.len());
        let text = match &echoed {
            Some(e) => format!("{}{text}", e.text),
            None => text,
        };
        let body = meta.full(&text, finish, usage, run.all_ids(), logprobs);
        Ok(Json(body).into_response())
    }
}

/// The prompt at the head of a completions response (`echo`).
struct Echo {
    text: String,
    /// Its ids, when its log-probabilities are asked for.
    ids: Option<Vec<u32>>,
}

/// `max_tokens` within the context: the prompt plus the output must fit `max_model_len`.
fn context_budget(
    gen: &Generation,
    prompt: usize,
    max_model_len: usize,
) -> Result<usize, ApiError> {
    if prompt == 0 {
        return Err(ApiError::bad_field("prompt", "the prompt is empty"));
    }
    match gen.max_tokens {
        Some(m) if prompt.saturating_add(m) > max_model_len => Err(ApiError::bad_field(
            "max_tokens",
            format!(
                "this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt} tokens and max_tokens is {m} ({} in all)",
                prompt.saturating_add(m)
            ),
        )),
        Some(m) => Ok(m),
        None if prompt >= max_model_len => Err(ApiError::bad_field(
            "prompt",
            format!(
                "this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt} tokens, leaving none to generate"
            ),
        )),
        None => Ok(max_model_len - prompt),
    }
}

fn response_id(endpoint: Endpoint) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// One request in flight: its engine events and its text pipeline.
struct Run {
    events: UnboundedReceiver<Event>,
    text: TextStream,
    tokenizer: Arc<Tokenizer>,
    endpoint: Endpoint,
    prompt_tokens: usize,
    /// `max_tokens: 0`: the engine's one token is not part of the response.
    prompt_only: bool,
    /// Every token the engine generated for the response (its `completion_tokens`).
    output_ids: Vec<u32>,
    /// Their log-probabilities, when asked for (as long as `output_ids`).
    output_logprobs: Option<Vec<TokenLogprob>>,
    /// Of `output_ids`, those already sent in a chunk.
    sent: usize,
    /// `Some` when the client asked for token ids (`return_token_ids`).
    prompt_ids: Option<Vec<u32>>,
    /// The prompt to put at the head of the response (`echo`), until it is.
    echo: Option<Echo>,
    /// The prompt's log-probabilities from its second token on, when echo asks for them.
    prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// Characters of the response's text before the next scored token (`text_offset`).
    text_offset: usize,
    _admitted: Admitted,
}

/// What the next engine event means for the response.
enum Step {
    Text(String),
    End(String, Finish),
}

impl Run {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.output_ids.len(),
        }
    }

    /// The response's token ids, if asked for: the prompt's and every output token.
    fn all_ids(&self) -> Option<TokenIds<'_>> {
        let prompt = self.prompt_ids.as_deref()?;
        Some(TokenIds {
            prompt: Some(prompt),
            output: &self.output_ids,
        })
    }

    /// The output tokens not sent yet (for the next chunk), now counted as sent.
    fn take_new(&mut self) -> Range<usize> {
        let from = std::mem::replace(&mut self.sent, self.output_ids.len());
        from..self.sent
    }

    /// The ids of the output tokens in `range`, if asked for; the prompt's ride with the
    /// first chunk.
    fn ids(&self, first: bool, range: Range<usize>) -> Option<TokenIds<'_>> {
        let prompt = self.prompt_ids.as_deref()?;
        Some(TokenIds {
            prompt: first.then_some(prompt),
            output: &self.output_ids[range],
        })
    }

    /// Whether a chunk is due even without new text: token ids or log-probabilities were
    /// asked for and some are unsent (a client reading them wants each as it comes).
    fn tokens_pending(&self) -> bool {
        (self.prompt_ids.is_some() || self.output_logprobs.is_some())
            && self.sent < self.output_ids.len()
    }

    /// The prompt to echo, once.
    fn take_echo(&mut self) -> Option<Echo> {
        self.echo.take()
    }

    /// The log-probabilities of `echo`'s prompt (if it asks for them) and of the output
    /// tokens in `range`, in the endpoint's shape; `None` when not asked for, or for a
    /// chunk with no token.
    fn logprobs(&mut self, echo: Option<&Echo>, range: Range<usize>) -> Option<Value> {
        let output = self.output_logprobs.as_ref()?;
        let prompt_ids = echo.and_then(|e| e.ids.as_deref()).unwrap_or_default();
        if range.is_empty() && prompt_ids.is_empty() {
            return None;
        }
        let tok = &self.tokenizer;
        Some(match self.endpoint {
            Endpoint::Chat => logprobs::chat(tok, &output[range].iter().collect::<Vec<_>>()),
            Endpoint::Completion => {
                let prompt_lps = self.prompt_logprobs.as_deref().unwrap_or_default();
                let mut scored: Vec<Scored> = Vec::with_capacity(prompt_ids.len() + range.len());
                for (i, &id) in prompt_ids.iter().enumerate() {
                    // Position 0 has no log-probability; position i's is entry i - 1.
                    scored.push((id, i.checked_sub(1).and_then(|j| prompt_lps.get(j))));
                }
                scored.extend(range.map(|i| (self.output_ids[i], Some(&output[i]))));
                let (v, next) = logprobs::completion(tok, &scored, self.text_offset);
                self.text_offset = next;
                v
            }
        })
    }

    /// Waits for the next piece of text or the end. After a stop string the event channel
    /// is closed, which cancels the request in the engine at its next step.
    async fn next(&mut self) -> Result<Step, ApiError> {
        loop {
            let (id, logprob) = match self.events.recv().await {
                Some(Event::PromptLogprobs(lps)) => {
                    self.prompt_logprobs = Some(lps);
                    continue;
                }
                Some(Event::Token(..)) if self.prompt_only => continue,
                Some(Event::Token(id, logprob)) => (id, logprob),
                Some(Event::Done(finish)) => return Ok(Step::End(self.text.finish(), finish)),
                Some(Event::Refused(msg)) => return Err(ApiError::bad_request(msg)),
                Some(Event::Failed(msg)) => return Err(ApiError::internal(msg)),
                None => {
                    return Err(ApiError::unavailable(
                        "the engine stopped before the request finished",
                    ))
                }
            };
            self.output_ids.push(id);
            match (&mut self.output_logprobs, logprob) {
                (Some(all), Some(lp)) => all.push(lp),
                (Some(_), None) => {
                    return Err(ApiError::internal(
                        "a token came without the log-probability asked for",
                    ))
                }
                (None, _) => {}
            }
            let r = self
                .text
                .push(id)
                .map_err(|e| ApiError::internal(format!("{e:#}")))?;
            return Ok(if r.stopped {
                self.events.close();
                Step::End(r.text, Finish::Stop)
            } else {
                Step::Text(r.text)
            });
        }
    }

    async fn collect(mut self) -> Result<(String, Finish, Usage, Run), ApiError> {
        let mut out = String::new();
        loop {
            match self.next().await? {
                Step::Text(t) => out.push_str(&t),
                Step::End(t, finish) => {
                    out.push_str(&t);
                    let usage = self.usage();
                    return Ok((out, finish, usage, self));
                }
            }
        }
    }
}

fn sse_json(v: &serde_json::Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The SSE response: a role chunk (chat), text chunks, a chunk with the finish reason, the
/// usage chunk if asked, then `[DONE]`. With `return_token_ids` every chunk carries the
/// token ids since the one before (a chunk goes out for each new id even without text),
/// the first one the prompt's too. Dropping the stream (client gone) drops the event
/// receiver, which cancels the request.
fn stream_response(
    run: Run,
    meta: ResponseMeta,
    gen: Generation,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    struct S {
        run: Run,
        meta: ResponseMeta,
        include_usage: bool,
        queue: VecDeque<SseEvent>,
        /// The prompt's token ids are still to be sent (with the next chunk).
        prompt_ids_due: bool,
        ended: bool,
    }
    impl S {
        /// A chunk with `text` and the tokens since the last chunk (the first completions
        /// chunk starts with the echoed prompt).
        fn push_chunk(&mut self, text: &str, finish: Option<Finish>) {
            let first = std::mem::replace(&mut self.prompt_ids_due, false);
            let echo = self.run.take_echo();
            let range = self.run.take_new();
            let logprobs = self.run.logprobs(echo.as_ref(), range.clone());
            let text = match &echo {
                Some(e) => format!("{}{text}", e.text),
                None => text.to_string(),
            };
            let ids = self.run.ids(first, range);
            let chunk = self
                .meta
                .chunk(&text, false, finish, self.include_usage, ids, logprobs);
            self.queue.push_back(sse_json(&chunk));
        }

        /// Whether `text` (maybe empty) makes a chunk.
        fn due(&self, text: &str) -> bool {
            !text.is_empty() || self.run.tokens_pending() || self.run.echo.is_some()
        }
    }
    let mut queue = VecDeque::new();
    let chat = meta.endpoint == Endpoint::Chat;
    if chat {
        let ids = run.ids(true, 0..0);
        queue.push_back(sse_json(&meta.chunk(
            "",
            true,
            None,
            gen.include_usage,
            ids,
            None,
        )));
    }
    let init = S {
        run,
        meta,
        include_usage: gen.include_usage,
        queue,
        prompt_ids_due: !chat,
        ended: false,
    };
    let events = stream::unfold(init, |mut s| async move {
        loop {
            if let Some(e) = s.queue.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            match s.run.next().await {
                Ok(Step::Text(t)) if !s.due(&t) => {}
                Ok(Step::Text(t)) => s.push_chunk(&t, None),
                Ok(Step::End(t, finish)) => {
                    if s.due(&t) {
                        s.push_chunk(&t, None);
                    }
                    s.push_chunk("", Some(finish));
                    if s.include_usage {
                        let usage = s.meta.usage_chunk(s.run.usage());
                        s.queue.push_back(sse_json(&usage));
                    }
                    s.queue.push_back(SseEvent::default().data("[DONE]"));
                    s.ended = true;
                }
                Err(e) => {
                    s.queue.push_back(sse_json(&e.body()));
                    s.queue.push_back(SseEvent::default().data("[DONE]"));
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SamplingParams;

    fn gen(max_tokens: Option<usize>) -> Generation {
        Generation {
            max_tokens,
            sampling: SamplingParams::default(),
            stops: vec![],
            stream: false,
            include_usage: false,
            ignore_eos: false,
            return_token_ids: false,
            logprobs: Default::default(),
        }
    }

    #[test]
    fn a_request_over_the_context_is_refused_naming_both_numbers() {
        let e = context_budget(&gen(Some(30)), 80, 100).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("80") && e.message.contains("30"),
            "{}",
            e.message
        );
        assert_eq!(context_budget(&gen(Some(20)), 80, 100).unwrap(), 20);
        assert_eq!(context_budget(&gen(None), 80, 100).unwrap(), 20);
        assert!(context_budget(&gen(None), 100, 100).is_err());
        assert!(context_budget(&gen(Some(usize::MAX)), 80, 100).is_err());
    }
}
