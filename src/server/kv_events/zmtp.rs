//! ZMTP 3 (RFC 23, with RFC 37's subscription commands), the serving half of two socket
//! types, as a sans-IO codec: bytes in, events out, with every size checked before
//! anything is buffered or allocated. `pub_socket` drives it over TCP or Unix sockets.
//!
//! - PUB (`Role::Publisher`, the event stream) only ever *receives* a greeting, a READY
//!   command and subscriptions;
//! - ROUTER (`Role::Router`, the replay socket) receives requests: whole messages of at
//!   most `MAX_REQUEST_FRAMES` frames.
//!
//! All of it is small, so a frame that declares more than `MAX_INBOUND_FRAME` bytes ends
//! the connection before its body is read (the pure-Rust `zeromq` 0.7 crate this replaces
//! reserved whatever a frame declared: 73 bytes declaring 2^62 aborted the server).
//!
//! We announce ZMTP 3.0, so libzmq and the `zeromq` crate send subscriptions as messages
//! whose first byte is 1 (subscribe) or 0 (cancel); 3.1's SUBSCRIBE / CANCEL commands are
//! understood too, and PING is answered with PONG.

use thiserror::Error;

/// Largest frame a subscriber may send: a subscription prefix of `MAX_SUBSCRIPTION`
/// bytes or a READY command with the usual properties fits with room to spare.
pub const MAX_INBOUND_FRAME: u64 = 4096;
/// Longest subscription prefix kept (vLLM's topics are short; Dynamo subscribes to "").
pub const MAX_SUBSCRIPTION: usize = 1024;
/// Distinct subscriptions one peer may hold at once.
pub const MAX_SUBSCRIPTIONS: usize = 64;
/// Frames of one request to a ROUTER (a replay request has two: empty, start).
pub const MAX_REQUEST_FRAMES: usize = 4;

/// Which socket this side is: the peers it accepts and what their traffic means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// PUB: subscribers (SUB, XSUB) whose traffic is subscriptions.
    Publisher,
    /// ROUTER: requesters (DEALER, REQ, ROUTER) whose traffic is requests.
    Router,
}

impl Role {
    /// Its ZMTP socket type, as READY names it.
    pub fn socket_type(self) -> &'static str {
        match self {
            Role::Publisher => "PUB",
            Role::Router => "ROUTER",
        }
    }

    /// Whether a peer of `socket_type` may talk to this socket (RFC 28, RFC 23).
    fn accepts(self, socket_type: &[u8]) -> bool {
        match self {
            Role::Publisher => matches!(socket_type, b"SUB" | b"XSUB"),
            Role::Router => matches!(socket_type, b"DEALER" | b"REQ" | b"ROUTER"),
        }
    }
}

const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Why a peer is disconnected: each is a broken or hostile peer, never ours.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("not a ZMTP greeting")]
    BadSignature,
    #[error("ZMTP {0}.x is not supported (3.0 or later)")]
    OldVersion(u8),
    #[error("security mechanism {0:?} is not supported (NULL only)")]
    Mechanism(String),
    #[error("reserved frame flags set ({0:#04x})")]
    ReservedFlags(u8),
    #[error("a frame of {0} bytes (at most {MAX_INBOUND_FRAME})")]
    FrameTooLarge(u64),
    #[error("malformed {0} command")]
    BadCommand(&'static str),
    #[error("expected a READY command, got {0}")]
    NoReady(String),
    #[error("a {0:?} socket cannot talk to a {1} socket")]
    SocketType(String, &'static str),
    #[error("a subscription of {0} bytes (at most {MAX_SUBSCRIPTION})")]
    SubscriptionTooLong(usize),
    #[error("more than {MAX_SUBSCRIPTIONS} subscriptions")]
    TooManySubscriptions,
    #[error("a request of more than {MAX_REQUEST_FRAMES} frames")]
    RequestTooLong,
    #[error("the peer sent ERROR")]
    PeerError,
}

/// What a peer said, once a whole unit of it has arrived.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Its greeting was a ZMTP 3 NULL greeting: send READY.
    Greeting,
    /// Its READY named a socket type this role accepts: the handshake is complete.
    Ready,
    Subscribe(Vec<u8>),
    Cancel(Vec<u8>),
    /// A whole message to a ROUTER, its frames in order.
    Request(Vec<Vec<u8>>),
    /// A heartbeat: answer `pong(context)`.
    Ping(Vec<u8>),
    /// A frame this role ignores (a PONG, an unknown command, a message to a PUB that is
    /// no subscription, a subscription to a ROUTER).
    Ignored,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Greeting,
    Handshake,
    Traffic,
}

/// The inbound half of one connection.
#[derive(Debug)]
pub struct Decoder {
    role: Role,
    stage: Stage,
    /// Inside a multipart message: its later frames are never subscriptions.
    in_message: bool,
    /// A ROUTER's request so far (at most `MAX_REQUEST_FRAMES` capped frames).
    request: Vec<Vec<u8>>,
}

impl Decoder {
    pub fn new(role: Role) -> Self {
        Self {
            role,
            stage: Stage::Greeting,
            in_message: false,
            request: Vec::new(),
        }
    }

    /// True once the peer's READY has been accepted.
    pub fn is_ready(&self) -> bool {
        self.stage == Stage::Traffic
    }

    /// How many bytes the next unit needs in all (header included), judged from what is
    /// buffered: the caller reads at most this many before decoding again, so a peer's
    /// bytes are held only up to one frame of at most `MAX_INBOUND_FRAME`.
    pub fn wanted(&self, buf: &[u8]) -> Result<usize, ProtocolError> {
        if self.stage == Stage::Greeting {
            return Ok(GREETING_LEN);
        }
        Ok(match frame_header(buf)? {
            None => header_len(buf),
            Some((_, header, body)) => header + body,
        })
    }

    /// Takes one whole unit from the front of `buf` (draining it), or `None` while it is
    /// incomplete. A frame declaring too much is refused from its header alone.
    pub fn decode(&mut self, buf: &mut Vec<u8>) -> Result<Option<Event>, ProtocolError> {
        if self.stage == Stage::Greeting {
            if buf.len() < GREETING_LEN {
                // The signature can be judged from its first byte: refuse non-ZMTP early.
                if buf.first().is_some_and(|&b| b != 0xFF) {
                    return Err(ProtocolError::BadSignature);
                }
                return Ok(None);
            }
            let greeting: Vec<u8> = buf.drain(..GREETING_LEN).collect();
            check_greeting(&greeting)?;
            self.stage = Stage::Handshake;
            return Ok(Some(Event::Greeting));
        }
        let Some((flags, header, body_len)) = frame_header(buf)? else {
            return Ok(None);
        };
        if buf.len() < header + body_len {
            return Ok(None);
        }
        let frame: Vec<u8> = buf.drain(..header + body_len).skip(header).collect();
        let command = flags & FLAG_COMMAND != 0;
        match self.stage {
            Stage::Greeting => unreachable!("handled above"),
            Stage::Handshake => {
                let (name, body) = if command {
                    split_command(&frame)?
                } else {
                    return Err(ProtocolError::NoReady("a message".into()));
                };
                if name != b"READY" {
                    return Err(ProtocolError::NoReady(printable(name)));
                }
                let socket_type = ready_socket_type(body)?;
                if !self.role.accepts(&socket_type) {
                    return Err(ProtocolError::SocketType(
                        printable(&socket_type),
                        self.role.socket_type(),
                    ));
                }
                self.stage = Stage::Traffic;
                Ok(Some(Event::Ready))
            }
            Stage::Traffic if command => {
                let (name, body) = split_command(&frame)?;
                let publisher = self.role == Role::Publisher;
                Ok(Some(match name {
                    b"SUBSCRIBE" if publisher => Event::Subscribe(body.to_vec()),
                    b"CANCEL" if publisher => Event::Cancel(body.to_vec()),
                    b"PING" => {
                        // ttl (2 bytes), then a context of at most 16 bytes to echo.
                        if body.len() < 2 || body.len() > 2 + 16 {
                            return Err(ProtocolError::BadCommand("PING"));
                        }
                        Event::Ping(body[2..].to_vec())
                    }
                    b"ERROR" => return Err(ProtocolError::PeerError),
                    b"READY" => return Err(ProtocolError::BadCommand("READY")),
                    _ => Event::Ignored,
                }))
            }
            Stage::Traffic if self.role == Role::Router => {
                self.request.push(frame);
                if self.request.len() > MAX_REQUEST_FRAMES {
                    return Err(ProtocolError::RequestTooLong);
                }
                Ok(Some(if flags & FLAG_MORE != 0 {
                    Event::Ignored // more frames of this request to come
                } else {
                    Event::Request(std::mem::take(&mut self.request))
                }))
            }
            Stage::Traffic => {
                let first = !self.in_message;
                self.in_message = flags & FLAG_MORE != 0;
                Ok(Some(match (first, frame.first()) {
                    (true, Some(1)) => Event::Subscribe(frame[1..].to_vec()),
                    (true, Some(0)) => Event::Cancel(frame[1..].to_vec()),
                    _ => Event::Ignored,
                }))
            }
        }
    }
}

/// Bytes of a frame header, judged from its flags byte (2 if nothing is buffered yet).
fn header_len(buf: &[u8]) -> usize {
    match buf.first() {
        Some(&f) if f & FLAG_LONG != 0 => 9,
        _ => 2,
    }
}

/// `(flags, header bytes, body bytes)` once the header is buffered; the size is checked
/// against `MAX_INBOUND_FRAME` here, before anything of the body is kept.
fn frame_header(buf: &[u8]) -> Result<Option<(u8, usize, usize)>, ProtocolError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ProtocolError::ReservedFlags(flags));
    }
    if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
        return Err(ProtocolError::BadCommand("multipart"));
    }
    let header = header_len(buf);
    if buf.len() < header {
        return Ok(None);
    }
    let size = if header == 9 {
        u64::from_be_bytes(buf[1..9].try_into().expect("8 bytes"))
    } else {
        buf[1] as u64
    };
    if size > MAX_INBOUND_FRAME {
        return Err(ProtocolError::FrameTooLarge(size));
    }
    Ok(Some((flags, header, size as usize)))
}

fn check_greeting(g: &[u8]) -> Result<(), ProtocolError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ProtocolError::BadSignature);
    }
    if g[10] < 3 {
        return Err(ProtocolError::OldVersion(g[10]));
    }
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|&b| b != 0) {
        return Err(ProtocolError::Mechanism(printable(&mechanism[..name_len])));
    }
    Ok(())
}

/// A command frame's body: a name (one length byte, then the name) and its data.
fn split_command(frame: &[u8]) -> Result<(&[u8], &[u8]), ProtocolError> {
    let n = *frame.first().ok_or(ProtocolError::BadCommand("empty"))? as usize;
    if frame.len() < 1 + n {
        return Err(ProtocolError::BadCommand("truncated"));
    }
    Ok((&frame[1..1 + n], &frame[1 + n..]))
}

/// READY's metadata (`name-size name value-size(4, BE) value`...): its Socket-Type.
fn ready_socket_type(mut body: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    let bad = || ProtocolError::BadCommand("READY");
    let mut socket_type = None;
    while !body.is_empty() {
        let n = body[0] as usize;
        let name = body.get(1..1 + n).ok_or_else(bad)?;
        let size = body.get(1 + n..5 + n).ok_or_else(bad)?;
        let size = u32::from_be_bytes(size.try_into().expect("4 bytes")) as usize;
        let value = body.get(5 + n..5 + n + size).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(value.to_vec());
        }
        body = &body[5 + n + size..];
    }
    socket_type.ok_or_else(bad)
}

/// Peer-controlled bytes for an error message: ASCII graphic characters, the rest escaped.
fn printable(bytes: &[u8]) -> String {
    bytes
        .iter()
        .take(32)
        .flat_map(|&b| std::ascii::escape_default(b))
        .map(char::from)
        .collect()
}

/// Our greeting: ZMTP 3.0, NULL mechanism, as-server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1;
    g
}

/// Our READY command: `Socket-Type` the role's.
pub fn ready(role: Role) -> Vec<u8> {
    let socket_type = role.socket_type().as_bytes();
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type);
    frame(FLAG_COMMAND, &body)
}

/// The answer to a PING: PONG with the ping's context.
pub fn pong(context: &[u8]) -> Vec<u8> {
    let mut body = vec![4];
    body.extend_from_slice(b"PONG");
    body.extend_from_slice(context);
    frame(FLAG_COMMAND, &body)
}

/// A whole message, its frames in order (all but the last flagged MORE).
pub fn message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 9).sum());
    for (i, part) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
        out.extend_from_slice(&frame(more, part));
    }
    out
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() <= 255 {
        out.extend_from_slice(&[flags, body.len() as u8]);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
    out
}

/// One peer's subscriptions: prefixes of the topic frame, counted as libzmq counts them
/// (subscribing twice needs two cancels), bounded in number and length.
#[derive(Debug, Default)]
pub struct Subscriptions {
    prefixes: Vec<(Vec<u8>, u32)>,
}

impl Subscriptions {
    pub fn subscribe(&mut self, prefix: Vec<u8>) -> Result<(), ProtocolError> {
        if prefix.len() > MAX_SUBSCRIPTION {
            return Err(ProtocolError::SubscriptionTooLong(prefix.len()));
        }
        if let Some((_, n)) = self.prefixes.iter_mut().find(|(p, _)| *p == prefix) {
            *n = n.saturating_add(1);
            return Ok(());
        }
        if self.prefixes.len() >= MAX_SUBSCRIPTIONS {
            return Err(ProtocolError::TooManySubscriptions);
        }
        self.prefixes.push((prefix, 1));
        Ok(())
    }

    pub fn cancel(&mut self, prefix: &[u8]) {
        if let Some(i) = self.prefixes.iter().position(|(p, _)| p == prefix) {
            self.prefixes[i].1 -= 1;
            if self.prefixes[i].1 == 0 {
                self.prefixes.swap_remove(i);
            }
        }
    }

    pub fn matches(&self, topic: &[u8]) -> bool {
        self.prefixes.iter().any(|(p, _)| topic.starts_with(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subscriber's greeting (as libzmq sends it: version 3.1, NULL, not as-server).
    fn peer_greeting() -> Vec<u8> {
        let mut g = greeting().to_vec();
        g[11] = 1;
        g[32] = 0;
        g
    }

    fn peer_ready(socket_type: &[u8]) -> Vec<u8> {
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        body.extend_from_slice(socket_type);
        body.push(8);
        body.extend_from_slice(b"Identity");
        body.extend_from_slice(&0u32.to_be_bytes());
        frame(FLAG_COMMAND, &body)
    }

    fn decode_all(bytes: &[u8]) -> Result<Vec<Event>, ProtocolError> {
        decode_as(Role::Publisher, bytes)
    }

    fn decode_as(role: Role, bytes: &[u8]) -> Result<Vec<Event>, ProtocolError> {
        let mut d = Decoder::new(role);
        let mut buf = bytes.to_vec();
        let mut out = Vec::new();
        while let Some(e) = d.decode(&mut buf)? {
            out.push(e);
        }
        Ok(out)
    }

    #[test]
    fn a_subscriber_handshakes_and_subscribes_by_message_or_by_command() {
        let mut bytes = peer_greeting();
        bytes.extend(peer_ready(b"SUB"));
        bytes.extend(frame(0, b"\x01kv")); // ZMTP 3.0
        bytes.extend(frame(FLAG_COMMAND, b"\x09SUBSCRIBEab")); // ZMTP 3.1
        bytes.extend(frame(0, b"\x00kv"));
        bytes.extend(frame(FLAG_COMMAND, b"\x04PING\x00\x0actx"));
        bytes.extend(frame(FLAG_MORE, b"\x05not a subscription"));
        bytes.extend(frame(0, b"\x01a later part, not a subscription"));
        assert_eq!(
            decode_all(&bytes).unwrap(),
            [
                Event::Greeting,
                Event::Ready,
                Event::Subscribe(b"kv".to_vec()),
                Event::Subscribe(b"ab".to_vec()),
                Event::Cancel(b"kv".to_vec()),
                Event::Ping(b"ctx".to_vec()),
                Event::Ignored,
                Event::Ignored,
            ]
        );
    }

    #[test]
    fn a_frame_declaring_2_pow_62_bytes_is_refused_from_its_header() {
        // The 73-byte packet that aborted the server: a greeting, then a long-frame header.
        let mut bytes = peer_greeting();
        bytes.extend(peer_ready(b"SUB"));
        bytes.push(FLAG_LONG);
        bytes.extend((1u64 << 62).to_be_bytes());
        let mut d = Decoder::new(Role::Publisher);
        let mut buf = bytes;
        assert_eq!(d.decode(&mut buf), Ok(Some(Event::Greeting)));
        assert_eq!(d.decode(&mut buf), Ok(Some(Event::Ready)));
        assert_eq!(d.wanted(&buf), Err(ProtocolError::FrameTooLarge(1 << 62)));
        assert_eq!(
            d.decode(&mut buf),
            Err(ProtocolError::FrameTooLarge(1 << 62))
        );
        // Also during the handshake, before READY.
        let mut bytes = peer_greeting();
        bytes.extend([FLAG_COMMAND | FLAG_LONG, 0x40, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            decode_all(&bytes),
            Err(ProtocolError::FrameTooLarge(1 << 62))
        );
    }

    #[test]
    fn wanted_never_exceeds_one_capped_frame() {
        let mut d = Decoder::new(Role::Publisher);
        assert_eq!(d.wanted(&[]), Ok(64));
        let mut buf = peer_greeting();
        d.decode(&mut buf).unwrap();
        assert_eq!(d.wanted(&[]), Ok(2));
        assert_eq!(d.wanted(&[FLAG_LONG]), Ok(9));
        assert_eq!(d.wanted(&[0, 200]), Ok(202));
        let mut long = vec![FLAG_LONG];
        long.extend(MAX_INBOUND_FRAME.to_be_bytes());
        assert_eq!(d.wanted(&long), Ok(9 + MAX_INBOUND_FRAME as usize));
        long[8] += 1;
        assert!(d.wanted(&long).is_err());
    }

    #[test]
    fn handshake_refusals_name_the_fault() {
        let with = |tail: Vec<u8>| {
            let mut b = peer_greeting();
            b.extend(tail);
            decode_all(&b).unwrap_err()
        };
        assert_eq!(
            decode_all(b"GET / HTTP/1.1\r\n"),
            Err(ProtocolError::BadSignature)
        );
        let mut old = peer_greeting();
        old[10] = 2;
        assert_eq!(decode_all(&old), Err(ProtocolError::OldVersion(2)));
        let mut plain = peer_greeting();
        plain[12..17].copy_from_slice(b"PLAIN");
        assert_eq!(
            decode_all(&plain),
            Err(ProtocolError::Mechanism("PLAIN".into()))
        );
        assert_eq!(
            with(frame(0, b"\x01")),
            ProtocolError::NoReady("a message".into())
        );
        assert_eq!(
            with(peer_ready(b"PUSH")),
            ProtocolError::SocketType("PUSH".into(), "PUB")
        );
        assert_eq!(
            with(peer_ready(b"DEALER")),
            ProtocolError::SocketType("DEALER".into(), "PUB")
        );
        assert_eq!(
            with(frame(
                FLAG_COMMAND,
                b"\x05READY\x0bSocket-Type\x00\x00\x00\x09SUB"
            )),
            ProtocolError::BadCommand("READY")
        );
        assert_eq!(with(vec![0x80, 0]), ProtocolError::ReservedFlags(0x80));
    }

    #[test]
    fn a_router_takes_requesters_and_whole_requests_of_few_frames() {
        let mut bytes = peer_greeting();
        bytes.extend(peer_ready(b"DEALER"));
        bytes.extend(frame(FLAG_MORE, b""));
        bytes.extend(frame(0, &7u64.to_be_bytes()));
        bytes.extend(frame(FLAG_COMMAND, b"\x04PING\x00\x0actx"));
        bytes.extend(frame(0, b"\x01not a subscription here"));
        bytes.extend(frame(FLAG_COMMAND, b"\x09SUBSCRIBEab"));
        assert_eq!(
            decode_as(Role::Router, &bytes).unwrap(),
            [
                Event::Greeting,
                Event::Ready,
                Event::Ignored,
                Event::Request(vec![vec![], 7u64.to_be_bytes().to_vec()]),
                Event::Ping(b"ctx".to_vec()),
                Event::Request(vec![b"\x01not a subscription here".to_vec()]),
                Event::Ignored,
            ]
        );
        for requester in [&b"REQ"[..], b"ROUTER"] {
            let mut ok = peer_greeting();
            ok.extend(peer_ready(requester));
            assert_eq!(decode_as(Role::Router, &ok).unwrap().len(), 2);
        }
        let mut sub = peer_greeting();
        sub.extend(peer_ready(b"SUB"));
        assert_eq!(
            decode_as(Role::Router, &sub),
            Err(ProtocolError::SocketType("SUB".into(), "ROUTER"))
        );
        // A request that never ends is cut at MAX_REQUEST_FRAMES frames.
        let mut long = peer_greeting();
        long.extend(peer_ready(b"DEALER"));
        for _ in 0..=MAX_REQUEST_FRAMES {
            long.extend(frame(FLAG_MORE, b"x"));
        }
        assert_eq!(
            decode_as(Role::Router, &long),
            Err(ProtocolError::RequestTooLong)
        );
        assert_eq!(
            &ready(Role::Router)[..],
            &frame(
                FLAG_COMMAND,
                b"\x05READY\x0bSocket-Type\x00\x00\x00\x06ROUTER"
            )[..]
        );
    }

    #[test]
    fn subscriptions_match_prefixes_count_duplicates_and_are_bounded() {
        let mut s = Subscriptions::default();
        assert!(!s.matches(b"kv"));
        s.subscribe(b"kv".to_vec()).unwrap();
        s.subscribe(b"kv".to_vec()).unwrap();
        assert!(s.matches(b"kv-events") && !s.matches(b"k"));
        s.cancel(b"kv");
        assert!(s.matches(b"kv"));
        s.cancel(b"kv");
        assert!(!s.matches(b"kv"));
        s.subscribe(Vec::new()).unwrap();
        assert!(s.matches(b"anything"));
        for i in 1..MAX_SUBSCRIPTIONS {
            s.subscribe(i.to_string().into_bytes()).unwrap();
        }
        assert_eq!(
            s.subscribe(b"one too many".to_vec()),
            Err(ProtocolError::TooManySubscriptions)
        );
        assert_eq!(
            s.subscribe(vec![b'x'; MAX_SUBSCRIPTION + 1]),
            Err(ProtocolError::SubscriptionTooLong(MAX_SUBSCRIPTION + 1))
        );
    }

    #[test]
    fn messages_are_framed_short_and_long_with_more_flags() {
        let payload = vec![7u8; 300];
        let m = message(&[b"topic", &1u64.to_be_bytes(), &payload]);
        assert_eq!(&m[..7], b"\x01\x05topic");
        assert_eq!(&m[7..9], &[FLAG_MORE, 8]);
        assert_eq!(m[17], FLAG_LONG);
        assert_eq!(&m[18..26], &300u64.to_be_bytes());
        assert_eq!(m.len(), 7 + 10 + 9 + 300);
    }
}
