//! `--kv-events-endpoint`: the prefix cache's events (`serve::cache_events`) on a ZMQ PUB
//! socket, in vLLM's wire format, so KV-aware routers built for vLLM (Dynamo's KV router,
//! llm-d) can send each request to the instance holding its prefix (docs/distributed.md).
//!
//! Wire format (vLLM `vllm/distributed/kv_events.py`): each message is three frames,
//! `[topic, sequence number (u64, big-endian), payload]`; the payload is a msgpack array
//! `[ts, events, data_parallel_rank]`, each event a map tagged by `type`: `BlockStored`
//! `{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//! group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window}`, `BlockRemoved
//! {block_hashes, medium, group_idx}`, `AllBlocksCleared {}`. Groups as vLLM's KV-cache
//! groups: 0 `full_attention` (every layer of a model without windows), 1
//! `sliding_window` for a model whose windowed layers have their own pool (its blocks'
//! windowed KV may be gone while the full layers' stays: its own `BlockRemoved`).
//!
//! The engine thread never waits for the socket: it hands each step's events to a bounded
//! channel (`try_send`); when the publisher thread falls behind, the batch is dropped and
//! counted (`strata:kv_events_dropped_total`). ZMQ PUB drops for slow subscribers too.
//!
//! With `--kv-events-replay-endpoint`, the last batches are kept and served to whoever
//! asks on a ROUTER socket, as vLLM's `replay_endpoint` (`replay`).
//!
//! The socket is strata's own (`pub_socket` over the `zmtp` codec), not a ZMQ library's:
//! a PUB port receives frames too, and the one that must never grow with what a peer
//! declares or how many peers come (docs/server.md "KV-event socket").

pub mod pub_socket;
pub mod replay;
pub mod zmtp;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::serve::block_key::BlockKey;
use crate::serve::cache_events::{CacheEvent, KvGroup};
use anyhow::{anyhow, Context, Result};
use pub_socket::{Address, Limits, PeerStats, PubSocket, ReplaySocket};
use replay::ReplayBuffer;
use serde::Serialize;
use tokio::sync::mpsc::{self, error::TrySendError};

/// Batches (one per engine step at most) waiting for the publisher thread, and messages a
/// subscriber may fall behind, unless `--kv-events-queue` says otherwise.
pub const DEFAULT_QUEUE: usize = 1024;
/// How long the last batches get to reach subscribers when the server stops.
const LINGER: Duration = Duration::from_millis(200);

/// `tcp://HOST:PORT` or `ipc://PATH`. As vLLM decides: a socket binds an `ipc://` path or a
/// TCP endpoint whose host is `*` (every interface) or contains `::`, and connects to any
/// other TCP endpoint (a subscriber that bound there) — except that port 0 (any free
/// port) can only be bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZmqEndpoint {
    Tcp { host: String, port: u16 },
    Ipc(PathBuf),
}

impl FromStr for ZmqEndpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("expected tcp://HOST:PORT (HOST may be `*`) or ipc://PATH, got {s:?}");
        if let Some(path) = s.strip_prefix("ipc://") {
            if path.is_empty() || path.contains('\0') {
                return Err(bad());
            }
            return Ok(Self::Ipc(PathBuf::from(path)));
        }
        let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse().map_err(|_| bad())?;
        if host.is_empty() || host.contains(['/', ' ']) {
            return Err(bad());
        }
        Ok(Self::Tcp {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
            Self::Ipc(path) => write!(f, "ipc://{}", path.display()),
        }
    }
}

impl ZmqEndpoint {
    /// Whether the socket binds here (else it connects), by vLLM's rule above.
    pub fn binds(&self) -> bool {
        match self {
            Self::Ipc(_) => true,
            Self::Tcp { host, port } => host == "*" || host.contains("::") || *port == 0,
        }
    }

    /// The transport address: for TCP `HOST:PORT`, ZMQ's `*` the unspecified address.
    fn address(&self) -> Address {
        match self {
            Self::Ipc(path) => Address::Ipc(path.clone()),
            Self::Tcp { host, port } => {
                let host = if host == "*" { "0.0.0.0" } else { host };
                Address::Tcp(if host.contains(':') {
                    format!("[{}]:{port}", host.trim_matches(['[', ']']))
                } else {
                    format!("{host}:{port}")
                })
            }
        }
    }
}

/// One event as msgpack maps it: an internally tagged enum is a map whose `type` names the
/// variant, as msgspec's `tag=True` structs are. Block keys travel in vLLM's 64-bit form.
#[derive(Serialize)]
#[serde(tag = "type")]
enum WireEvent<'a> {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: usize,
        lora_id: Option<u64>,
        medium: &'static str,
        lora_name: Option<&'a str>,
        group_idx: u32,
        kv_cache_spec_kind: &'static str,
        kv_cache_spec_sliding_window: Option<usize>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: &'static str,
        group_idx: u32,
    },
    AllBlocksCleared {},
}

fn wire(keys: &[BlockKey]) -> Vec<u64> {
    keys.iter().map(BlockKey::wire).collect()
}

/// A group's index, vLLM's name for its kind, and its window.
fn group_fields(group: KvGroup) -> (u32, &'static str, Option<usize>) {
    match group {
        KvGroup::Full => (0, "full_attention", None),
        KvGroup::Window { tokens } => (1, "sliding_window", Some(tokens)),
    }
}

/// The payload of one message: `[ts, [event, ...], data_parallel_rank]` (rank 0: one engine).
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: usize) -> Vec<u8> {
    let wire: Vec<WireEvent> = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored {
                medium,
                group,
                parent,
                hashes,
                tokens,
            } => {
                let (group_idx, kind, window) = group_fields(*group);
                WireEvent::BlockStored {
                    block_hashes: wire(hashes),
                    parent_block_hash: parent.as_ref().map(BlockKey::wire),
                    token_ids: tokens,
                    block_size,
                    lora_id: None,
                    medium: medium.as_str(),
                    lora_name: None,
                    group_idx,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: window,
                }
            }
            CacheEvent::Removed {
                medium,
                group,
                hashes,
            } => WireEvent::BlockRemoved {
                block_hashes: wire(hashes),
                medium: medium.as_str(),
                group_idx: group_fields(*group).0,
            },
            CacheEvent::Cleared => WireEvent::AllBlocksCleared {},
        })
        .collect();
    rmp_serde::to_vec_named(&(ts, wire, 0u32)).expect("plain data always encodes")
}

/// The engine thread's handle to the publisher thread.
pub struct KvEventPublisher {
    tx: Option<mpsc::Sender<Vec<CacheEvent>>>,
    thread: Option<JoinHandle<()>>,
    dropped: Arc<AtomicU64>,
    /// What subscribers did (connected, refused, disconnected, missed messages).
    pub peers: Arc<PeerStats>,
    /// Where subscribers find the events: the endpoint bound (port 0 resolved), or the
    /// one this socket connects to.
    pub bound: String,
    pub topic: String,
    /// Where the replay socket is bound (port 0 resolved), if there is one.
    pub replay_bound: Option<String>,
}

/// `--kv-events-*`: where, under which topic, and how many batches may wait.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    pub endpoint: ZmqEndpoint,
    pub topic: String,
    /// Batches waiting for the publisher thread, and messages a subscriber may fall behind.
    pub queue: usize,
    pub block_size: usize,
    /// The replay ROUTER's endpoint (always bound) and how many batches it keeps.
    pub replay: Option<(ZmqEndpoint, usize)>,
}

impl KvEventPublisher {
    /// Binds (or starts connecting) the PUB socket on its own thread and returns once it
    /// is bound (or failed).
    pub fn start(cfg: &KvEventsConfig) -> Result<Self> {
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let endpoint = cfg.endpoint.clone();
        let (topic, block_size) = (cfg.topic.as_bytes().to_vec(), cfg.block_size);
        let limits = Limits {
            queue: cfg.queue.max(1),
            ..Limits::DEFAULT
        };
        let sockets = Sockets {
            endpoint,
            replay: cfg.replay.clone(),
            limits,
        };
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || publish_loop(sockets, topic, block_size, rx, ready_tx))
            .context("starting the KV events thread")?;
        let bound = ready_rx
            .recv()
            .map_err(|_| anyhow!("the KV events thread stopped while binding"))??;
        let peers = bound.peers;
        let replay_bound = cfg
            .replay
            .as_ref()
            .map(|(e, _)| endpoint_name(bound.replay, e));
        let bound = endpoint_name(bound.events, &cfg.endpoint);
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            dropped: Arc::new(AtomicU64::new(0)),
            peers,
            bound,
            topic: cfg.topic.clone(),
            replay_bound,
        })
    }

    /// Queues one step's events; never blocks. A full queue drops them (counted).
    pub fn publish(&self, events: Vec<CacheEvent>) {
        let Some(tx) = &self.tx else { return };
        if events.is_empty() {
            return;
        }
        let n = events.len() as u64;
        match tx.try_send(events) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Closed(_)) => {
                self.dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Events dropped because the publisher thread fell behind (or had stopped).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Sends what is queued, lets it reach subscribers, and stops the thread.
    pub fn close(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.close();
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An endpoint as peers reach it: the TCP address bound (port 0 resolved), else as given.
fn endpoint_name(bound: Option<std::net::SocketAddr>, endpoint: &ZmqEndpoint) -> String {
    match bound {
        Some(addr) => {
            let host = match addr.ip() {
                std::net::IpAddr::V6(ip) => format!("[{ip}]"),
                ip => ip.to_string(),
            };
            format!("tcp://{host}:{}", addr.port())
        }
        None => endpoint.to_string(),
    }
}

/// The sockets the publisher thread opens.
struct Sockets {
    endpoint: ZmqEndpoint,
    /// The replay endpoint and the batches it keeps.
    replay: Option<(ZmqEndpoint, usize)>,
    limits: Limits,
}

/// What binding found: the TCP addresses bound (port 0 resolved; none for ipc or a
/// connecting socket) and the event socket's peers' counters.
struct Bound {
    events: Option<std::net::SocketAddr>,
    replay: Option<std::net::SocketAddr>,
    peers: Arc<PeerStats>,
}

/// The publisher thread: a current-thread runtime driving the PUB socket (and the replay
/// ROUTER) and their peers.
fn publish_loop(
    sockets: Sockets,
    topic: Vec<u8>,
    block_size: usize,
    mut rx: mpsc::Receiver<Vec<CacheEvent>>,
    ready: std::sync::mpsc::Sender<Result<Bound>>,
) {
    let Sockets {
        endpoint,
        replay,
        limits,
    } = sockets;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(anyhow!("starting its runtime: {e}")));
            return;
        }
    };
    runtime.block_on(async move {
        let opened = if endpoint.binds() {
            PubSocket::bind(&endpoint.address(), limits).await
        } else {
            Ok(PubSocket::connect(endpoint.address(), limits))
        }
        .with_context(|| format!("cannot bind --kv-events-endpoint {endpoint}"));
        let socket = match opened {
            Ok(socket) => socket,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let replay = match replay {
            None => None,
            Some((at, batches)) => {
                let buffer = Arc::new(ReplayBuffer::new(batches, replay::MAX_BYTES));
                match ReplaySocket::bind(&at.address(), limits, buffer).await {
                    Ok(r) => Some(r),
                    Err(e) => {
                        let why = anyhow!("cannot bind --kv-events-replay-endpoint {at}: {e}");
                        let _ = ready.send(Err(why));
                        return;
                    }
                }
            }
        };
        let _ = ready.send(Ok(Bound {
            events: socket.local_addr,
            replay: replay.as_ref().and_then(|r| r.local_addr),
            peers: Arc::clone(&socket.stats),
        }));
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let payload = encode_batch(unix_seconds(), &events, block_size);
            socket.send(&[&topic, &seq.to_be_bytes(), &payload]);
            if let Some(r) = &replay {
                r.buffer.push(seq, &topic, &payload);
            }
            seq += 1;
        }
        socket.close(LINGER).await;
        if let Some(r) = replay {
            r.close(LINGER).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::cache_events::Medium;

    #[test]
    fn endpoints_are_tcp_or_ipc_bound_or_connected_as_vllm_decides() {
        let parse = |s: &str| s.parse::<ZmqEndpoint>().unwrap();
        let e = parse("tcp://127.0.0.1:5557");
        assert_eq!(e.to_string(), "tcp://127.0.0.1:5557");
        // vLLM: bind for `*`, `::` and ipc; connect to one named host (port 0: bind).
        assert!(!e.binds(), "a named host and port: connect");
        assert_eq!(e.address(), Address::Tcp("127.0.0.1:5557".into()));
        assert!(parse("tcp://127.0.0.1:0").binds());
        let any = parse("tcp://*:5557");
        assert!(any.binds());
        assert_eq!(any.address(), Address::Tcp("0.0.0.0:5557".into()));
        let v6 = parse("tcp://[::1]:7");
        assert!(v6.binds());
        assert_eq!(v6.address(), Address::Tcp("[::1]:7".into()));
        let ipc = parse("ipc:///tmp/strata.sock");
        assert!(ipc.binds());
        assert_eq!(ipc.to_string(), "ipc:///tmp/strata.sock");
        assert_eq!(ipc.address(), Address::Ipc("/tmp/strata.sock".into()));
        for bad in [
            "127.0.0.1:5557",
            "ipc://",
            "inproc://x",
            "tcp://:5557",
            "tcp://host",
            "tcp://host:99999",
            "tcp://host:port",
        ] {
            let err = bad.parse::<ZmqEndpoint>().unwrap_err();
            assert!(err.contains("tcp://HOST:PORT"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_batch_encodes_as_vllm_tagged_maps_inside_an_array() {
        // Keys whose last 8 bytes (vLLM's int form) are the numbers below.
        let k = |n: u64| {
            let mut raw = [0xEE; 32];
            raw[24..].copy_from_slice(&n.to_be_bytes());
            BlockKey::from_bytes(raw)
        };
        let events = [
            CacheEvent::Stored {
                medium: Medium::Gpu,
                group: KvGroup::Full,
                parent: Some(k(7)),
                hashes: vec![k(u64::MAX), k(9)],
                tokens: vec![1, 2, 3, 4],
            },
            CacheEvent::Stored {
                medium: Medium::Gpu,
                group: KvGroup::Window { tokens: 512 },
                parent: None,
                hashes: vec![k(3)],
                tokens: vec![5, 6],
            },
            CacheEvent::Removed {
                medium: Medium::Disk,
                group: KvGroup::Full,
                hashes: vec![k(9)],
            },
            CacheEvent::Removed {
                medium: Medium::Gpu,
                group: KvGroup::Window { tokens: 512 },
                hashes: vec![k(3)],
            },
            CacheEvent::Cleared,
        ];
        let bytes = encode_batch(1.5, &events, 2);
        // Read back as plain msgpack (the structure a subscriber sees), not our own types.
        let v: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(
            v,
            serde_json::json!([1.5, [
                {"type": "BlockStored", "block_hashes": [u64::MAX, 9], "parent_block_hash": 7,
                 "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null, "medium": "GPU",
                 "lora_name": null, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
                 "kv_cache_spec_sliding_window": null},
                {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": null,
                 "token_ids": [5, 6], "block_size": 2, "lora_id": null, "medium": "GPU",
                 "lora_name": null, "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
                 "kv_cache_spec_sliding_window": 512},
                {"type": "BlockRemoved", "block_hashes": [9], "medium": "DISK", "group_idx": 0},
                {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 1},
                {"type": "AllBlocksCleared"},
            ], 0])
        );
    }
}
