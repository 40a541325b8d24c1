//! A `strata serve` child process on 127.0.0.1 with an ephemeral port, and a raw HTTP/1.1
//! client over std's TcpStream (no client library, so malformed requests can be sent).
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    /// `127.0.0.1:PORT`
    pub addr: String,
    pub model_name: String,
}

/// Small KV pools: fast to allocate, still room for 16 short requests at once.
pub const BASE_ARGS: &[&str] = &[
    "--port",
    "0",
    "--max-model-len",
    "1024",
    "--num-gpu-blocks",
    "256",
    "--max-cpu-offload-blocks",
    "256",
];

impl Server {
    /// Starts `strata serve` on `model` and waits until /health answers 200.
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        // BASE_ARGS, except the flags `extra` sets itself.
        let base: Vec<&str> = BASE_ARGS
            .chunks(2)
            .filter(|kv| !extra.contains(&kv[0]))
            .flatten()
            .copied()
            .collect();
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(base)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning strata serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // "strata serve: listening on http://127.0.0.1:PORT (model `NAME`)"
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        let model_name = line
            .split('`')
            .nth(1)
            .unwrap_or_else(|| panic!("no model name in {line:?}"))
            .to_string();
        let server = Server {
            child,
            addr,
            model_name,
        };
        let t = Instant::now();
        loop {
            let r = server.get("/health");
            if r.status == 200 {
                break;
            }
            assert_eq!(r.status, 503, "health while loading: {r:?}");
            assert!(t.elapsed() < Duration::from_secs(120), "server never ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s
    }

    /// Connections the server process holds: entries of Linux's `/proc/net/tcp` on the
    /// server's port, other than the listener, that have an inode. A connection still in
    /// the accept queue has none, nor one the server has closed; one the client closed
    /// first keeps it (CLOSE_WAIT) until the server lets it go, and with it its slot
    /// under `--max-connections`. `None` where that file is not readable.
    pub fn held_connections(&self) -> Option<usize> {
        let port = self.addr.rsplit(':').next()?.parse::<u16>().ok()?;
        let local = format!(":{port:04X}");
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        let held = |line: &&str| {
            let f: Vec<&str> = line.split_whitespace().collect();
            const LISTEN: &str = "0A";
            f.len() > 9 && f[1].ends_with(&local) && f[3] != LISTEN && f[9] != "0"
        };
        Some(table.lines().skip(1).filter(held).count())
    }

    /// Waits until the server holds exactly `n` connections (`held_connections`), for at
    /// most 10 s: a test that fills the connection cap must neither race the accept loop
    /// nor a connection of its own that the server has not let go yet (fixed sleeps did,
    /// on a loaded machine). Without `/proc`, a second.
    pub fn wait_held(&self, n: usize) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            match self.held_connections() {
                None => return std::thread::sleep(Duration::from_secs(1)),
                Some(now) if now == n => return,
                Some(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Sends raw request bytes and reads the whole response (the server closes after it).
    pub fn raw(&self, request: &[u8]) -> HttpResponse {
        let mut s = self.connect();
        let head = String::from_utf8_lossy(&request[..request.len().min(200)]).into_owned();
        // The server may answer (413) and close before reading a huge body to its end.
        let _ = s.write_all(request);
        let mut buf = Vec::new();
        if let Err(e) = s.read_to_end(&mut buf) {
            panic!(
                "no complete answer to {head:?}: {e} (got {:?})",
                String::from_utf8_lossy(&buf)
            );
        }
        HttpResponse::parse(&buf)
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HttpResponse {
        self.raw(&request_bytes(method, path, headers, body))
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        self.request("GET", path, &[], b"")
    }

    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        self.request("POST", path, &[], body.to_string().as_bytes())
    }

    /// Unlabelled and labelled samples of /metrics, by their full name (`name{labels}`).
    pub fn metrics(&self) -> HashMap<String, f64> {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200);
        r.text()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// The full sample name of a vLLM-named metric of this server (`metrics()`'s key):
    /// `name{model_name="…",engine="0"}`.
    pub fn vllm(&self, name: &str) -> String {
        format!("{name}{{model_name=\"{}\",engine=\"0\"}}", self.model_name)
    }

    /// Runs tests/openai_client.py (the official `openai` client) with `python` against
    /// this server, `model_path` being the model it serves (the script compares with
    /// `strata generate` on it); `checks`: the script's `--checks` (all when `None`).
    /// Fails the test with the script's output unless it succeeds.
    pub fn run_openai_client(&self, python: &str, model_path: &Path, checks: Option<&str>) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .args(["--base-url", &format!("http://{}/v1", self.addr)])
            .args(["--model", &self.model_name])
            .args(["--strata", env!("CARGO_BIN_EXE_strata")])
            .arg("--model-path")
            .arg(model_path);
        if let Some(checks) = checks {
            cmd.args(["--checks", checks]);
        }
        let out = cmd.output().expect("running python3");
        assert!(
            out.status.success(),
            "openai_client.py failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit, at most `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t.elapsed() < limit, "server did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    if !body.is_empty() || method == "POST" {
        req += &format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    req += "\r\n";
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn parse(buf: &[u8]) -> Self {
        let split = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(buf)));
        let head = String::from_utf8_lossy(&buf[..split]).into_owned();
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .expect("status line");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let raw = &buf[split + 4..];
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked { dechunk(raw) } else { raw.to_vec() };
        Self {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim().to_string())
            .collect()
    }

    /// Asserts an OpenAI-style error object with this status; returns its message.
    pub fn expect_error(&self, status: u16) -> String {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        let e = &v["error"];
        assert!(e["type"].is_string(), "no error type: {v}");
        e["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {v}"))
            .to_string()
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&raw[..eol])
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        let end = (start + size).min(raw.len());
        out.extend_from_slice(&raw[start..end]);
        raw = &raw[(end + 2).min(raw.len())..];
    }
}
