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
//! The socket is strata's own (`pub_socket` over the `zmtp` codec), not a ZMQ library's:
//! a PUB port receives frames too, and the one that must never grow with what a peer
//! declares or how many peers come (docs/server.md "KV-event socket").

pub mod pub_socket;
pub mod zmtp;

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::serve::block_key::BlockKey;
use crate::serve::cache_events::{CacheEvent, KvGroup};
use anyhow::{anyhow, Context, Result};
use pub_socket::{Limits, PeerStats, PubSocket};
use serde::Serialize;
use tokio::sync::mpsc::{self, error::TrySendError};

/// Batches (one per engine step at most) waiting for the publisher thread.
const QUEUE_BATCHES: usize = 1024;
/// How long the last batches get to reach subscribers when the server stops.
const LINGER: Duration = Duration::from_millis(200);

/// `tcp://HOST:PORT` to bind, `*` for every interface, port 0 for any free port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqEndpoint {
    host: String,
    port: u16,
}

impl FromStr for ZmqEndpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("expected tcp://HOST:PORT (HOST may be `*`), got {s:?}");
        let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse().map_err(|_| bad())?;
        if host.is_empty() || host.contains(['/', ' ']) {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp://{}:{}", self.host, self.port)
    }
}

impl ZmqEndpoint {
    /// What the socket binds (`HOST:PORT`): ZMQ's `*` is the unspecified address.
    fn bind_address(&self) -> String {
        let host = if self.host == "*" {
            "0.0.0.0"
        } else {
            &self.host
        };
        if host.contains(':') {
            format!("[{}]:{}", host.trim_matches(['[', ']']), self.port)
        } else {
            format!("{host}:{}", self.port)
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
    /// The endpoint bound (port 0 resolved), for subscribers: `tcp://HOST:PORT`.
    pub bound: String,
    pub topic: String,
}

impl KvEventPublisher {
    /// Binds the PUB socket on its own thread and returns once it is bound (or failed).
    pub fn start(endpoint: &ZmqEndpoint, topic: &str, block_size: usize) -> Result<Self> {
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let address = endpoint.bind_address();
        let topic_bytes = topic.as_bytes().to_vec();
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || publish_loop(address, topic_bytes, block_size, rx, ready_tx))
            .context("starting the KV events thread")?;
        let (addr, peers) = ready_rx
            .recv()
            .map_err(|_| anyhow!("the KV events thread stopped while binding"))?
            .with_context(|| format!("cannot bind --kv-events-endpoint {endpoint}"))?;
        let host = match addr.ip() {
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            dropped: Arc::new(AtomicU64::new(0)),
            peers,
            bound: format!("tcp://{host}:{}", addr.port()),
            topic: topic.to_string(),
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

/// What binding found: the address bound (port 0 resolved) and the peers' counters.
type Bound = (std::net::SocketAddr, Arc<PeerStats>);

/// The publisher thread: a current-thread runtime driving the PUB socket and its peers.
fn publish_loop(
    address: String,
    topic: Vec<u8>,
    block_size: usize,
    mut rx: mpsc::Receiver<Vec<CacheEvent>>,
    ready: std::sync::mpsc::Sender<Result<Bound>>,
) {
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
        let socket = match PubSocket::bind(&address, Limits::DEFAULT).await {
            Ok(socket) => {
                let _ = ready.send(Ok((socket.local_addr, Arc::clone(&socket.stats))));
                socket
            }
            Err(e) => {
                let _ = ready.send(Err(anyhow!("{e}")));
                return;
            }
        };
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let payload = encode_batch(unix_seconds(), &events, block_size);
            socket.send(&[&topic, &seq.to_be_bytes(), &payload]);
            seq += 1;
        }
        socket.close(LINGER).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::cache_events::Medium;

    #[test]
    fn endpoints_are_tcp_host_port_and_anything_else_is_refused() {
        let e: ZmqEndpoint = "tcp://127.0.0.1:5557".parse().unwrap();
        assert_eq!(e.to_string(), "tcp://127.0.0.1:5557");
        assert_eq!(
            "tcp://*:0".parse::<ZmqEndpoint>().unwrap().bind_address(),
            "0.0.0.0:0"
        );
        assert_eq!(
            "tcp://[::1]:7"
                .parse::<ZmqEndpoint>()
                .unwrap()
                .bind_address(),
            "[::1]:7"
        );
        for bad in [
            "127.0.0.1:5557",
            "ipc:///tmp/x",
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
