//! A ZMQ PUB socket on TCP or a Unix-domain socket (ZMQ's `ipc://`) with the limits a port
//! open to a network needs (docs/server.md "KV-event socket"), over the `zmtp` codec. It
//! binds and accepts subscribers, or (`connect`) dials one subscriber that bound, and
//! dials again whenever that connection ends, as ZMQ reconnects. `ReplaySocket` is the
//! ROUTER beside it (`replay`), bound, under the same limits.
//!
//! - at most `max_peers` connections at once; one more takes the place of the oldest peer
//!   still handshaking (an honest subscriber handshakes in a millisecond, so peers that
//!   connect and say nothing cannot keep subscribers out), or is closed at once when every
//!   peer has subscribed (both counted);
//! - a peer has `handshake_timeout` to send its greeting and READY, or it is closed;
//! - what a peer sends is read one capped frame at a time (`zmtp::MAX_INBOUND_FRAME`) and
//!   its subscriptions are bounded (`zmtp::MAX_SUBSCRIPTIONS`), so no peer grows memory;
//! - publishing never waits for a peer: each message goes into a bounded broadcast queue
//!   (`queue` messages); a peer that falls that far behind misses messages (counted), as
//!   ZMQ's high-water mark drops them; a peer whose socket accepts nothing for
//!   `write_stall_timeout` is closed, so a subscriber that never reads frees its slot;
//! - an accept error (out of descriptors) pauses accepting briefly instead of spinning.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{broadcast, oneshot, watch, Semaphore};

use super::replay::{self, ReplayBuffer};
use super::zmtp::{self, Decoder, Event, ProtocolError, Role, Subscriptions};

/// Where a socket binds or connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// `HOST:PORT` (an IPv6 host in brackets).
    Tcp(String),
    /// A Unix-domain socket's path.
    Ipc(PathBuf),
}

/// A connection to one peer, over either transport.
enum PeerStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<PeerStream> {
        Ok(match self {
            Listener::Tcp(l) => PeerStream::Tcp(l.accept().await?.0),
            Listener::Unix(l) => PeerStream::Unix(l.accept().await?.0),
        })
    }
}

/// Binds a Unix-domain socket at `path`, replacing a stale socket file left there (as
/// libzmq does); anything else at the path (a file, a link, a directory) is refused.
fn bind_unix(path: &PathBuf) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(_) => {}
    }
    UnixListener::bind(path)
}

/// The socket's limits (`Limits::DEFAULT` in `strata serve`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_peers: usize,
    pub handshake_timeout: Duration,
    pub write_stall_timeout: Duration,
    /// Messages a peer may fall behind before it misses some.
    pub queue: usize,
}

impl Limits {
    pub const DEFAULT: Limits = Limits {
        max_peers: 64,
        handshake_timeout: Duration::from_secs(5),
        write_stall_timeout: Duration::from_secs(30),
        queue: 1024,
    };
}

/// Counters of what peers did, for `/metrics`.
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Peers connected now (handshaking or subscribed).
    pub connected: AtomicU64,
    /// Connections closed at once because `max_peers` were connected and subscribed.
    pub refused: AtomicU64,
    /// Peers closed for a protocol error, a handshake timeout, a stalled socket, or
    /// while still handshaking to make room for a newer connection.
    pub disconnected: AtomicU64,
    /// Messages peers missed because they fell `queue` messages behind.
    pub missed: AtomicU64,
}

/// One message, framed once for every peer, with its topic for their filters.
struct Outbound {
    topic: Vec<u8>,
    bytes: Vec<u8>,
}

/// What a peer's connection serves once it has handshaken.
#[derive(Clone)]
enum Service {
    /// PUB: the published messages its subscriptions match.
    Publish(broadcast::Sender<Arc<Outbound>>),
    /// ROUTER: answers to its replay requests.
    Replay(Arc<ReplayBuffer>),
}

impl Service {
    fn role(&self) -> Role {
        match self {
            Service::Publish(_) => Role::Publisher,
            Service::Replay(_) => Role::Router,
        }
    }
}

/// What a socket of either kind holds: its peers' permits, its stop signal, its counters.
struct Peers {
    stop: watch::Sender<bool>,
    permits: Arc<Semaphore>,
    max: usize,
    stats: Arc<PeerStats>,
}

impl Peers {
    fn new(limits: Limits) -> Self {
        Self {
            stop: watch::channel(false).0,
            permits: Arc::new(Semaphore::new(limits.max_peers)),
            max: limits.max_peers,
            stats: Arc::new(PeerStats::default()),
        }
    }

    /// Binds `addr` and accepts peers for `service` (on the current tokio runtime);
    /// returns the TCP address bound (port 0 resolved; `None` for ipc).
    async fn bind(
        &self,
        addr: &Address,
        limits: Limits,
        service: Service,
    ) -> std::io::Result<Option<SocketAddr>> {
        let (listener, local_addr) = match addr {
            Address::Tcp(a) => {
                let l = TcpListener::bind(a).await?;
                let local = l.local_addr()?;
                (Listener::Tcp(l), Some(local))
            }
            Address::Ipc(path) => (Listener::Unix(bind_unix(path)?), None),
        };
        tokio::spawn(accept_loop(
            listener,
            limits,
            service,
            Arc::clone(&self.permits),
            Arc::clone(&self.stats),
            self.stop.subscribe(),
        ));
        Ok(local_addr)
    }

    /// Stops accepting, gives peers up to `linger` to finish, then returns.
    async fn close(self, linger: Duration) {
        let _ = self.stop.send(true);
        // Every peer task holds a permit: all back means every peer has finished.
        let all = u32::try_from(self.max).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(linger, self.permits.acquire_many(all)).await;
    }
}

pub struct PubSocket {
    tx: broadcast::Sender<Arc<Outbound>>,
    peers: Peers,
    /// The TCP address bound (port 0 resolved); `None` for ipc or a connecting socket.
    pub local_addr: Option<SocketAddr>,
    pub stats: Arc<PeerStats>,
}

impl PubSocket {
    /// Binds `addr` and starts accepting subscribers (on the current tokio runtime).
    pub async fn bind(addr: &Address, limits: Limits) -> std::io::Result<Self> {
        let mut socket = Self::new(limits);
        let service = Service::Publish(socket.tx.clone());
        socket.local_addr = socket.peers.bind(addr, limits, service).await?;
        Ok(socket)
    }

    /// Dials a subscriber that bound `addr` (vLLM connects where the endpoint names one
    /// host) and dials again, backing off from 100 ms to 5 s, whenever the connection
    /// fails or ends; messages sent meanwhile are missed, as ZMQ's are.
    pub fn connect(addr: Address, limits: Limits) -> Self {
        let socket = Self::new(limits);
        tokio::spawn(dial_loop(
            addr,
            limits,
            Service::Publish(socket.tx.clone()),
            Arc::clone(&socket.peers.permits),
            Arc::clone(&socket.stats),
            socket.peers.stop.subscribe(),
        ));
        socket
    }

    fn new(limits: Limits) -> Self {
        let (tx, _) = broadcast::channel(limits.queue.max(1));
        let peers = Peers::new(limits);
        Self {
            tx,
            stats: Arc::clone(&peers.stats),
            peers,
            local_addr: None,
        }
    }

    /// Queues one message (its frames in order; the first is the topic) for every peer
    /// whose subscriptions match; never waits.
    pub fn send(&self, parts: &[&[u8]]) {
        let out = Outbound {
            topic: parts.first().map(|t| t.to_vec()).unwrap_or_default(),
            bytes: zmtp::message(parts),
        };
        // No receiver (no peer yet) is not an error: PUB drops what nobody subscribed to.
        let _ = self.tx.send(Arc::new(out));
    }

    /// Stops accepting, gives peers up to `linger` to receive what is queued, then closes.
    pub async fn close(self, linger: Duration) {
        drop(self.tx);
        self.peers.close(linger).await;
    }
}

/// The replay ROUTER (`replay`): always bound, as vLLM binds its replay endpoint.
pub struct ReplaySocket {
    peers: Peers,
    pub buffer: Arc<ReplayBuffer>,
    /// The TCP address bound (port 0 resolved); `None` for ipc.
    pub local_addr: Option<SocketAddr>,
    pub stats: Arc<PeerStats>,
}

impl ReplaySocket {
    /// Binds `addr` and answers replay requests from `buffer` (on the current runtime).
    pub async fn bind(
        addr: &Address,
        limits: Limits,
        buffer: Arc<ReplayBuffer>,
    ) -> std::io::Result<Self> {
        let peers = Peers::new(limits);
        let service = Service::Replay(Arc::clone(&buffer));
        let local_addr = peers.bind(addr, limits, service).await?;
        Ok(Self {
            stats: Arc::clone(&peers.stats),
            peers,
            buffer,
            local_addr,
        })
    }

    /// Stops accepting and gives requesters up to `linger` to finish.
    pub async fn close(self, linger: Duration) {
        self.peers.close(linger).await;
    }
}

/// The peers still handshaking, oldest first, each with the signal that evicts it.
#[derive(Default)]
struct Handshaking {
    next_id: u64,
    peers: VecDeque<(u64, oneshot::Sender<()>)>,
}

impl Handshaking {
    fn add(&mut self) -> (u64, oneshot::Receiver<()>) {
        let (evict, evicted) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.peers.push_back((id, evict));
        (id, evicted)
    }

    fn remove(&mut self, id: u64) {
        self.peers.retain(|(p, _)| *p != id);
    }

    /// Evicts the oldest peer still handshaking; false if there is none.
    fn evict_oldest(&mut self) -> bool {
        while let Some((_, evict)) = self.peers.pop_front() {
            if evict.send(()).is_ok() {
                return true;
            }
        }
        false
    }
}

async fn accept_loop(
    listener: Listener,
    limits: Limits,
    service: Service,
    peers: Arc<Semaphore>,
    stats: Arc<PeerStats>,
    mut stop: watch::Receiver<bool>,
) {
    let handshaking = Arc::new(Mutex::new(Handshaking::default()));
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(stream) => stream,
                // Out of descriptors, or a connection reset before it was accepted: wait
                // for descriptors to come back rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let permit = match Arc::clone(&peers).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if !handshaking.lock().expect("not poisoned").evict_oldest() {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    continue; // the stream is dropped: closed
                }
                // The evicted peer gives its permit back as its task ends.
                match Arc::clone(&peers).acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return,
                }
            }
        };
        let (id, evicted) = handshaking.lock().expect("not poisoned").add();
        let (service, stats) = (service.clone(), Arc::clone(&stats));
        let handshaking = Arc::clone(&handshaking);
        tokio::spawn(async move {
            let done = || handshaking.lock().expect("not poisoned").remove(id);
            peer_session(stream, limits, &service, &stats, evicted, done).await;
            handshaking.lock().expect("not poisoned").remove(id);
            drop(permit);
        });
    }
}

/// The connecting socket's one peer: dial, serve, and dial again after it ends.
async fn dial_loop(
    addr: Address,
    limits: Limits,
    service: Service,
    peers: Arc<Semaphore>,
    stats: Arc<PeerStats>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(_permit) = peers.acquire_owned().await else {
        return;
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        let dialed = async {
            Ok::<_, std::io::Error>(match &addr {
                Address::Tcp(a) => PeerStream::Tcp(TcpStream::connect(a).await?),
                Address::Ipc(p) => PeerStream::Unix(UnixStream::connect(p).await?),
            })
        };
        let stream = tokio::select! {
            r = tokio::time::timeout(limits.handshake_timeout, dialed) => r.ok().and_then(Result::ok),
            _ = stop.changed() => return,
        };
        if let Some(stream) = stream {
            backoff = Duration::from_millis(100);
            // Never evicted (the sender lives as long as the session). At close the session
            // goes on sending what is queued until the runtime ends, as accepted peers do.
            let (_never, evicted) = oneshot::channel();
            peer_session(stream, limits, &service, &stats, evicted, || {}).await;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// One peer from its handshake to its end, counted in `stats`.
async fn peer_session(
    stream: PeerStream,
    limits: Limits,
    service: &Service,
    stats: &PeerStats,
    evicted: oneshot::Receiver<()>,
    handshaken: impl FnOnce(),
) {
    stats.connected.fetch_add(1, Ordering::Relaxed);
    let end = match stream {
        PeerStream::Tcp(s) => {
            let _ = s.set_nodelay(true);
            serve_peer(s, limits, service, stats, evicted, handshaken).await
        }
        PeerStream::Unix(s) => serve_peer(s, limits, service, stats, evicted, handshaken).await,
    };
    if let Err(PeerEnd::Protocol | PeerEnd::Timeout) = end {
        stats.disconnected.fetch_add(1, Ordering::Relaxed);
    }
    stats.connected.fetch_sub(1, Ordering::Relaxed);
}

/// Why a peer's task ended early: it broke the protocol, or timed out (handshake, stalled
/// socket) or was evicted while handshaking, all counted; or its connection failed
/// (reset), which is not.
enum PeerEnd {
    Protocol,
    Timeout,
    Io,
}

impl From<ProtocolError> for PeerEnd {
    fn from(_: ProtocolError) -> Self {
        PeerEnd::Protocol
    }
}

impl From<std::io::Error> for PeerEnd {
    fn from(_: std::io::Error) -> Self {
        PeerEnd::Io
    }
}

/// Reads what the peer sends until at least one whole unit is buffered; `Ok(false)` at
/// end of stream. Never reads past the unit the decoder wants, so `buf` stays within one
/// capped frame.
async fn read_some(
    rd: &mut (impl AsyncRead + Unpin),
    decoder: &Decoder,
    buf: &mut Vec<u8>,
) -> Result<bool, PeerEnd> {
    let want = decoder.wanted(buf)?;
    let mut chunk = [0u8; 4096];
    let missing = want.saturating_sub(buf.len()).clamp(1, chunk.len());
    // Read into `chunk`, not `buf`: this future may be dropped at the await (select!).
    let n = rd.read(&mut chunk[..missing]).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

async fn write_within(
    wr: &mut (impl AsyncWrite + Unpin),
    bytes: &[u8],
    limit: Duration,
) -> Result<(), PeerEnd> {
    match tokio::time::timeout(limit, wr.write_all(bytes)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PeerEnd::Timeout),
    }
}

/// One peer: handshake under its timeout (or until `evicted`; `handshaken` is called once
/// it is complete), then its service — a subscriber's subscriptions in and the matching
/// messages out, a requester's replay requests answered — until it leaves, misbehaves,
/// stalls or the socket closes.
async fn serve_peer<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    limits: Limits,
    service: &Service,
    stats: &PeerStats,
    evicted: oneshot::Receiver<()>,
    handshaken: impl FnOnce(),
) -> Result<(), PeerEnd> {
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut decoder = Decoder::new(service.role());
    let mut buf = Vec::new();
    let handshake = async {
        write_within(&mut wr, &zmtp::greeting(), limits.handshake_timeout).await?;
        while !decoder.is_ready() {
            match decoder.decode(&mut buf)? {
                Some(Event::Greeting) => {
                    write_within(
                        &mut wr,
                        &zmtp::ready(service.role()),
                        limits.handshake_timeout,
                    )
                    .await?
                }
                Some(_) => {}
                None => {
                    if !read_some(&mut rd, &decoder, &mut buf).await? {
                        return Err(PeerEnd::Io);
                    }
                }
            }
        }
        Ok(())
    };
    tokio::select! {
        r = tokio::time::timeout(limits.handshake_timeout, handshake) => match r {
            Ok(r) => r?,
            Err(_) => return Err(PeerEnd::Timeout),
        },
        _ = evicted => return Err(PeerEnd::Timeout),
    }
    handshaken();
    let tx = match service {
        Service::Publish(tx) => tx,
        Service::Replay(buffer) => {
            return answer_replays(&mut rd, &mut wr, &mut decoder, &mut buf, buffer, limits).await
        }
    };
    let mut rx = tx.subscribe();
    let end = stream_messages(
        &mut rd,
        &mut wr,
        &mut decoder,
        &mut buf,
        &mut rx,
        limits,
        stats,
    )
    .await;
    // What was queued for it and never sent is missed too.
    stats.missed.fetch_add(rx.len() as u64, Ordering::Relaxed);
    end
}

/// After the handshake: subscriptions in, matching messages out.
async fn stream_messages(
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
    decoder: &mut Decoder,
    buf: &mut Vec<u8>,
    rx: &mut broadcast::Receiver<Arc<Outbound>>,
    limits: Limits,
    stats: &PeerStats,
) -> Result<(), PeerEnd> {
    let mut subs = Subscriptions::default();
    loop {
        // Whatever whole units are buffered (subscriptions sent right after READY).
        while let Some(event) = decoder.decode(buf)? {
            match event {
                Event::Subscribe(prefix) => subs.subscribe(prefix)?,
                Event::Cancel(prefix) => subs.cancel(&prefix),
                Event::Ping(context) => {
                    write_within(wr, &zmtp::pong(&context), limits.write_stall_timeout).await?
                }
                // (Requests come only to a ROUTER.)
                Event::Greeting | Event::Ready | Event::Ignored | Event::Request(_) => {}
            }
        }
        tokio::select! {
            more = read_some(rd, decoder, buf) => {
                if !more? {
                    return Ok(()); // the subscriber left
                }
            }
            msg = rx.recv() => match msg {
                Ok(msg) => {
                    if subs.matches(&msg.topic) {
                        write_within(wr, &msg.bytes, limits.write_stall_timeout).await?;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    stats.missed.fetch_add(n, Ordering::Relaxed);
                }
                // The socket closed and everything queued was sent.
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
        }
    }
}

/// A requester of the replay ROUTER: each `[b"", start]` answered with the kept batches
/// from `start` and the end marker, one request at a time (the next is read only once
/// the answer is written: a requester gets replies only as fast as it reads them).
async fn answer_replays(
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
    decoder: &mut Decoder,
    buf: &mut Vec<u8>,
    buffer: &ReplayBuffer,
    limits: Limits,
) -> Result<(), PeerEnd> {
    loop {
        while let Some(event) = decoder.decode(buf)? {
            match event {
                Event::Request(frames) => {
                    let Some(start) = replay::requested_start(&frames) else {
                        continue; // not a replay request: ignored, as vLLM does
                    };
                    for reply in buffer.since(start) {
                        write_within(wr, &reply, limits.write_stall_timeout).await?;
                    }
                    write_within(wr, &replay::end_marker(), limits.write_stall_timeout).await?;
                }
                Event::Ping(context) => {
                    write_within(wr, &zmtp::pong(&context), limits.write_stall_timeout).await?
                }
                _ => {}
            }
        }
        if !read_some(rd, decoder, buf).await? {
            return Ok(()); // the requester left
        }
    }
}
