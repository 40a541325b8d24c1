"""NVIDIA Dynamo in front of two strata workers (integrations/dynamo), on one machine.

Run by tests/dynamo_e2e.rs:
    python3 tests/dynamo_e2e.py --strata BIN --model PATH

Two `python -m strata_dynamo` workers (each starting its own `strata serve`) register with
Dynamo's file discovery; two frontends route to them, one with the KV router (fed by
strata's own KV-cache events), one round-robin. For each router, distinct long prefixes
get three requests each (the first ones at once, the follow-ups one by one), and each
follow-up is attributed by the strata instances' own counters: the one whose
`vllm:prompt_tokens` grew by the prompt served it, and its `vllm:prefix_cache_hits` say
whether it had the prefix cached. A client that disconnects mid-stream must be cancelled
in strata. Then, with streams in flight, one worker is killed
(SIGKILL): every stream must end cleanly (finished, or an error event), the other
worker must go on serving, and the killed worker's strata must exit by itself.

Prints `RESULT {json}` with the measured numbers; exits 0 when every check passes, 1
otherwise, 3 when Dynamo is not installed.
"""

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

try:
    import dynamo.common.backend  # noqa: F401
    import dynamo.frontend  # noqa: F401
except ImportError as e:
    print(f"dynamo_e2e.py: Dynamo is not installed ({e}); see docs/distributed.md")
    sys.exit(3)

FAILURES = []
PREFIXES_PER_PHASE = 4
FOLLOW_UPS = 2
MAX_TOKENS = 8


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)
    return cond


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_below_32768():
    """A free port Dynamo's DYN_SYSTEM_PORT accepts (it parses the port as an i16)."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def http_json(url, body=None, timeout=120):
    """(status, parsed JSON or text) of a GET, or of a POST when `body` is given."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, parse(r.read())
    except urllib.error.HTTPError as e:
        return e.code, parse(e.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return None, str(e)


def parse(raw):
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def prefix_text(topic, k):
    """About 300 tokens about `topic`, distinct from every other prefix from its start."""
    words = topic.split()
    sentences = [
        f"{topic.capitalize()} note {i}: the {words[i % len(words)]} matters for reason {k * 31 + i}."
        for i in range(24)
    ]
    return f"[{topic}] " + " ".join(sentences)


class Cluster:
    """Two strata workers and two frontends (KV router, round-robin) sharing one discovery."""

    def __init__(self, args, workdir):
        self.args = args
        self.workdir = workdir
        self.procs = []  # (name, Popen, log path)
        self.env = dict(os.environ)
        self.env.update(
            DYN_FILE_KV=str(workdir / "discovery"),
            DYN_EVENT_PLANE="zmq",
            DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_EVENT_PLANE_HOST="127.0.0.1",
            DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            PYTHONPATH=os.pathsep.join(
                [args.integration] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            ),
        )
        self.strata_ports = [free_port(), free_port()]
        # Each worker's Dynamo system server (its dynamo_component_* gauges).
        self.system_ports = [free_port_below_32768(), free_port_below_32768()]
        self.frontends = {"kv": free_port(), "round-robin": free_port()}

    def spawn(self, name, cmd, env=None):
        log = self.workdir / f"{name}.log"
        p = subprocess.Popen(
            cmd,
            env={**self.env, **(env or {})},
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a worker dies with its strata
        )
        self.procs.append((name, p, log))
        return p

    def start(self):
        py = sys.executable
        self.workers = []
        for i, port in enumerate(self.strata_ports):
            strata_args = [
                "--model", self.args.model, "--port", str(port), "--max-model-len", "1024",
                "--num-gpu-blocks", "256", "--max-cpu-offload-blocks", "0",
            ]
            self.workers.append(self.spawn(f"worker{i}", [
                py, "-m", "strata_dynamo", "--strata-bin", self.args.strata,
                "--strata-args", shlex.join(strata_args),
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                "--model-card-dir", str(self.workdir / "card"),
            ], env={"DYN_SYSTEM_PORT": str(self.system_ports[i])}))
        for mode, port in self.frontends.items():
            self.spawn(f"frontend-{mode}", [
                py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                "--discovery-backend", "file", "--request-plane", "tcp", "--router-mode", mode,
            ])

    def wait_ready(self, timeout=240):
        """Both stratas healthy; both frontends list the model and see two workers."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p, _ in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with status {p.returncode} while starting")
            ready = all(
                http_json(f"http://127.0.0.1:{p}/health", timeout=5)[0] == 200
                for p in self.strata_ports
            )
            for port in self.frontends.values():
                status, health = http_json(f"http://127.0.0.1:{port}/health", timeout=5)
                generate = [
                    i for i in (health.get("instances", []) if status == 200 else [])
                    if i.get("endpoint") == "generate"
                ]
                status, models = http_json(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                listed = status == 200 and len(models.get("data", [])) == 1
                ready = ready and len(generate) == 2 and listed
            if ready:
                self.model = models["data"][0]["id"]
                return
            time.sleep(0.5)
        raise RuntimeError("the cluster did not become ready")

    def metrics(self, i):
        """(prompt tokens, prefix-cache hit tokens) of strata instance `i`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.strata_ports[i]}/metrics", timeout=10) as r:
            text = r.read().decode()
        got = {}
        for line in text.splitlines():
            for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"):
                if line.startswith(name + "{"):
                    got[name] = float(line.rsplit(" ", 1)[1])
        return got["vllm:prompt_tokens_total"], got["vllm:prefix_cache_hits_total"]

    def component_gauges(self, i):
        """Worker `i`'s dynamo_component_* gauges (what its load snapshots set), by name."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.system_ports[i]}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return {}
        got = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.startswith("dynamo_component_") and not line.startswith("#"):
                got[name] = float(line.rsplit(" ", 1)[1])
        return got

    def complete(self, router, prompt, **kw):
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, **kw}
        return http_json(f"http://127.0.0.1:{self.frontends[router]}/v1/completions", body)

    def stop(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 20
        for _, p, _ in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def print_logs(self):
        for name, _, log in self.procs:
            lines = log.read_text(errors="replace").splitlines()
            print(f"---- {name} (last 25 lines of {log}) ----")
            print("\n".join(lines[-25:]))


def routing_phase(c, router, topics):
    """First requests of every prefix at once, then the follow-ups one by one; returns
    [(prefix, follow-up, served by, hit tokens)] and the texts of the first requests."""
    prefixes = [prefix_text(t, k) for k, t in enumerate(topics)]
    firsts = [None] * len(prefixes)

    def first(k):
        firsts[k] = c.complete(router, prefixes[k] + " Question 0: what is the main point?")

    threads = [threading.Thread(target=first, args=(k,)) for k in range(len(prefixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, (status, body) in enumerate(firsts):
        check(status == 200, f"{router}: first request of prefix {k}: {status} {body}")
    rows = []
    for k, p in enumerate(prefixes):
        for j in range(1, FOLLOW_UPS + 1):
            before = [c.metrics(i) for i in range(2)]
            status, body = c.complete(router, p + f" Question {j}: what is point {j}?")
            after = [c.metrics(i) for i in range(2)]
            if not check(status == 200, f"{router}: prefix {k} follow-up {j}: {status} {body}"):
                continue
            n = body["usage"]["prompt_tokens"]
            served = [i for i in range(2) if after[i][0] - before[i][0] == n]
            check(len(served) == 1, f"{router}: prefix {k} follow-up {j} served by {served}")
            if served:
                i = served[0]
                rows.append((k, j, i, after[i][1] - before[i][1]))
    return rows, prefixes, firsts


def summarize(rows):
    hits = sum(1 for r in rows if r[3] > 0)
    return hits, len(rows)


def cancel_phase(c):
    """A client that goes away mid-stream: Dynamo cancels the request, the worker closes
    its stream to strata, and strata cancels it (its own counter says so). Returns the
    seconds that took."""
    def cancelled():
        total = 0.0
        for port in c.strata_ports:
            _, text = http_json(f"http://127.0.0.1:{port}/metrics", timeout=10)
            for line in text.splitlines():
                if line.startswith("strata:num_requests_cancelled_total "):
                    total += float(line.split()[1])
        return total

    before = cancelled()
    conn = http.client.HTTPConnection("127.0.0.1", c.frontends["kv"], timeout=60)
    body = {"model": c.model, "prompt": prefix_text("abandoned letters", 77),
            "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    check(r.status == 200, f"cancel: HTTP {r.status}")
    for raw in r:
        if raw.startswith(b"data:"):
            break
    t = time.time()
    conn.sock.close()  # the client goes away
    conn.close()
    while time.time() - t < 20:
        if cancelled() > before:
            return round(time.time() - t, 2)
        time.sleep(0.2)
    check(False, "a disconnected client's request was not cancelled in strata within 20 s")
    return None


def kill_phase(c):
    """Streams in flight; worker 1's process is killed. Returns each stream's outcome."""
    port = c.frontends["kv"]
    outcomes = {}
    started = threading.Event()

    def stream(k):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
        body = {"model": c.model, "prompt": prefix_text(f"survival story {k}", 100 + k),
                "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                text = r.read().decode(errors="replace")
                clean = text.startswith("{") and "message" in text
                outcomes[k] = ("error" if clean else "dirty", f"HTTP {r.status} {text[:200]}")
                return
            finished, error, done = False, None, False
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                elif event.get("choices"):
                    started.set()
                    finished |= event["choices"][0].get("finish_reason") is not None
            if done and finished:
                outcomes[k] = ("ok", "")
            elif done and error:
                outcomes[k] = ("error", str(error)[:200])
            else:
                outcomes[k] = ("dirty", f"stream ended: done={done} finished={finished}")
        except Exception as e:  # a reset connection or a timeout is not a clean end
            outcomes[k] = ("dirty", repr(e))

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    started.wait(30)
    time.sleep(0.5)
    # The worker process dies (SIGKILL: no cleanup); its strata must follow by itself.
    victim = c.workers[1]
    victim.kill()
    victim.wait()
    for t in threads:
        t.join(120)
    check(all(not t.is_alive() for t in threads), "a stream hung after the kill")
    return outcomes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--integration", required=True, help="integrations/dynamo")
    args = ap.parse_args()
    t0 = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="strata-dynamo-e2e-"))
    c = Cluster(args, workdir)
    result = {}
    try:
        c.start()
        c.wait_ready()
        result["startup_s"] = round(time.time() - t0, 1)

        kv_rows, kv_prefixes, kv_firsts = routing_phase(
            c, "kv", ["volcanoes", "honey bees", "roman roads", "sourdough bread"][:PREFIXES_PER_PHASE])
        rr_rows, _, _ = routing_phase(
            c, "round-robin", ["glaciers", "ant colonies", "medieval castles", "rice farming"][:PREFIXES_PER_PHASE])
        kv_hits, kv_n = summarize(kv_rows)
        rr_hits, rr_n = summarize(rr_rows)
        result.update(kv_follow_ups_on_caching_worker=f"{kv_hits}/{kv_n}",
                      round_robin_follow_ups_on_caching_worker=f"{rr_hits}/{rr_n}",
                      kv_rows=kv_rows, round_robin_rows=rr_rows)
        check(kv_n == PREFIXES_PER_PHASE * FOLLOW_UPS, f"kv: {kv_n} follow-ups attributed")
        check(kv_n and kv_hits / kv_n >= 0.9,
              f"kv router: only {kv_hits}/{kv_n} follow-ups on the worker caching their prefix")
        for k in range(PREFIXES_PER_PHASE):
            workers = {r[2] for r in kv_rows if r[0] == k}
            check(len(workers) == 1, f"kv: prefix {k}'s follow-ups went to workers {workers}")
        check(rr_n and rr_hits / rr_n <= kv_hits / max(kv_n, 1) - 0.25,
              f"round-robin: {rr_hits}/{rr_n} hits, not clearly fewer than kv {kv_hits}/{kv_n}")

        # Each worker's load reaches Dynamo (the adapter's snapshots from strata's /metrics):
        # its KV capacity, and the prefix-cache hit rate the follow-ups made.
        gauges = [c.component_gauges(i) for i in range(2)]
        result["component_gauges"] = gauges
        for i, g in enumerate(gauges):
            check(g.get("dynamo_component_total_blocks") == 256,
                  f"worker {i}: dynamo_component_total_blocks {g.get('dynamo_component_total_blocks')}, want 256")
        check(any(g.get("dynamo_component_kv_cache_hit_rate", 0) > 0 for g in gauges),
              f"no worker reported a prefix-cache hit rate: {gauges}")

        # Greedy text through Dynamo equals `strata generate` on the same prompt.
        prompt = kv_prefixes[0] + " Question 0: what is the main point?"
        ref = subprocess.run(
            [args.strata, "generate", "--model", args.model, "--prompt", prompt,
             "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"],
            capture_output=True, text=True, check=True)
        ref = json.loads(ref.stdout)
        status, body = kv_firsts[0]
        if status == 200:
            text = body["choices"][0]["text"]
            check(text == ref["text"], f"Dynamo's greedy text {text!r} != strata generate {ref['text']!r}")
            check(body["usage"]["prompt_tokens"] == ref["prompt_tokens"],
                  f"Dynamo tokenized {body['usage']['prompt_tokens']} tokens, strata {ref['prompt_tokens']}")
        result["greedy_text_equal"] = not any("greedy" in f for f in FAILURES)

        result["cancelled_in_strata_after_s"] = cancel_phase(c)

        outcomes = kill_phase(c)
        result["kill_outcomes"] = outcomes
        for k, (kind, detail) in outcomes.items():
            check(kind in ("ok", "error"), f"stream {k} did not end cleanly after the kill: {detail}")
        # The survivor serves; requests routed to the dead worker before Dynamo dropped it
        # must fail cleanly (an OpenAI-style error object), never hang.
        served, failed, failures = 0, 0, []
        deadline = time.time() + 60
        while served < 4 and time.time() < deadline:
            before = c.metrics(0)[0]
            status, body = c.complete("kv", f"After the failure, request {served + failed}: hello")
            if status == 200:
                check(c.metrics(0)[0] > before, "a request after the kill was not served by the survivor")
                served += 1
            else:
                check(isinstance(body, dict) and ("error" in body or "message" in body),
                      f"a failed request after the kill got no error object: {status} {body}")
                failed += 1
                failures.append(status)
                time.sleep(0.5)
        result["after_kill"] = {"served": served, "failed_first": failures}
        check(served == 4, f"the surviving worker served {served} of 4 requests after the kill")
        check(failed <= 3, f"{failed} requests failed after the kill before the survivor took over")
        # The killed worker's strata followed it (prctl PDEATHSIG), not left serving.
        gone = False
        for _ in range(60):
            if http_json(f"http://127.0.0.1:{c.strata_ports[1]}/health", timeout=2)[0] is None:
                gone = True
                break
            time.sleep(0.5)
        check(gone, "the killed worker's strata serve is still running")
    except Exception as e:
        check(False, f"{type(e).__name__}: {e}")
    finally:
        result["seconds"] = round(time.time() - t0, 1)
        c.stop()
        if FAILURES:
            c.print_logs()
    print("RESULT " + json.dumps(result), flush=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
