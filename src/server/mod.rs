//! `strata serve`: an OpenAI-compatible HTTP server over the serving engine (docs/server.md).
//!
//! axum + tokio answer HTTP; the engine runs on its own thread and is not async
//! (`engine_thread`), fed and drained through channels. `api` holds the request and
//! response shapes, `text` incremental detokenization and stop strings, `routes` the
//! endpoints, `metrics` the Prometheus registry, `error` OpenAI-style errors, `kv_events`
//! the prefix cache's events on a ZMQ socket for KV-aware routers (docs/distributed.md),
//! `model_card` the tokenizer files a framework's frontend loads.

pub mod api;
mod blocking;
pub mod engine_thread;
pub mod error;
pub mod kv_events;
pub mod listen;
pub mod logprobs;
pub mod metrics;
pub mod model_card;
pub mod routes;
pub mod text;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use tokio::net::TcpListener;

use crate::device::DeviceKind;
use crate::errors::usage;
use crate::flags;
use crate::model::{Model, ModelConfig};
use crate::serve::{EngineConfig, SchedulerConfig};
use kv_events::{KvEventPublisher, KvEventsConfig, ZmqEndpoint};
use metrics::{CacheConfigInfo, Metrics};
use routes::{AppState, EngineInfo, KvEventsInfo, Loaded, ServerConfig};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF file or Hugging Face model directory [default: $STRATA_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on: an IP address or a host name.
    #[arg(long, default_value = "127.0.0.1", value_parser = flags::host)]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed either way).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model name clients send in `model` [default: the model file's name without extension]
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/* requests.
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub api_key: Option<String>,
    /// Device the engine runs on.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Most requests in the running batch.
    #[arg(long, default_value_t = 16, value_parser = flags::seqs())]
    pub max_num_seqs: usize,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 512, value_parser = flags::tokens())]
    pub max_num_batched_tokens: usize,
    /// GPU KV pages [default: two full contexts, 2 × --max-model-len / --block-size]
    #[arg(long, value_parser = flags::blocks())]
    pub num_gpu_blocks: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = flags::block_size())]
    pub block_size: usize,
    /// Host-tier blocks for preemption offload; 0 = recompute instead [default: --num-gpu-blocks]
    #[arg(long, value_parser = flags::blocks_or_zero())]
    pub max_cpu_offload_blocks: Option<usize>,
    /// Context limit in tokens, prompt + output [default: the model's maximum]
    #[arg(long, value_parser = flags::tokens())]
    pub max_model_len: Option<usize>,
    /// Requests admitted at once, running and waiting; more are answered 429.
    #[arg(long, default_value_t = 256, value_parser = flags::pending())]
    pub max_pending_requests: usize,
    /// Connections open at once; one more is answered 503 and closed.
    #[arg(long, default_value_t = 512, value_parser = crate::flags::connections())]
    pub max_connections: usize,
    /// Seconds a connection has to send a complete request head, new or kept alive
    /// between requests; then it is closed.
    #[arg(long, default_value_t = 10, value_parser = crate::flags::seconds())]
    pub header_read_timeout: u64,
    /// Seconds a request has to send its whole body (at most 1 MiB); then it is answered 408.
    #[arg(long, default_value_t = 30, value_parser = crate::flags::seconds())]
    pub body_read_timeout: u64,
    /// On Ctrl-C/SIGTERM, seconds to let requests in flight finish before cancelling them.
    #[arg(long, default_value_t = 30, value_parser = flags::shutdown_secs())]
    pub shutdown_timeout: u64,
    #[command(flatten)]
    pub dtype: flags::WeightDtypeArg,
    #[command(flatten)]
    pub kv: flags::KvDtypeArg,
    #[command(flatten)]
    pub disk: crate::serve::disk::DiskArgs,
    /// Publish the prefix cache's KV-cache events (vLLM's format) on a ZMQ PUB socket:
    /// tcp://HOST:PORT or ipc://PATH. As vLLM: it binds ipc, HOST `*` (every interface) or
    /// an IPv6 `::` host, and PORT 0 (any free port); it connects to any other HOST:PORT
    /// (a subscriber that bound there), reconnecting as ZMQ does.
    #[arg(long, value_name = "tcp://HOST:PORT|ipc://PATH", value_parser = clap::value_parser!(ZmqEndpoint))]
    pub kv_events_endpoint: Option<ZmqEndpoint>,
    /// The topic frame of every KV-event message.
    #[arg(long, default_value = "", requires = "kv_events_endpoint")]
    pub kv_events_topic: String,
    /// KV-event batches (one per engine step) that may wait for the publisher thread, and
    /// messages a subscriber may fall behind, before they are dropped (counted).
    #[arg(long, default_value_t = kv_events::DEFAULT_QUEUE as u64, value_parser = clap::value_parser!(u64).range(1..=1_000_000), requires = "kv_events_endpoint")]
    pub kv_events_queue: u64,
    /// Keep the last KV-event batches and answer replay requests for them on a ZMQ ROUTER
    /// socket, as vLLM's `replay_endpoint`: a DEALER sends `["", START]` (big-endian) and
    /// gets every kept batch from START, then an end marker. Always binds (`*` or a host).
    #[arg(long, value_name = "tcp://HOST:PORT|ipc://PATH", value_parser = clap::value_parser!(ZmqEndpoint), requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<ZmqEndpoint>,
    /// KV-event batches the replay socket keeps (vLLM's `buffer_steps`), the oldest
    /// dropped first; 64 MiB at most whatever the count.
    #[arg(long, default_value_t = kv_events::replay::DEFAULT_BATCHES as u64, value_parser = clap::value_parser!(u64).range(1..=1_000_000), requires = "kv_events_replay_endpoint")]
    pub kv_events_replay_buffer: u64,
}

/// Prompt tokens per forward call: 64, or the block size when blocks are larger.
const PREFILL_CHUNK_TOKENS: usize = 64;

/// The engine's geometry, from the flags and the model's configuration, checked against
/// the model's context, the host's memory and the disk tier's room.
fn engine_config(args: &ServeArgs, model: &ModelConfig) -> Result<(EngineConfig, usize)> {
    let trained = model.max_position_embeddings;
    let max_model_len = args.max_model_len.unwrap_or(trained);
    ensure!(
        (1..=trained).contains(&max_model_len),
        "--max-model-len must be between 1 and the model's context ({trained}), got {max_model_len}"
    );
    let bs = args.block_size;
    let per_context = max_model_len.div_ceil(bs);
    let num_gpu_blocks = args.num_gpu_blocks.unwrap_or(2 * per_context);
    ensure!(
        num_gpu_blocks >= per_context,
        "--num-gpu-blocks {num_gpu_blocks} holds {} tokens, less than --max-model-len {max_model_len}",
        num_gpu_blocks.saturating_mul(bs)
    );
    let cpu_blocks = args.max_cpu_offload_blocks.unwrap_or(num_gpu_blocks);
    let disk = args.disk.config()?;
    let sched = SchedulerConfig {
        block_size: bs,
        num_gpu_blocks,
        max_cpu_offload_blocks: cpu_blocks,
        max_disk_offload_blocks: if disk.is_some() {
            args.disk.max_disk_offload_blocks
        } else {
            0
        },
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        prefill_chunk: prefill_chunk(bs),
    };
    sched.validate()?;
    let kv_dtype = args.kv.resolve(args.device)?;
    // Host memory the KV takes (on CUDA the device tier is GPU memory, whose allocation
    // fails clearly).
    let kv = crate::serve::setup::host_kv_bytes(model, &sched, args.device, kv_dtype);
    if let Some(avail) = crate::offload::available_memory_bytes() {
        ensure!(
            kv.is_some_and(|b| b as u64 <= avail),
            "the KV cache needs {} of host memory ({num_gpu_blocks} GPU + {cpu_blocks} host blocks of {bs} tokens on --device {}) but only {:.1} GiB is available; lower --num-gpu-blocks, --max-cpu-offload-blocks or --max-model-len",
            kv.map_or("more than the address space".to_string(), |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)),
            args.device,
            avail as f64 / (1u64 << 30) as f64
        );
    }
    if let Some(dc) = &disk {
        let block = model
            .kv_bytes(bs, kv_dtype.bytes())
            .context("a KV block's size overflows")?;
        dc.check(sched.max_disk_offload_blocks, block)?;
    }
    Ok((
        EngineConfig {
            sched,
            link_gbps: 0.0,
            sanitize: false,
            check_order: crate::device::order::on_by_default(),
            disk,
            kv_dtype,
        },
        max_model_len,
    ))
}

/// Every check of the flags, before anything is bound or printed: `check_args`, then the
/// flags against the model's configuration (its header or config.json, not its weights).
fn check_before_bind(args: &ServeArgs, model_path: &std::path::Path) -> Result<()> {
    check_args(args)?;
    engine_config(args, &Model::peek_config(model_path)?).map(drop)
}

/// Every check that needs no model: the ranges are the parser's (`flags`); here the flags
/// are checked against each other (usage errors, exit 2), then the device and the
/// descriptor limit (exit 1).
fn check_args(args: &ServeArgs) -> Result<()> {
    let bs = args.block_size;
    let sched = SchedulerConfig {
        block_size: bs,
        num_gpu_blocks: args.num_gpu_blocks.unwrap_or(1),
        max_cpu_offload_blocks: args.max_cpu_offload_blocks.unwrap_or(0),
        max_disk_offload_blocks: args.disk.max_disk_offload_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        prefill_chunk: prefill_chunk(bs),
    };
    sched.validate().map_err(usage)?;
    if let (Some(len), Some(blocks)) = (args.max_model_len, args.num_gpu_blocks) {
        if blocks.saturating_mul(bs) < len {
            return Err(usage(format!(
                "--num-gpu-blocks {blocks} holds {} tokens, less than --max-model-len {len}",
                blocks.saturating_mul(bs)
            )));
        }
    }
    args.disk.config()?;
    if args.device == DeviceKind::Cuda {
        crate::device::check_available(DeviceKind::Cuda)?;
    }
    // The KV-event socket's peers hold descriptors too.
    let kv_peers = if args.kv_events_endpoint.is_some() {
        kv_events::pub_socket::Limits::DEFAULT.max_peers
    } else {
        0
    };
    ensure_descriptors(args.max_connections, kv_peers)?;
    Ok(())
}

/// File descriptors the server needs beyond its connections (model, sockets, workers).
const SPARE_DESCRIPTORS: u64 = 128;

/// Makes room for `max_connections` open sockets (and `kv_peers` KV-event subscribers):
/// raises the soft descriptor limit toward the hard one if needed, and refuses a cap the
/// hard limit cannot hold (accepting would otherwise fail with EMFILE while the server
/// says it listens).
fn ensure_descriptors(max_connections: usize, kv_peers: usize) -> Result<()> {
    let need = (max_connections + kv_peers) as u64 + SPARE_DESCRIPTORS;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit, owned by this frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= need {
        return Ok(());
    }
    ensure!(
        lim.rlim_max >= need,
        "--max-connections {max_connections} needs {need} file descriptors, but this process may open at most {} (ulimit -Hn); lower --max-connections",
        lim.rlim_max
    );
    lim.rlim_cur = need;
    // SAFETY: as above; raising the soft limit up to the hard one is always permitted.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    Ok(())
}

/// Prompt tokens per forward call for `block_size`: `PREFILL_CHUNK_TOKENS` rounded up to
/// whole blocks.
fn prefill_chunk(block_size: usize) -> usize {
    PREFILL_CHUNK_TOKENS.div_ceil(block_size).max(1) * block_size
}

/// Runs the server until Ctrl-C or SIGTERM; `model_path` is `--model` resolved.
pub fn run(args: ServeArgs, model_path: PathBuf) -> Result<()> {
    // The weights load in the background once the port is bound (/health says when).
    check_before_bind(&args, &model_path)?;
    let runtime = async_runtime()?;
    let engine_thread = EngineThread::default();
    let r = runtime.block_on(serve(args, model_path, Arc::clone(&engine_thread)));
    // Not `drop`, which waits for every blocking task: a model still loading is abandoned
    // (it will start no engine: the slot says we are stopping), not waited for.
    runtime.shutdown_background();
    let thread = engine_thread.lock().expect("not poisoned").thread.take();
    if let Some(t) = thread {
        t.join()
            .map_err(|_| anyhow::anyhow!("the engine thread panicked"))??;
    }
    r
}

/// The HTTP side's runtime: two worker threads. tokio panics when it cannot start them
/// (and then deadlocks unwinding, waiting for the one it did start): whether they can
/// start is checked first, and a panic all the same is one error line too.
fn async_runtime() -> Result<tokio::runtime::Runtime> {
    crate::threads::probe("the async runtime", 2)?;
    crate::errors::quiet_catch(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    })
    .map_err(|panic| crate::threads::refused("the async runtime", &panic))?
    .context("starting the async runtime")
}

/// The engine thread, once the model has loaded; `stopping` once the server is shutting
/// down, after which a load that finishes starts no engine. One lock, so a load either
/// starts its engine (and publishes it in `AppState::loaded`) before the shutdown looks
/// for it, or sees `stopping`.
#[derive(Default)]
struct EngineSlot {
    thread: Option<JoinHandle<Result<()>>>,
    stopping: bool,
}

type EngineThread = Arc<Mutex<EngineSlot>>;

async fn serve(args: ServeArgs, model_path: PathBuf, engine_thread: EngineThread) -> Result<()> {
    // Resolved here, not by tokio's bind, which resolves a host name on its blocking pool.
    let addrs: Vec<std::net::SocketAddr> =
        std::net::ToSocketAddrs::to_socket_addrs(&(args.host.as_str(), args.port))
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?
            .collect();
    let listener = TcpListener::bind(addrs.as_slice())
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    serve_on(listener, args, model_path, engine_thread, true).await
}

/// Starts a server in this process, on a thread of its own, for in-process clients (the
/// fuzzer's HTTP target): returns the bound address at once (requests get 503 until the
/// model is loaded); it serves until the process ends, printing nothing on stdout.
pub fn spawn_in_process(args: ServeArgs, model_path: PathBuf) -> Result<std::net::SocketAddr> {
    check_before_bind(&args, &model_path)?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new()
        .name("strata-serve".into())
        .spawn(move || -> Result<()> {
            let runtime = async_runtime()?;
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener)?;
                serve_on(listener, args, model_path, EngineThread::default(), false).await
            })
        })?;
    Ok(addr)
}

/// Serves on a bound `listener`; `announce` prints the listening line (what clients of the
/// CLI wait for).
async fn serve_on(
    listener: TcpListener,
    args: ServeArgs,
    model_path: PathBuf,
    engine_thread: EngineThread,
    announce: bool,
) -> Result<()> {
    let addr = listener.local_addr()?;
    let served_model_name = args.served_model_name.clone().unwrap_or_else(|| {
        model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let kv_events = match &args.kv_events_endpoint {
        Some(e) => Some(KvEventPublisher::start(&KvEventsConfig {
            endpoint: e.clone(),
            topic: args.kv_events_topic.clone(),
            queue: args.kv_events_queue as usize,
            block_size: args.block_size,
            replay: args
                .kv_events_replay_endpoint
                .clone()
                .map(|r| (r, args.kv_events_replay_buffer as usize)),
        })?),
        None => None,
    };
    let first_signal = termination(); // before anyone is told where we listen
    if announce {
        // For whoever waits for it; a reader that is gone (`strata serve | true`) or a
        // full stdout changes nothing for the server.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "strata serve: listening on http://{addr} (model `{served_model_name}`)"
        )
        .and_then(|()| out.flush());
    }
    if let Some(p) = &kv_events {
        crate::log!(
            "strata serve: KV events on {} (topic {:?}){}",
            p.bound,
            p.topic,
            p.replay_bound
                .as_ref()
                .map(|r| format!(", replay on {r}"))
                .unwrap_or_default()
        );
    }

    let metrics = Arc::new(Metrics::new(&served_model_name));
    let state = Arc::new(AppState::new(
        ServerConfig {
            served_model_name,
            api_key: args.api_key.clone(),
            max_pending_requests: args.max_pending_requests,
            body_read_timeout: Duration::from_secs(args.body_read_timeout),
            kv_events: kv_events.as_ref().map(|p| KvEventsInfo {
                endpoint: p.bound.clone(),
                topic: p.topic.clone(),
                replay_endpoint: p.replay_bound.clone(),
                peers: Arc::clone(&p.peers),
            }),
        },
        metrics,
    )?);

    // Load in the background: /health answers 503 until the engine runs. On a thread of
    // our own, not tokio's blocking pool, whose spawn panics when no thread can start;
    // the loader reports success too, so a loader that dies (a panic) is a failure, not a
    // server "still loading" for ever.
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<Result<()>>();
    {
        let (state, args, slot) = (Arc::clone(&state), args.clone(), Arc::clone(&engine_thread));
        crate::threads::spawn("strata-load", move || {
            let _ = loaded_tx.send(load(&state, &args, &model_path, &slot, kv_events));
        })?;
    }

    let load_error = Arc::new(Mutex::new(None));
    let shutdown = {
        let (state, load_error) = (Arc::clone(&state), Arc::clone(&load_error));
        let grace = Duration::from_secs(args.shutdown_timeout);
        async move {
            let loaded = async {
                match loaded_rx.await {
                    Ok(Ok(())) => std::future::pending().await,
                    Ok(Err(e)) => e,
                    Err(_) => anyhow::anyhow!(
                        "loading the model failed: the loader thread died (see the log above)"
                    ),
                }
            };
            tokio::select! {
                _ = first_signal => {}
                e = loaded => {
                    *load_error.lock().expect("not poisoned") = Some(e);
                    return;
                }
            }
            crate::log!(
                "strata serve: shutting down; requests in flight get {}s to finish (a second signal cancels them)",
                grace.as_secs()
            );
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(grace) => {}
                    _ = termination() => {}
                }
                if let Some(l) = state.loaded.get() {
                    crate::log!("strata serve: cancelling the requests still in flight");
                    l.engine.cancel_all();
                }
            });
        }
    };
    let limits = listen::ConnLimits {
        max_connections: args.max_connections,
        header_read_timeout: Duration::from_secs(args.header_read_timeout),
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
    };
    let served = listen::serve(
        listener,
        routes::router(Arc::clone(&state)),
        limits,
        shutdown,
    )
    .await;
    // From here a load still running starts no engine; one that has started it is
    // published in `loaded` (the same lock) and is shut down here.
    engine_thread.lock().expect("not poisoned").stopping = true;
    served.context("serving HTTP")?;
    if let Some(e) = load_error.lock().expect("not poisoned").take() {
        return Err(e);
    }
    if let Some(l) = state.loaded.get() {
        l.engine.shutdown();
    }
    crate::log!("strata serve: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM. The handlers are installed when this is called, not when the future
/// is first polled: a signal between the listening line and that first poll would end the
/// process by the default action, not by a graceful stop.
fn termination() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (int, term) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        );
        async move {
            let wait = |s: std::io::Result<tokio::signal::unix::Signal>| async move {
                match s {
                    Ok(mut s) => drop(s.recv().await),
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = wait(int) => {}
                _ = wait(term) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Loads the model, starts the engine thread and marks the server ready.
fn load(
    state: &AppState,
    args: &ServeArgs,
    model_path: &std::path::Path,
    engine_thread: &Mutex<EngineSlot>,
    kv_events: Option<KvEventPublisher>,
) -> Result<()> {
    let (model, tokenizer) = Model::load_as(model_path, false, args.dtype.resolve(args.device))?;
    let (cfg, max_model_len) = engine_config(args, &model.cfg)?;
    let eos = model.cfg.eos_token_ids.clone();
    let defaults = model.cfg.generation.clone();
    let sched = cfg.sched.clone();
    let model_card = model_card::ModelCard::new(&model.cfg, &tokenizer, max_model_len)?;
    let vocab_size = model.cfg.vocab_size;
    let kv_plan = crate::serve::setup::kv_plan(&model.cfg, &sched, cfg.kv_dtype.bytes());
    let engine = crate::serve::setup::engine_for(args.device, &model, &cfg)?;
    if let Some(line) = engine.disk_plan() {
        crate::log!("strata serve: {line}");
    }
    let mut slot = engine_thread.lock().expect("not poisoned");
    if slot.stopping {
        return Ok(()); // stopped while loading: nothing to start
    }
    state.metrics.engine_loaded(
        max_model_len,
        CacheConfigInfo {
            block_size: sched.block_size.to_string(),
            cache_dtype: cfg.kv_dtype.name().to_string(),
            enable_prefix_caching: "True".into(), // always on, as vLLM prints it
            num_gpu_blocks: sched.num_gpu_blocks.to_string(),
            num_cpu_blocks: sched.max_cpu_offload_blocks.to_string(),
            num_disk_blocks: sched.max_disk_offload_blocks.to_string(),
            engine: "0".into(),
        },
    );
    let (client, thread) =
        engine_thread::spawn(engine, Arc::clone(&state.metrics), eos, kv_events)?;
    slot.thread = Some(thread);
    let loaded = Loaded {
        tokenizer: Arc::new(tokenizer),
        defaults,
        engine: client,
        max_model_len,
        vocab_size,
        info: EngineInfo {
            device: args.device,
            block_size: sched.block_size,
            num_gpu_blocks: sched.num_gpu_blocks,
            max_num_seqs: sched.max_num_seqs,
            max_num_batched_tokens: sched.max_num_batched_tokens,
        },
        model_card,
    };
    if state.loaded.set(loaded).is_err() {
        bail!("the model was loaded twice");
    }
    drop(slot);
    crate::engine::print_threads_note();
    crate::log!(
        "strata serve: ready (max-model-len {max_model_len}, {} GPU blocks + {} host blocks of {} tokens, max-num-seqs {})",
        sched.num_gpu_blocks, sched.max_cpu_offload_blocks, sched.block_size, sched.max_num_seqs
    );
    crate::log!("strata serve: {kv_plan}");
    Ok(())
}
