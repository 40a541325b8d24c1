//! The `kv-events` target: what a peer of the KV-event port (`--kv-events-endpoint`) may
//! send, against a live `PubSocket` in this process over real TCP, while an honest
//! subscriber stays connected.
//!
//! A case is the bytes one peer sends (`peer`), then either a half-close (the peer reads
//! what the server answers until the server closes) or, with `reset`, an abrupt close.
//! Mutations work on the ZMTP structure (greeting fields, frame flags and declared sizes,
//! READY properties, PING, SUBSCRIBE/CANCEL in both ZMTP 3.0 and 3.1 forms, subscription
//! floods and prefixes at the caps) and on raw bytes. Contract checked after each case —
//! a breach panics, which the fuzzer records as a finding:
//! - what the server sent is its greeting, then whole command frames only (one READY
//!   first, PONGs), nothing published (nothing was), nothing cut;
//! - the server closes a peer that has half-closed within `CLOSE_WITHIN`;
//! - no task of the socket panicked (counted by the fuzzer's panic hook);
//! - the honest subscriber receives the next published message, and the socket holds no
//!   peer but it once the case's peer is gone.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::{rngs::StdRng, Rng};

use super::{mutate, Case};
use crate::server::kv_events::pub_socket::{Address, Limits, PubSocket};
use crate::server::kv_events::zmtp;

/// How long the server may take to close a peer that half-closed (well past the
/// handshake timeout, so a server that waits for it rather than noticing the close still
/// passes: that is slow, not wrong).
const CLOSE_WITHIN: Duration = Duration::from_secs(3);
/// How long the honest subscriber waits for a message published with nothing queued.
const RECEIVE_WITHIN: Duration = Duration::from_secs(5);
/// The topic the honest subscriber subscribes to and the fuzzer publishes on.
const TOPIC: &[u8] = b"kv@fuzz";

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

// ---------------------------------------------------------------------------------------
// a subscriber's side of ZMTP 3 (RFC 23), written from the RFC rather than from `zmtp`

/// A subscriber's greeting: ZMTP 3.0, NULL, as-client.
pub fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// One frame, short or long as its size needs.
pub fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(body.len() + 9);
    if body.len() < 256 {
        f.extend_from_slice(&[flags & !FLAG_LONG, body.len() as u8]);
    } else {
        f.push(flags | FLAG_LONG);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    f.extend_from_slice(body);
    f
}

/// A command's body: its name, then its data.
fn command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut b = vec![name.len() as u8];
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(data);
    b
}

/// READY's body with these properties.
fn ready_body(props: &[(&str, &[u8])]) -> Vec<u8> {
    let mut data = Vec::new();
    for (name, value) in props {
        data.push(name.len() as u8);
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(value.len() as u32).to_be_bytes());
        data.extend_from_slice(value);
    }
    command("READY", &data)
}

/// A subscription message (ZMTP 3.0's form): 1 (or 0 to cancel), then the prefix.
fn subscription(subscribe: bool, prefix: &[u8]) -> Vec<u8> {
    let mut b = vec![subscribe as u8];
    b.extend_from_slice(prefix);
    frame(0, &b)
}

/// An honest subscriber: handshakes, subscribes to one prefix, reads whole messages. Over
/// TCP by default; any stream (a Unix-domain socket, a connection a publisher dialed).
pub struct Subscriber<S = TcpStream> {
    pub stream: S,
}

/// A stream's read timeout (the ones `Subscriber` runs over all have one).
pub trait ReadTimeout {
    fn set_read_timeout(&self, d: Option<std::time::Duration>) -> std::io::Result<()>;
}

impl ReadTimeout for TcpStream {
    fn set_read_timeout(&self, d: Option<std::time::Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, d)
    }
}

impl ReadTimeout for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, d: Option<std::time::Duration>) -> std::io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, d)
    }
}

impl Subscriber<TcpStream> {
    pub fn connect(addr: SocketAddr, prefix: &[u8]) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Self::over(stream, prefix)
    }
}

impl<S: Read + Write + ReadTimeout> Subscriber<S> {
    /// Handshakes and subscribes over a connected stream.
    pub fn over(mut stream: S, prefix: &[u8]) -> std::io::Result<Self> {
        stream.set_read_timeout(Some(RECEIVE_WITHIN))?;
        let mut hello = greeting();
        hello.extend(frame(FLAG_COMMAND, &ready_body(&[("Socket-Type", b"SUB")])));
        hello.extend(subscription(true, prefix));
        stream.write_all(&hello)?;
        let mut s = Self { stream };
        let mut theirs = [0u8; 64];
        s.stream.read_exact(&mut theirs)?;
        let (flags, body) = s.frame()?;
        if (theirs[0], theirs[9], theirs[10]) != (0xFF, 0x7F, 3)
            || flags & FLAG_COMMAND == 0
            || !body.starts_with(b"\x05READY")
        {
            return Err(std::io::Error::other("not a ZMTP 3 publisher"));
        }
        Ok(s)
    }

    pub fn frame(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 1];
        self.stream.read_exact(&mut head)?;
        let size = if head[0] & FLAG_LONG != 0 {
            let mut n = [0u8; 8];
            self.stream.read_exact(&mut n)?;
            u64::from_be_bytes(n)
        } else {
            let mut n = [0u8; 1];
            self.stream.read_exact(&mut n)?;
            n[0] as u64
        };
        if size > 64 << 20 {
            return Err(std::io::Error::other(format!("a frame of {size} bytes")));
        }
        let mut body = vec![0u8; size as usize];
        self.stream.read_exact(&mut body)?;
        Ok((head[0], body))
    }

    /// One whole message: its frames.
    pub fn message(&mut self) -> std::io::Result<Vec<Vec<u8>>> {
        let mut parts = Vec::new();
        loop {
            let (flags, body) = self.frame()?;
            if flags & FLAG_COMMAND != 0 {
                return Err(std::io::Error::other("a command after READY"));
            }
            parts.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(parts);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// the socket under test

struct Fixture {
    socket: PubSocket,
    _runtime: tokio::runtime::Runtime,
    honest: Mutex<Subscriber>,
    seq: AtomicU64,
}

fn limits() -> Limits {
    Limits {
        max_peers: 8,
        handshake_timeout: Duration::from_secs(1),
        write_stall_timeout: Duration::from_secs(1),
        queue: 64,
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| start().expect("starting the in-process KV-event socket"))
}

fn start() -> Result<Fixture> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let socket = runtime.block_on(PubSocket::bind(
        &Address::Tcp("127.0.0.1:0".into()),
        limits(),
    ))?;
    let mut honest = Subscriber::connect(socket.local_addr.expect("a TCP socket"), TOPIC)?;
    // The subscription travels after the handshake: publish until the first one lands.
    honest
        .stream
        .set_read_timeout(Some(Duration::from_millis(20)))?;
    let mut seq = 0u64;
    loop {
        socket.send(&[TOPIC, &seq.to_be_bytes()]);
        seq += 1;
        let mut peek = [0u8; 1];
        if honest.stream.peek(&mut peek).is_ok() {
            break;
        }
        anyhow::ensure!(seq < 500, "the honest subscriber never received a message");
    }
    honest.stream.set_read_timeout(Some(RECEIVE_WITHIN))?;
    // Drain what raced the subscription: every message sent so far, in order.
    let mut last = None;
    while last != Some(seq - 1) {
        let m = honest.message().context("the first messages")?;
        last = Some(u64::from_be_bytes(m[1][..].try_into()?));
    }
    Ok(Fixture {
        socket,
        _runtime: runtime,
        honest: Mutex::new(honest),
        seq: AtomicU64::new(seq),
    })
}

/// Runs one case and checks the contract (module doc).
pub fn run_kv_events(case: &Case) -> Result<()> {
    let f = fixture();
    let panics_before = super::panics_seen();
    let bytes = case.get("peer").unwrap_or_default();
    let mut peer =
        TcpStream::connect(f.socket.local_addr.expect("a TCP socket")).context("connecting")?;
    peer.set_nodelay(true)?;
    // The server may close before taking it all (a protocol error): not ours to report.
    let _ = peer.write_all(bytes);
    if case.get("reset").is_some() {
        reset(&peer);
        drop(peer);
    } else {
        let _ = peer.shutdown(std::net::Shutdown::Write);
        let answer = super::read_until_closed(&mut peer, CLOSE_WITHIN)
            .unwrap_or_else(|e| panic!("the server kept a peer that had left: {e}"));
        check_answer(&answer);
    }
    // The honest subscriber still gets what is published, next in line.
    let seq = f.seq.fetch_add(1, Ordering::Relaxed);
    f.socket.send(&[TOPIC, &seq.to_be_bytes()]);
    let mut honest = f.honest.lock().unwrap_or_else(|e| e.into_inner());
    let m = honest
        .message()
        .unwrap_or_else(|e| panic!("the honest subscriber lost its message {seq}: {e}"));
    assert!(
        m.len() == 2 && m[0] == TOPIC && m[1] == seq.to_be_bytes(),
        "the honest subscriber got {m:?}, not message {seq}"
    );
    drop(honest);
    // The peer's task ends once it is gone (the handshake timeout at the latest).
    let start = Instant::now();
    while f.socket.stats.connected.load(Ordering::Relaxed) > 1 {
        assert!(
            start.elapsed() < limits().handshake_timeout + CLOSE_WITHIN,
            "a peer that left is still held"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    super::assert_no_panic_since(panics_before);
    Ok(())
}

/// Closes with a reset (SO_LINGER 0), as a crashed peer's kernel does.
fn reset(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on an open socket with a valid, correctly sized option.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// The server's side of the exchange: its greeting (or a prefix of it, if the peer's
/// bytes ended the connection first), then whole command frames: one READY first, then
/// PONGs.
fn check_answer(answer: &[u8]) {
    let ours = zmtp::greeting();
    let g = answer.len().min(ours.len());
    assert!(answer[..g] == ours[..g], "not our greeting: {answer:?}");
    let mut rest = &answer[g..];
    let mut frames = 0;
    while !rest.is_empty() {
        let (flags, body, len) =
            split_frame(rest).unwrap_or_else(|| panic!("a cut frame: {rest:?}"));
        assert!(flags & FLAG_COMMAND != 0, "a message sent: {body:?}");
        let name = if frames == 0 { "READY" } else { "PONG" };
        assert!(
            body.get(1..1 + name.len()) == Some(name.as_bytes()) && body[0] as usize == name.len(),
            "frame {frames} is not {name}: {body:?}"
        );
        rest = &rest[len..];
        frames += 1;
    }
}

/// The first frame of `b`: flags, body, bytes taken.
fn split_frame(b: &[u8]) -> Option<(u8, &[u8], usize)> {
    let flags = *b.first()?;
    let (size, head) = if flags & FLAG_LONG != 0 {
        (u64::from_be_bytes(b.get(1..9)?.try_into().ok()?), 9)
    } else {
        (*b.get(1)? as u64, 2)
    };
    let end = head + usize::try_from(size).ok()?;
    Some((flags, b.get(head..end)?, end))
}

// ---------------------------------------------------------------------------------------
// cases and mutations

/// What a peer says, unit by unit.
#[derive(Debug, Clone)]
enum Unit {
    Greeting(Vec<u8>),
    /// A frame; `declared` is its size field (the body's length unless mutated).
    Frame {
        flags: u8,
        declared: u64,
        body: Vec<u8>,
    },
    /// Bytes that parse as neither.
    Raw(Vec<u8>),
}

fn serialise(units: &[Unit]) -> Vec<u8> {
    let mut out = Vec::new();
    for u in units {
        match u {
            Unit::Greeting(g) | Unit::Raw(g) => out.extend_from_slice(g),
            Unit::Frame {
                flags,
                declared,
                body,
            } => {
                out.push(*flags);
                if flags & FLAG_LONG != 0 {
                    out.extend_from_slice(&declared.to_be_bytes());
                } else {
                    out.push(*declared as u8);
                }
                out.extend_from_slice(body);
            }
        }
    }
    out
}

/// Units of `b` as a peer's stream: a greeting if it starts with one, frames while they
/// are whole, the rest raw.
fn parse(b: &[u8]) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut rest = b;
    if rest.len() >= 64 && rest[0] == 0xFF {
        units.push(Unit::Greeting(rest[..64].to_vec()));
        rest = &rest[64..];
    }
    while let Some((flags, body, len)) = split_frame(rest) {
        units.push(Unit::Frame {
            flags,
            declared: body.len() as u64,
            body: body.to_vec(),
        });
        rest = &rest[len..];
    }
    if !rest.is_empty() {
        units.push(Unit::Raw(rest.to_vec()));
    }
    units
}

fn peer_case(units: Vec<Vec<u8>>) -> Case {
    let mut c = Case::default();
    c.set("peer", units.concat());
    c
}

fn ready(socket_type: &[u8]) -> Vec<u8> {
    frame(FLAG_COMMAND, &ready_body(&[("Socket-Type", socket_type)]))
}

/// Peers as libzmq and the `zeromq` crate talk, and as they might.
pub fn kv_events_cases() -> Vec<Case> {
    let mut ping = 10u16.to_be_bytes().to_vec();
    ping.extend_from_slice(b"ctx");
    vec![
        peer_case(vec![greeting(), ready(b"SUB"), subscription(true, b"")]),
        peer_case(vec![
            greeting(),
            ready(b"SUB"),
            subscription(true, b"kv"),
            subscription(true, b"kv@"),
            subscription(false, b"kv"),
        ]),
        peer_case(vec![
            greeting(),
            ready(b"XSUB"),
            frame(FLAG_COMMAND, &command("PING", &ping)),
            frame(FLAG_COMMAND, &command("SUBSCRIBE", b"kv")),
            frame(FLAG_COMMAND, &command("CANCEL", b"kv")),
        ]),
        peer_case(vec![
            greeting(),
            frame(
                FLAG_COMMAND,
                &ready_body(&[("Socket-Type", b"SUB"), ("Identity", b"fuzz")]),
            ),
            frame(FLAG_MORE, b"\x01part"),
            frame(0, b"\x01last"),
            subscription(true, &[b'p'; 300]),
        ]),
        peer_case(vec![greeting()]),
    ]
}

/// A frame a peer might send, built whole.
fn new_frame(rng: &mut StdRng) -> Vec<u8> {
    let prefix_len =
        [0usize, 1, 255, 256, 1023, 1024, 1025, 4094, 4095, 4096][rng.random_range(0..10)];
    match rng.random_range(0..8) {
        0 => subscription(rng.random(), &vec![b's'; prefix_len]),
        1 => {
            let mut ping = rng.random::<u16>().to_be_bytes().to_vec();
            ping.extend(vec![b'c'; rng.random_range(0..=20)]);
            frame(FLAG_COMMAND, &command("PING", &ping))
        }
        2 => frame(
            FLAG_COMMAND,
            &command(
                ["SUBSCRIBE", "CANCEL"][rng.random_range(0..2)],
                &vec![b'k'; prefix_len.min(4000)],
            ),
        ),
        3 => frame(FLAG_COMMAND, &command("ERROR", b"\x03bad")),
        4 => frame(FLAG_COMMAND, &command("PONG", b"")),
        5 => frame(FLAG_COMMAND, &command("HELLO", b"\x05plain")),
        6 => ready([&b"SUB"[..], b"PUB", b"XSUB", b"DEALER", b""][rng.random_range(0..5)]),
        _ => frame(rng.random(), &[]),
    }
}

fn mutate_greeting(g: &mut [u8], rng: &mut StdRng) {
    match rng.random_range(0..4) {
        0 => {
            let at = [0usize, 1, 8, 9, 10, 11, 12, 32, 33, 63][rng.random_range(0..10)];
            g[at] = [0u8, 1, 2, 3, 4, 0x7F, 0x80, 0xFF][rng.random_range(0..8)];
        }
        1 => {
            let mech: &[u8] = [
                &b"PLAIN"[..],
                b"CURVE",
                b"NUL\0",
                b"null",
                b"NULLNULLNULLNULLNULL",
            ][rng.random_range(0..5)];
            g[12..32].fill(0);
            let n = mech.len().min(20);
            g[12..12 + n].copy_from_slice(&mech[..n]);
        }
        _ => {
            let at = rng.random_range(0..g.len());
            g[at] ^= 1 << rng.random_range(0..8);
        }
    }
}

fn mutate_frame(flags: &mut u8, declared: &mut u64, body: &mut Vec<u8>, rng: &mut StdRng) {
    match rng.random_range(0..6) {
        0 => *flags ^= 1 << rng.random_range(0..8),
        1 => {
            // A declared size that is not the body's: an edge, the cap, or off by one.
            *flags |= FLAG_LONG;
            *declared = match rng.random_range(0..3) {
                0 => mutate::interesting(rng),
                1 => zmtp::MAX_INBOUND_FRAME + rng.random_range(0..3) - 1,
                _ => (body.len() as u64 + rng.random_range(0..3)).saturating_sub(1),
            };
        }
        2 if body.first().is_some_and(|&n| body.len() > n as usize) => {
            // A command's length fields: its name's, or a READY property value's.
            let at = rng.random_range(0..body.len());
            if at + 4 <= body.len() && rng.random() {
                let v = mutate::interesting(rng) as u32;
                body[at..at + 4].copy_from_slice(&v.to_be_bytes());
            } else {
                body[0] = [0u8, 1, 4, 5, 9, 255][rng.random_range(0..6)];
            }
            *declared = body.len() as u64;
        }
        _ => {
            mutate::mutate_bytes(body, rng);
            if *flags & FLAG_LONG == 0 && body.len() > 255 {
                body.truncate(255);
            }
            *declared = body.len() as u64;
        }
    }
}

/// One stacked change of a peer's bytes.
pub fn mutate_kv_events(case: &mut Case, rng: &mut StdRng) {
    let mut bytes = case.get("peer").unwrap_or_default().to_vec();
    if rng.random_range(0..5) == 0 {
        mutate::mutate_bytes(&mut bytes, rng);
    } else {
        let mut units = parse(&bytes);
        let n = units.len();
        match rng.random_range(0..10) {
            0..4 if n > 0 => match &mut units[rng.random_range(0..n)] {
                Unit::Greeting(g) => mutate_greeting(g, rng),
                Unit::Frame {
                    flags,
                    declared,
                    body,
                } => mutate_frame(flags, declared, body, rng),
                Unit::Raw(r) => mutate::mutate_bytes(r, rng),
            },
            4..6 => {
                let at = rng.random_range(0..=n);
                units.insert(at, Unit::Raw(new_frame(rng)));
            }
            6 if n > 0 => {
                // The same unit again and again: floods past the subscription cap.
                let at = rng.random_range(0..n);
                let times = [2usize, 63, 64, 65, 200, 2000][rng.random_range(0..6)];
                let again = vec![units[at].clone(); times];
                units.splice(at..at, again);
            }
            7 if n > 0 => {
                units.remove(rng.random_range(0..n));
            }
            8 if n > 1 => {
                let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
                units.swap(a, b);
            }
            _ => {
                // Distinct subscriptions by the dozen.
                let at = rng.random_range(0..=n);
                let many: Vec<Unit> = (0..rng.random_range(1..100))
                    .map(|i| Unit::Raw(subscription(true, format!("p{i}").as_bytes())))
                    .collect();
                units.splice(at..at, many);
            }
        }
        bytes = serialise(&units);
    }
    // A flood stays within what one write reasonably sends.
    bytes.truncate(4 << 20);
    case.set("peer", bytes);
    if rng.random_range(0..8) == 0 {
        if case.get("reset").is_some() {
            case.files.retain(|(n, _)| n != "reset");
        } else {
            case.set("reset", Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_bytes_parse_back_into_what_they_were_built_from() {
        for case in kv_events_cases() {
            let bytes = case.get("peer").unwrap();
            let units = parse(bytes);
            assert!(
                !units.iter().any(|u| matches!(u, Unit::Raw(_))),
                "{units:?}"
            );
            assert_eq!(serialise(&units), bytes);
        }
        // A frame declaring more than follows is left raw.
        let mut b = greeting();
        b.extend_from_slice(&[0x02, 0, 0, 0, 0, 0, 0, 1, 0, b'x']);
        assert!(matches!(parse(&b)[..], [Unit::Greeting(_), Unit::Raw(_)]));
    }

    #[test]
    fn the_answer_check_takes_a_handshake_and_refuses_a_message() {
        let mut ok = zmtp::greeting().to_vec();
        ok.extend(zmtp::ready(zmtp::Role::Publisher));
        ok.extend(zmtp::pong(b"c"));
        check_answer(&ok);
        check_answer(&ok[..10]);
        let mut bad = ok.clone();
        bad.extend(zmtp::message(&[b"kv", b"x"]));
        assert!(std::panic::catch_unwind(|| check_answer(&bad)).is_err());
        let cut = &ok[..ok.len() - 1];
        assert!(std::panic::catch_unwind(|| check_answer(cut)).is_err());
    }
}
