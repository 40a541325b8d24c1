//! The KV-event PUB socket against hostile and broken peers (docs/server.md "KV-event
//! socket"): a frame declaring 2^62 bytes, hundreds of silent connections, subscription
//! floods and subscribers that never read each cost the server a bounded amount and never
//! stop an honest subscriber from receiving every message. The honest subscriber here is
//! a plain blocking client speaking ZMTP 3 from the RFC (`strata::fuzz::kv_events`, not
//! the server's codec); tests/kv_events.rs checks libzmq's (pyzmq) against `strata serve`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use strata::fuzz::kv_events::{self, frame, greeting};
use strata::server::kv_events::pub_socket::{Address, Limits, PubSocket};

const SECOND: Duration = Duration::from_secs(1);

fn limits() -> Limits {
    Limits {
        max_peers: 8,
        handshake_timeout: Duration::from_millis(400),
        write_stall_timeout: Duration::from_millis(600),
        // More than a burst of `publish_and_receive` (sent faster than any peer drains).
        queue: 512,
    }
}

/// A socket on its own runtime thread, published to from the test thread.
struct Publisher {
    socket: Option<PubSocket>,
    runtime: tokio::runtime::Runtime,
}

impl Publisher {
    fn start(limits: Limits) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let socket = runtime
            .block_on(PubSocket::bind(&Address::Tcp("127.0.0.1:0".into()), limits))
            .unwrap();
        Self {
            socket: Some(socket),
            runtime,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.socket().local_addr.expect("a TCP socket")
    }

    fn socket(&self) -> &PubSocket {
        self.socket.as_ref().unwrap()
    }

    fn send(&self, topic: &[u8], seq: u64, payload: &[u8]) {
        let _guard = self.runtime.enter();
        self.socket().send(&[topic, &seq.to_be_bytes(), payload]);
    }

    fn stat(&self, pick: fn(&strata::server::kv_events::pub_socket::PeerStats) -> u64) -> u64 {
        pick(&self.socket().stats)
    }

    /// Waits until `pick` of the stats reaches `want`.
    fn wait_stat(
        &self,
        what: &str,
        pick: fn(&strata::server::kv_events::pub_socket::PeerStats) -> u64,
        want: u64,
    ) {
        let start = Instant::now();
        while self.stat(pick) < want {
            assert!(
                start.elapsed() < 10 * SECOND,
                "{what}: {} < {want}",
                self.stat(pick)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Publisher {
    /// Waits until `n` peers are connected: a peer's task counts itself out just after
    /// its connection closes (and after counting why), so a test that saw the close may
    /// look a moment too early.
    fn wait_connected(&self, n: u64) {
        let start = Instant::now();
        while self.stat(|s| s.connected.load(Ordering::Relaxed)) != n {
            assert!(
                start.elapsed() < 2 * SECOND,
                "{} peers connected, not {n}",
                self.stat(|s| s.connected.load(Ordering::Relaxed))
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(s) = self.socket.take() {
            self.runtime.block_on(s.close(Duration::from_millis(100)));
        }
    }
}

fn short_frame(flags: u8, body: &[u8]) -> Vec<u8> {
    assert!(body.len() < 256);
    frame(flags, body)
}

fn ready_sub() -> Vec<u8> {
    short_frame(0x04, b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB")
}

/// An honest subscriber (the fuzzer's `kv-events` target uses the same one).
struct Subscriber(kv_events::Subscriber);

impl Subscriber {
    fn connect(addr: SocketAddr, topic: &[u8]) -> Self {
        Self(kv_events::Subscriber::connect(addr, topic).expect("a subscriber connects"))
    }

    fn message(&mut self) -> Vec<Vec<u8>> {
        self.0.message().expect("a message")
    }
}

/// Sends `seq`s from `first` until the subscriber has one (its subscription raced the
/// first sends), then the rest; checks it receives every one after that in order.
fn publish_and_receive(p: &Publisher, sub: &mut Subscriber, topic: &[u8], n: u64) {
    let payload = vec![0xAB; 300];
    let mut seq = 0;
    // The subscription travels after the handshake: publish until the first one lands.
    let first = loop {
        p.send(topic, seq, &payload);
        seq += 1;
        sub.0
            .stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut peek = [0u8; 1];
        if sub.0.stream.peek(&mut peek).is_ok() {
            sub.0.stream.set_read_timeout(Some(5 * SECOND)).unwrap();
            let m = sub.message();
            break u64::from_be_bytes(m[1].clone().try_into().unwrap());
        }
        assert!(seq < 200, "the subscriber never received a message");
    };
    let end = seq + n;
    while seq < end {
        p.send(topic, seq, &payload);
        seq += 1;
    }
    for want in first + 1..end {
        let m = sub.message();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0], topic);
        assert_eq!(u64::from_be_bytes(m[1].clone().try_into().unwrap()), want);
        assert_eq!(m[2], payload);
    }
}

/// True once the server has closed `stream` (end of file or a reset), within `within`.
fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
        if start.elapsed() > within {
            return false;
        }
    }
}

#[test]
fn a_frame_declaring_2_pow_62_bytes_closes_that_peer_and_publishing_goes_on() {
    let p = Publisher::start(limits());
    // The 73 bytes that aborted `strata serve`: a greeting and a long-frame header.
    let mut hostile = TcpStream::connect(p.addr()).unwrap();
    let mut packet = greeting();
    packet.push(0x06); // command, long
    packet.extend_from_slice(&(1u64 << 62).to_be_bytes());
    assert_eq!(packet.len(), 73);
    hostile.write_all(&packet).unwrap();
    assert!(closed_within(&mut hostile, 3 * SECOND));
    // The same after a complete handshake, as a data frame.
    let mut hostile = TcpStream::connect(p.addr()).unwrap();
    hostile.write_all(&greeting()).unwrap();
    hostile.write_all(&ready_sub()).unwrap();
    hostile.write_all(&[0x02]).unwrap();
    hostile.write_all(&(u64::MAX >> 2).to_be_bytes()).unwrap();
    assert!(closed_within(&mut hostile, 3 * SECOND));
    p.wait_stat(
        "disconnected",
        |s| s.disconnected.load(Ordering::Relaxed),
        2,
    );
    let mut sub = Subscriber::connect(p.addr(), b"kv");
    publish_and_receive(&p, &mut sub, b"kv", 100);
}

#[test]
fn silent_peers_are_closed_after_the_handshake_timeout_and_never_keep_a_subscriber_out() {
    let l = limits();
    let p = Publisher::start(l);
    // Far more silent connections than the cap: the process's descriptors stay bounded
    // (the extra ones are closed as they come) and each silent one goes within the
    // handshake timeout.
    let mut silent: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(p.addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    assert!(p.stat(|s| s.connected.load(Ordering::Relaxed)) <= l.max_peers as u64);
    // An honest subscriber connects while they hold every slot, and gets its messages.
    let mut sub = Subscriber::connect(p.addr(), b"");
    publish_and_receive(&p, &mut sub, b"any topic", 50);
    let start = Instant::now();
    for s in &mut silent {
        assert!(closed_within(s, 3 * SECOND), "a silent peer stayed open");
    }
    assert!(start.elapsed() < l.handshake_timeout + 2 * SECOND);
    p.wait_connected(1);
    // The subscriber is still served after the crowd left.
    publish_and_receive(&p, &mut sub, b"any topic", 50);
}

#[test]
fn subscribed_peers_at_the_cap_refuse_one_more_at_once() {
    let l = limits();
    let p = Publisher::start(l);
    let mut subs: Vec<Subscriber> = (0..l.max_peers)
        .map(|_| Subscriber::connect(p.addr(), b"t"))
        .collect();
    let mut extra = TcpStream::connect(p.addr()).unwrap();
    assert!(closed_within(&mut extra, 3 * SECOND));
    assert_eq!(p.stat(|s| s.refused.load(Ordering::Relaxed)), 1);
    for sub in &mut subs {
        publish_and_receive(&p, sub, b"t", 5);
    }
}

#[test]
fn subscription_floods_end_the_flooding_peer_only() {
    let p = Publisher::start(limits());
    let mut honest = Subscriber::connect(p.addr(), b"kv");
    // 1 MiB subscriptions: refused from the frame header (4 KiB cap).
    let mut big = TcpStream::connect(p.addr()).unwrap();
    big.write_all(&greeting()).unwrap();
    big.write_all(&ready_sub()).unwrap();
    let mut frame = vec![0x02];
    frame.extend_from_slice(&((1u64 << 20) + 1).to_be_bytes());
    frame.push(1);
    frame.extend(vec![b'x'; 1 << 20]);
    let _ = big.write_all(&frame);
    assert!(closed_within(&mut big, 3 * SECOND));
    // Many small distinct ones: refused past the per-peer count.
    let mut many = TcpStream::connect(p.addr()).unwrap();
    many.write_all(&greeting()).unwrap();
    many.write_all(&ready_sub()).unwrap();
    for i in 0..1000u32 {
        let mut sub = vec![1u8];
        sub.extend_from_slice(format!("prefix-{i}").as_bytes());
        if many.write_all(&short_frame(0, &sub)).is_err() {
            break;
        }
    }
    assert!(closed_within(&mut many, 3 * SECOND));
    publish_and_receive(&p, &mut honest, b"kv", 100);
}

#[test]
fn a_subscriber_that_never_reads_misses_messages_then_is_closed_while_others_get_all() {
    let l = limits();
    let p = Publisher::start(l);
    let stuck = Subscriber::connect(p.addr(), b"");
    let mut honest = Subscriber::connect(p.addr(), b"");
    publish_and_receive(&p, &mut honest, b"kv", 10);
    // Big messages fill the stuck peer's socket buffers; it reads nothing from here on.
    let payload = vec![7u8; 256 << 10];
    let reader = std::thread::spawn(move || {
        let mut got = 0u64;
        loop {
            let m = honest.message();
            got += 1;
            if m[2].len() == 1 {
                return (honest, got);
            }
        }
    });
    let sent = 200u64;
    for seq in 0..sent {
        p.send(b"kv", seq, &payload);
        // Paced below the honest reader's speed: only the stuck peer falls behind.
        std::thread::sleep(Duration::from_millis(2));
    }
    p.send(b"kv", sent, b"!");
    let (mut honest, got) = reader.join().unwrap();
    assert_eq!(got, sent + 1, "the honest subscriber missed messages");
    p.wait_stat("missed", |s| s.missed.load(Ordering::Relaxed), 1);
    p.wait_stat(
        "disconnected (stalled)",
        |s| s.disconnected.load(Ordering::Relaxed),
        1,
    );
    // Its connection is gone from the server's side.
    p.wait_connected(1);
    drop(stuck);
    publish_and_receive(&p, &mut honest, b"kv", 10);
}

/// Publishes `[topic, seq, "x"]` every 10 ms on its own task until the socket closes.
fn keep_publishing(rt: &tokio::runtime::Runtime, socket: &std::sync::Arc<PubSocket>) {
    let socket = std::sync::Arc::clone(socket);
    rt.spawn(async move {
        for seq in 0u64.. {
            socket.send(&[b"t", &seq.to_be_bytes(), b"x"]);
            tokio::time::sleep(Duration::from_millis(10)).await;
            if std::sync::Arc::strong_count(&socket) == 1 {
                return;
            }
        }
    });
}

/// Three messages in order, on topic `t`.
fn receives_in_order<S: Read + Write + kv_events::ReadTimeout>(sub: &mut kv_events::Subscriber<S>) {
    let seqs: Vec<u64> = (0..3)
        .map(|_| {
            let m = sub.message().expect("a message");
            assert_eq!((m.len(), &m[0][..], &m[2][..]), (3, &b"t"[..], &b"x"[..]));
            u64::from_be_bytes(m[1].clone().try_into().unwrap())
        })
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
}

#[test]
fn an_ipc_socket_serves_subscribers_and_replaces_only_a_stale_socket_file() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = std::env::temp_dir().join(format!("strata-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("events.sock");
    let _ = std::fs::remove_file(&path);
    // A stale socket file (a previous server's) is replaced, as libzmq does.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let socket = std::sync::Arc::new(
        rt.block_on(PubSocket::bind(&Address::Ipc(path.clone()), limits()))
            .expect("binds over a stale socket file"),
    );
    keep_publishing(&rt, &socket);
    let stream = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let mut sub = kv_events::Subscriber::over(stream, b"t").unwrap();
    receives_in_order(&mut sub);
    // Anything else at the path is refused, never removed.
    let file = dir.join("not-a-socket");
    std::fs::write(&file, b"data").unwrap();
    let err = rt
        .block_on(PubSocket::bind(&Address::Ipc(file.clone()), limits()))
        .err()
        .expect("a regular file is refused");
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
    drop(socket);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_connecting_socket_dials_the_subscriber_and_dials_again_after_it_leaves() {
    // vLLM's PUB connects to an endpoint naming one host: the subscriber binds there.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let socket = std::sync::Arc::new({
        let _guard = rt.enter();
        PubSocket::connect(Address::Tcp(addr.to_string()), limits())
    });
    keep_publishing(&rt, &socket);
    for _ in 0..2 {
        let (stream, _) = listener.accept().unwrap();
        let mut sub = kv_events::Subscriber::over(stream, b"t").unwrap();
        receives_in_order(&mut sub);
        drop(sub); // the subscriber leaves: the socket dials again
    }
    assert_eq!(socket.local_addr, None);
}
