//! The serving engine on its own (non-async) thread, and the channels to it.
//!
//! Handlers send commands over a std channel; each request gets a tokio channel of
//! `Event`s back. Before every step the thread checks each request's event channel: a
//! closed one means the client went away (the handler's stream or future was dropped), and
//! the request is aborted, so its GPU pages and host slots are free after that step.
//! After every step the prefix cache's events go to the KV-event publisher, if any.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Result;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::api::Finish;
use super::kv_events::KvEventPublisher;
use super::metrics::{Metrics, RequestTimes};
use crate::engine::logprobs::TokenLogprob;
use crate::serve::cache_events::CacheEvent;
use crate::serve::scheduler::{SeqId, SeqStatus};
use crate::serve::{Engine, EngineStats, RequestParams};

/// What a request hears from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt's log-probabilities (its tokens from the second on), when asked for:
    /// before the first token.
    PromptLogprobs(Vec<TokenLogprob>),
    /// A generated token, with its log-probability when asked for.
    Token(u32, Option<TokenLogprob>),
    /// The last event of a request that ran.
    Done(Finish),
    /// The engine refused the request (a bad request; the last event).
    Refused(String),
    /// The engine failed (the last event).
    Failed(String),
}

enum Command {
    Submit {
        prompt: Vec<u32>,
        params: RequestParams,
        events: UnboundedSender<Event>,
        arrived: Instant,
    },
    /// End every request now with `Finish::Abort` (the shutdown grace period is over).
    CancelAll,
    /// Finish what is in flight, then stop the thread.
    Shutdown,
    /// Drop the GPU prefix cache if the engine is idle (vLLM's `/reset_prefix_cache`);
    /// answers whether it did.
    ResetPrefixCache(tokio::sync::oneshot::Sender<bool>),
}

/// The handlers' side: cheap to clone.
#[derive(Clone)]
pub struct EngineClient {
    tx: Sender<Command>,
    alive: Arc<AtomicBool>,
}

impl EngineClient {
    /// Queues a request; its events arrive on the receiver. Dropping the receiver cancels it.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: RequestParams,
    ) -> Result<UnboundedReceiver<Event>, EngineStopped> {
        let (events, rx) = unbounded_channel();
        self.tx
            .send(Command::Submit {
                prompt,
                params,
                events,
                arrived: Instant::now(),
            })
            .map_err(|_| EngineStopped)?;
        Ok(rx)
    }

    pub fn cancel_all(&self) {
        let _ = self.tx.send(Command::CancelAll);
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Drops the GPU prefix cache; false when requests hold KV (nothing is dropped then).
    pub async fn reset_prefix_cache(&self) -> Result<bool, EngineStopped> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::ResetPrefixCache(reply))
            .map_err(|_| EngineStopped)?;
        rx.await.map_err(|_| EngineStopped)
    }

    /// False once the engine thread has stopped (after shutdown, or after an engine error).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct EngineStopped;

/// Starts the engine thread and its compute pool, or says why it could not (a thread
/// limit). `eos` are the ids whose generation means `finish_reason: stop`; `kv_events`
/// publishes the prefix cache's events (and `AllBlocksCleared` when it stops).
pub fn spawn(
    engine: Engine,
    metrics: Arc<Metrics>,
    eos: Vec<u32>,
    kv_events: Option<KvEventPublisher>,
) -> Result<(EngineClient, JoinHandle<Result<()>>)> {
    let (tx, rx) = channel();
    let alive = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&alive);
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let thread = crate::threads::spawn("strata-engine", move || {
        // However the thread ends — an error, a panic — the server must stop saying it
        // serves (`/health`).
        let _alive = AliveFlag(flag);
        // This thread runs every step: as a compute thread, not one that sleeps while
        // the pool's workers compute and wake it (docs/cpu.md, "Threading").
        let _pool = match crate::engine::compute_pool_on_this_thread() {
            Ok(pool) => {
                let _ = started_tx.send(Ok(()));
                pool
            }
            Err(e) => {
                let _ = started_tx.send(Err(e));
                return Ok(());
            }
        };
        let r = EngineLoop::new(engine, metrics, eos, kv_events).run(rx);
        if let Err(e) = &r {
            crate::log!("error: the engine stopped: {e:#}");
        }
        r
    })?;
    started_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the engine thread ended while starting"))??;
    Ok((EngineClient { tx, alive }, thread))
}

/// Clears the engine's liveness flag when dropped: when its thread ends, whichever way.
struct AliveFlag(Arc<AtomicBool>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A request the engine is working on.
struct Active {
    events: UnboundedSender<Event>,
    /// Its phases so far (for the metrics).
    times: RequestTimes,
    /// Output tokens already sent.
    sent: usize,
    /// An end-of-sequence token ends it (`finish_reason: stop`); false with `ignore_eos`.
    stops_at_eos: bool,
}

struct EngineLoop {
    engine: Engine,
    metrics: Arc<Metrics>,
    eos: Vec<u32>,
    active: HashMap<SeqId, Active>,
    last_stats: EngineStats,
    kv_events: Option<KvEventPublisher>,
}

impl EngineLoop {
    fn new(
        mut engine: Engine,
        metrics: Arc<Metrics>,
        eos: Vec<u32>,
        kv_events: Option<KvEventPublisher>,
    ) -> Self {
        if kv_events.is_some() {
            engine.record_cache_events();
        }
        Self {
            engine,
            metrics,
            eos,
            active: HashMap::new(),
            last_stats: EngineStats::default(),
            kv_events,
        }
    }

    /// Serves commands until shutdown (or an engine error); then the GPU cache is gone, so
    /// subscribers hear `AllBlocksCleared`.
    fn run(mut self, rx: Receiver<Command>) -> Result<()> {
        let r = self.serve(rx);
        if let Some(p) = &mut self.kv_events {
            p.publish(vec![CacheEvent::Cleared]);
            p.close();
        }
        r
    }

    fn serve(&mut self, rx: Receiver<Command>) -> Result<()> {
        self.observe();
        let mut open = true;
        loop {
            // Admit commands between steps; block only when there is nothing to step.
            loop {
                let cmd = if self.engine.has_unfinished() || !open {
                    match rx.try_recv() {
                        Ok(c) => c,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                } else {
                    match rx.recv() {
                        Ok(c) => c,
                        Err(_) => {
                            open = false;
                            break;
                        }
                    }
                };
                match cmd {
                    Command::Submit {
                        prompt,
                        params,
                        events,
                        arrived,
                    } => self.admit(prompt, &params, events, arrived),
                    Command::CancelAll => self.cancel_all()?,
                    Command::ResetPrefixCache(reply) => {
                        let _ = reply.send(self.engine.reset_prefix_cache());
                        self.observe(); // the events (AllBlocksCleared) go out now
                    }
                    Command::Shutdown => open = false,
                }
            }
            self.cancel_disconnected()?;
            if !self.engine.has_unfinished() {
                self.observe();
                if !open {
                    return Ok(());
                }
                continue;
            }
            let step_start = Instant::now();
            match self.engine.step() {
                Ok(finished) => {
                    // The step's counters first: a client that has its answer and then
                    // reads /metrics sees the step that answered it.
                    self.observe();
                    self.mark_scheduled(step_start);
                    self.deliver(&finished)?;
                }
                Err(e) => {
                    for (_, a) in self.active.drain() {
                        let _ = a.events.send(Event::Failed(format!("engine error: {e:#}")));
                    }
                    return Err(e);
                }
            }
            self.observe();
        }
    }

    fn admit(
        &mut self,
        prompt: Vec<u32>,
        params: &RequestParams,
        events: UnboundedSender<Event>,
        arrived: Instant,
    ) {
        let prompt_len = prompt.len();
        match self.engine.add_request(prompt, params) {
            Ok(id) if params.max_tokens == 0 => {
                // Finished on arrival: no step will report it.
                self.engine.take_finished(id);
                let _ = events.send(Event::Done(Finish::Length));
            }
            Ok(id) => {
                self.active.insert(
                    id,
                    Active {
                        events,
                        times: RequestTimes {
                            arrived,
                            scheduled: None,
                            first_token: None,
                            last_token: None,
                            prompt_tokens: prompt_len,
                            generation_tokens: 0,
                            max_tokens: params.max_tokens,
                        },
                        sent: 0,
                        stops_at_eos: !params.ignore_eos,
                    },
                );
            }
            Err(e) => {
                let _ = events.send(Event::Refused(format!("{e:#}")));
            }
        }
    }

    /// Aborts every request whose client has gone.
    fn cancel_disconnected(&mut self) -> Result<()> {
        let gone: Vec<SeqId> = self
            .active
            .iter()
            .filter(|(_, a)| a.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.active.remove(&id);
            self.engine.abort(id)?;
            self.metrics.request_cancelled();
        }
        Ok(())
    }

    fn cancel_all(&mut self) -> Result<()> {
        let now = Instant::now();
        for (id, a) in std::mem::take(&mut self.active) {
            self.engine.abort(id)?;
            self.metrics.finished(Finish::Abort, &a.times, now);
            let _ = a.events.send(Event::Done(Finish::Abort));
        }
        Ok(())
    }

    /// Notes the step (started at `step_start`) in which each request first computed.
    fn mark_scheduled(&mut self, step_start: Instant) {
        for (&id, a) in self.active.iter_mut() {
            if a.times.scheduled.is_some() {
                continue;
            }
            let started = self
                .engine
                .scheduler()
                .seq(id)
                .is_some_and(|s| s.num_computed > 0 || s.tokens.len() > s.prompt_len);
            if started {
                a.times.scheduled = Some(step_start);
            }
        }
    }

    /// Sends every request its new tokens, and `Done` to those that finished.
    fn deliver(&mut self, finished: &[SeqId]) -> Result<()> {
        let now = Instant::now();
        for (&id, a) in self.active.iter_mut() {
            let Some(seq) = self.engine.scheduler().seq(id) else {
                continue;
            };
            let new = seq.output()[a.sent..].to_vec();
            let logprobs = self.engine.take_logprobs(id);
            if let Some(prompt) = logprobs.prompt {
                let _ = a.events.send(Event::PromptLogprobs(prompt));
            }
            let mut sampled = logprobs.sampled.into_iter();
            for &t in &new {
                let times = &mut a.times;
                let since = times.last_token.unwrap_or(times.arrived);
                self.metrics
                    .token(times.last_token.is_none(), (now - since).as_secs_f64());
                times.first_token.get_or_insert(now);
                times.last_token = Some(now);
                times.generation_tokens += 1;
                let _ = a.events.send(Event::Token(t, sampled.next()));
            }
            a.sent += new.len();
        }
        for &id in finished {
            let Some(a) = self.active.remove(&id) else {
                continue;
            };
            let seq = self
                .engine
                .take_finished(id)
                .filter(|s| s.status == SeqStatus::Finished);
            let stopped = a.stops_at_eos
                && seq
                    .as_ref()
                    .and_then(|s| s.output().last())
                    .is_some_and(|t| self.eos.contains(t));
            let reason = if stopped {
                Finish::Stop
            } else {
                Finish::Length
            };
            self.metrics.finished(reason, &a.times, now);
            let _ = a.events.send(Event::Done(reason));
        }
        Ok(())
    }

    fn observe(&mut self) {
        let stats = self.engine.stats();
        self.metrics
            .observe_engine(self.engine.scheduler(), &stats, &mut self.last_stats);
        if let Some(p) = &self.kv_events {
            p.publish(self.engine.take_cache_events());
            self.metrics.kv_events_dropped(p.dropped());
        }
    }
}
