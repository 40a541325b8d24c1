"""NVIDIA Dynamo in front of strata workers (integrations/dynamo), on one machine.

Run by tests/dynamo_e2e.rs:
    python3 tests/dynamo_e2e.py --strata BIN --model PATH --integration integrations/dynamo

Two `python -m strata_dynamo` workers (each starting its own `strata serve`) register with
Dynamo's file discovery; two frontends route to them, one with the KV router (fed by
strata's own KV-cache events), one round-robin, both with `--migration-limit 3`. Checked:

- Routing: distinct prefixes get three requests each; each follow-up is attributed by
  the strata instances' own counters (`vllm:prompt_tokens`, `vllm:prefix_cache_hits`).
- The operator's workload (issue 60): 10 documents of 600–1,500 tokens, each asked one
  question and four follow-ups by one client session, four sessions at a time, behind
  each router. The KV router must put >= 90% of follow-ups on the worker that served
  their document first (Dynamo's `nvext.worker_id` says which), give no worker more than
  65% of the requests, and beat round-robin's follow-up time to first token (p90) by 2x.
- Load snapshots reach Dynamo; greedy text equals `strata generate`; a client that
  disconnects is cancelled in strata.
- Faults: a third worker, attached to its own strata, answers Dynamo's health canaries;
  once that strata hangs (SIGSTOP) the worker leaves the pool within 8 s and exits. A
  worker process killed (SIGKILL) under load, then (after a replacement registers) a
  strata killed under load: every stream ends cleanly, no request fails later than 3 s
  after the kill, the survivor serves, and the other half of the killed worker exits.

Prints `RESULT {json}` with the measured numbers; exits 0 when every check passes, 1
otherwise, 3 when Dynamo is not installed. The working directory (logs, discovery) is
removed when every check passes and kept, with its path printed, when one fails.
"""

import argparse
import http.client
import json
import os
import random
import shlex
import shutil
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
# Each worker's KV pool (16-token blocks): a worker's share of the workload's documents
# stays cached, as on a GPU sized for its traffic.
GPU_BLOCKS = 1024


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


def strata_pid(port):
    """The pid of the `strata serve` listening on `port` (its command line names it)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and str(port).encode() in argv:
            return int(proc.name)
    raise RuntimeError(f"no strata serve on port {port}")


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


# The operator's workload (issue 60): documents of ~600–1,500 tokens, each asked one
# question and then four follow-ups by one client session, four sessions at a time.
WORKLOAD_DOCS = 10
WORKLOAD_FOLLOW_UPS = 4
WORKLOAD_CLIENTS = 4
WORKLOAD_MAX_TOKENS = 16
# Words that are one token each with a leading space in SmolLM2's tokenizer, so a
# document's length in tokens is known without tokenizing it.
WORDS = (
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face level office door health person art war history "
    "party result change morning reason research girl moment air teacher force education"
).split()


def document(seed):
    """A document of 600–1,500 tokens (its first words are its own): sentences of 6–14
    words, each its length plus one token (the period) or two (a capitalised word that splits)."""
    rng = random.Random(seed)
    target = rng.randint(610, 1430)
    sentences, tokens = [], 4
    while tokens < target:
        k = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        tokens += k + 1
    return f"Document {seed}. " + " ".join(sentences)


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

    def spawn_worker(self, i, name):
        strata_args = [
            "--model", self.args.model, "--port", str(self.strata_ports[i]),
            "--max-model-len", "2048", "--num-gpu-blocks", str(GPU_BLOCKS),
            "--max-cpu-offload-blocks", "0",
        ]
        return self.spawn(name, [
            sys.executable, "-m", "strata_dynamo", "--strata-bin", self.args.strata,
            "--strata-args", shlex.join(strata_args),
            "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
            "--model-card-dir", str(self.workdir / "card"),
        ], env={"DYN_SYSTEM_PORT": str(self.system_ports[i])})

    def start(self):
        self.workers = [self.spawn_worker(i, f"worker{i}") for i in range(2)]
        self.frontend_procs = []
        for mode, port in self.frontends.items():
            self.frontend_procs.append(self.spawn(f"frontend-{mode}", [
                sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                "--discovery-backend", "file", "--request-plane", "tcp", "--router-mode", mode,
                "--migration-limit", "3",
            ]))

    def replace_worker(self, i):
        """A fresh worker (and strata) in slot `i`, on new ports, after the old one died."""
        self.strata_ports[i] = free_port()
        self.system_ports[i] = free_port_below_32768()
        self.workers[i] = self.spawn_worker(i, f"worker{i}-replacement")

    def wait_instances(self, n, timeout):
        """True once both frontends list exactly `n` generate instances."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            counts = []
            for port in self.frontends.values():
                status, health = http_json(f"http://127.0.0.1:{port}/health", timeout=5)
                counts.append(sum(1 for i in (health.get("instances", []) if status == 200 else [])
                                  if i.get("endpoint") == "generate"))
            if all(k == n for k in counts):
                return True
            time.sleep(0.1)
        return False

    def wait_ready(self, timeout=240):
        """Both stratas healthy; both frontends list the model and see two workers."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.workers + self.frontend_procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[:3]} exited with status {p.returncode} while starting")
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
                self.instances = generate
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


def timed_stream(port, model, prompt, max_tokens, timeout=120):
    """One streamed greedy completion through a frontend: (HTTP status, seconds to the
    first token, the Dynamo worker that decoded it, prompt tokens, error text or None)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id"]}}
    t0 = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    ttft, worker, prompt_tokens = None, None, None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, None, None, None, r.read().decode(errors="replace")[:300]
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return r.status, ttft, worker, prompt_tokens, str(event["error"])[:300]
            if event.get("choices") and ttft is None:
                ttft = time.time() - t0
            ids = (event.get("nvext") or {}).get("worker_id") or {}
            worker = ids.get("decode_worker_id", worker)
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
        return 200, ttft, worker, prompt_tokens, None
    except (OSError, http.client.HTTPException, ValueError) as e:
        return None, ttft, worker, prompt_tokens, repr(e)
    finally:
        conn.close()


def p90(values):
    """The nearest-rank 90th percentile."""
    v = sorted(values)
    return v[max(0, -(-9 * len(v) // 10) - 1)] if v else None


def workload_phase(c, router, seed):
    """WORKLOAD_CLIENTS sessions at a time, each taking the next document: one question,
    then the follow-ups in turn. Returns the rows [(doc, turn, worker, ttft, prompt
    tokens)] and the prefix-cache hit tokens the two stratas counted meanwhile."""
    docs = [document(seed + k) for k in range(WORKLOAD_DOCS)]
    todo = list(range(WORKLOAD_DOCS))
    lock = threading.Lock()
    rows = []
    hits_before = sum(c.metrics(i)[1] for i in range(2))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                k = todo.pop(0)
            for turn in range(WORKLOAD_FOLLOW_UPS + 1):
                prompt = f"{docs[k]}\n\nQuestion {turn}: what does the document say about " \
                         f"{WORDS[(k * 7 + turn) % len(WORDS)]}?\nAnswer:"
                status, ttft, worker, n, error = timed_stream(
                    c.frontends[router], c.model, prompt, WORKLOAD_MAX_TOKENS)
                if check(status == 200 and error is None and worker is not None,
                         f"{router}: document {k} turn {turn}: {status} {error}"):
                    with lock:
                        rows.append((k, turn, worker, ttft, n))

    threads = [threading.Thread(target=client) for _ in range(WORKLOAD_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hits = sum(c.metrics(i)[1] for i in range(2)) - hits_before
    return rows, hits


def workload_summary(rows):
    """Follow-ups on the worker that served their document's first question, the
    busiest worker's share of all requests, and the follow-ups' TTFT p90."""
    holder = {k: w for k, turn, w, _, _ in rows if turn == 0}
    follow = [r for r in rows if r[1] > 0]
    on_holder = sum(1 for k, _, w, _, _ in follow if holder.get(k) == w)
    per_worker = {}
    for r in rows:
        per_worker[r[2]] = per_worker.get(r[2], 0) + 1
    return {
        "follow_ups_on_holder": f"{on_holder}/{len(follow)}",
        "on_holder_fraction": on_holder / max(len(follow), 1),
        "busiest_worker_share": max(per_worker.values(), default=0) / max(len(rows), 1),
        "follow_up_ttft_p90_s": p90([r[3] for r in follow]),
        "first_ttft_p90_s": p90([r[3] for r in rows if r[1] == 0]),
        "prompt_tokens": [r[4] for r in rows if r[1] == 0],
    }


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


KILL_STREAM_TOKENS = 48


def kill_stream_prompt(k):
    return prefix_text(f"survival story {k}", 100 + k)


def kill_phase(c, victim, barrage_s=10):
    """Streams in flight; `victim` (a process of worker 1) is killed by SIGKILL, and
    clients go on sending requests. Returns each stream's outcome, the barrage's answers
    (seconds after the kill, status, clean) and the Dynamo workers the streams began on."""
    port = c.frontends["kv"]
    outcomes = {}
    workers = {k: [] for k in range(4)}  # the Dynamo workers each stream came from, in order
    started = threading.Event()

    def stream(k):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
        body = {"model": c.model, "prompt": kill_stream_prompt(k),
                "max_tokens": KILL_STREAM_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True, "nvext": {"extra_fields": ["worker_id"]}}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                text = r.read().decode(errors="replace")
                clean = text.startswith("{") and "message" in text
                outcomes[k] = ("error" if clean else "dirty", f"HTTP {r.status} {text[:200]}")
                return
            finished, error, done, text = False, None, False, ""
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
                    text += event["choices"][0].get("text") or ""
                    ids = (event.get("nvext") or {}).get("worker_id") or {}
                    if ids.get("decode_worker_id") not in (None, *workers[k]):
                        workers[k].append(ids["decode_worker_id"])
                    finished |= event["choices"][0].get("finish_reason") is not None
            if done and finished:
                outcomes[k] = ("ok", text)
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
    os.kill(victim, signal.SIGKILL)  # no cleanup of any kind
    killed_at = time.time()
    answers = barrage(c, barrage_s, killed_at)
    for t in threads:
        t.join(120)
    check(all(not t.is_alive() for t in threads), "a stream hung after the kill")
    return outcomes, answers, {w[0] for w in workers.values() if w}


def hang_phase(c):
    """A third worker attached (--strata-url) to a strata started on its own; that strata
    is stopped (SIGSTOP: it hangs, its port still accepts). The worker must leave the
    pool by itself within its hang limit (5 s) and exit. Returns the seconds it took."""
    port = free_port()
    strata = subprocess.Popen(
        [c.args.strata, "serve", "--model", c.args.model, "--port", str(port),
         "--max-model-len", "2048", "--kv-events-endpoint", "tcp://127.0.0.1:0"],
        stdout=open(c.workdir / "strata-attached.log", "w"), stderr=subprocess.STDOUT)
    c.procs.append(("strata-attached", strata, c.workdir / "strata-attached.log"))
    try:
        worker = c.spawn("worker-attached", [
            sys.executable, "-m", "strata_dynamo", "--strata-url", f"http://127.0.0.1:{port}",
            "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
            "--model-card-dir", str(c.workdir / "card"),
        ], env={"DYN_SYSTEM_PORT": str(free_port_below_32768()),
                # Dynamo's canary: one greedy token after BOS through `generate` whenever
                # the worker has been idle this long (it is: no traffic goes here).
                "DYN_HEALTH_CHECK_ENABLED": "true", "DYN_CANARY_WAIT_TIME": "1"})
        if not check(c.wait_instances(3, 120), "hang: the attached worker never registered"):
            return None
        canaries = 0
        for _ in range(100):
            _, text = http_json(f"http://127.0.0.1:{port}/metrics", timeout=5)
            canaries = sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
                           if line.startswith("vllm:request_success_total{"))
            if canaries >= 2:
                break
            time.sleep(0.1)
        check(canaries >= 2, f"hang: strata served {canaries} of Dynamo's health canaries")
        strata.send_signal(signal.SIGSTOP)
        t = time.time()
        left = c.wait_instances(2, 30)
        took = round(time.time() - t, 2)
        check(left and took <= 8.0, f"hang: the hung worker left the pool after {took} s, not <= 8 s")
        try:
            worker.wait(40)
        except subprocess.TimeoutExpired:
            check(False, "hang: the worker in front of a hung strata did not exit")
        return took
    finally:
        strata.send_signal(signal.SIGCONT)
        strata.terminate()
        strata.wait(30)


def barrage(c, seconds, since):
    """Short requests from WORKLOAD_CLIENTS clients for `seconds`: [(seconds after
    `since`, HTTP status or None, error object present)] per answer."""
    answers = []
    lock = threading.Lock()
    end = time.time() + seconds

    def client(n):
        i = 0
        while time.time() < end:
            status, body = c.complete("kv", f"Client {n} asks question {i}: hello?", max_tokens=2)
            at = time.time() - since
            clean = status == 200 or (isinstance(body, dict) and ("error" in body or "message" in body))
            with lock:
                answers.append((round(at, 2), status, clean))
            i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(WORKLOAD_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(answers)


def reference(args, prompt, max_tokens):
    """`strata generate --json` of `prompt`, greedy."""
    out = subprocess.run(
        [args.strata, "generate", "--model", args.model, "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--temperature", "0", "--json"],
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


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
        # strata runs on the CPU here: Dynamo's instance list says so.
        devices = [i.get("device_type") for i in c.instances]
        check(devices == ["cpu", "cpu"], f"Dynamo lists the workers' devices as {devices}")

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
            check(g.get("dynamo_component_total_blocks") == GPU_BLOCKS,
                  f"worker {i}: dynamo_component_total_blocks "
                  f"{g.get('dynamo_component_total_blocks')}, want {GPU_BLOCKS}")
        check(any(g.get("dynamo_component_kv_cache_hit_rate", 0) > 0 for g in gauges),
              f"no worker reported a prefix-cache hit rate: {gauges}")

        # Greedy text through Dynamo equals `strata generate` on the same prompt.
        prompt = kv_prefixes[0] + " Question 0: what is the main point?"
        ref = reference(args, prompt, MAX_TOKENS)
        status, body = kv_firsts[0]
        if status == 200:
            text = body["choices"][0]["text"]
            check(text == ref["text"], f"Dynamo's greedy text {text!r} != strata generate {ref['text']!r}")
            check(body["usage"]["prompt_tokens"] == ref["prompt_tokens"],
                  f"Dynamo tokenized {body['usage']['prompt_tokens']} tokens, strata {ref['prompt_tokens']}")
        result["greedy_text_equal"] = not any("greedy" in f for f in FAILURES)

        result["cancelled_in_strata_after_s"] = cancel_phase(c)

        # The operator's workload behind each router: the KV router keeps each document's
        # follow-ups on the worker holding it, balances the documents, and so answers the
        # follow-ups at least twice as fast as round-robin (p90 time to first token).
        kv_rows, kv_hits = workload_phase(c, "kv", seed=1000)
        rr_rows, rr_hits = workload_phase(c, "round-robin", seed=2000)
        kv, rr = workload_summary(kv_rows), workload_summary(rr_rows)
        kv["hit_tokens"], rr["hit_tokens"] = kv_hits, rr_hits
        result["workload"] = {"kv": kv, "round-robin": rr}
        n = WORKLOAD_DOCS * (WORKLOAD_FOLLOW_UPS + 1)
        check(len(kv_rows) == n and len(rr_rows) == n,
              f"workload: {len(kv_rows)} and {len(rr_rows)} of {n} requests answered")
        check(all(600 <= t <= 1500 + 40 for t in kv["prompt_tokens"] + rr["prompt_tokens"]),
              f"workload: documents outside ~600–1,500 tokens: {kv['prompt_tokens']}")
        check(kv["on_holder_fraction"] >= 0.9,
              f"workload: only {kv['follow_ups_on_holder']} follow-ups on their document's holder")
        check(kv["busiest_worker_share"] <= 0.65,
              f"workload: one worker took {kv['busiest_worker_share']:.0%} of the requests")
        if kv["follow_up_ttft_p90_s"] and rr["follow_up_ttft_p90_s"]:
            ratio = rr["follow_up_ttft_p90_s"] / kv["follow_up_ttft_p90_s"]
            result["workload"]["follow_up_ttft_p90_round_robin_over_kv"] = round(ratio, 2)
            check(ratio >= 2.0, f"workload: follow-up TTFT p90 only {ratio:.2f}x round-robin's")
        # The holder really served from its cache: strata counted the hits.
        follow_tokens = sum(r[4] for r in kv_rows if r[1] > 0)
        check(kv_hits >= 0.8 * follow_tokens,
              f"workload: strata hit {kv_hits} of {follow_tokens} follow-up prompt tokens")

        result["hung_worker_left_pool_after_s"] = hang_phase(c)

        # A worker killed (SIGKILL) under load, twice: first its Dynamo process (its strata
        # must follow by itself), then, after a replacement registers, its strata.
        for what in ("worker", "strata"):
            victim = c.workers[1].pid if what == "worker" else strata_pid(c.strata_ports[1])
            outcomes, answers, first_workers = kill_phase(c, victim)
            bad = [a for a in answers if a[1] != 200]
            result[f"kill_{what}"] = {"streams": outcomes, "answers": len(answers),
                                      "failed": bad[:20]}
            # Streams started on both workers: those on the killed one had to move.
            check(len(first_workers) == 2,
                  f"kill {what}: the streams all started on one worker ({first_workers})")
            for k, (kind, detail) in outcomes.items():
                check(kind in ("ok", "error"),
                      f"kill {what}: stream {k} did not end cleanly: {detail}")
                # A finished stream, migrated or not, is the greedy text strata generates
                # (up to its end of sequence: the streams ignore it).
                if kind == "ok":
                    ref = reference(args, kill_stream_prompt(k), KILL_STREAM_TOKENS)
                    same = detail == ref["text"] if len(ref["token_ids"]) == KILL_STREAM_TOKENS \
                        else detail.startswith(ref["text"])
                    check(same, f"kill {what}: stream {k} {detail!r} != {ref['text']!r}")
            check(all(a[2] for a in answers),
                  f"kill {what}: a failed request got no error object: {bad[:5]}")
            check(all(a[0] <= 3.0 for a in bad),
                  f"kill {what}: requests still failed later than 3 s after the kill: {bad}")
            check(sum(1 for a in answers if a[1] == 200 and a[0] > 3.0) >= 4,
                  f"kill {what}: the survivor served too little after the kill: {answers[-8:]}")
            # The killed worker's strata (or the killed strata's worker) is gone too.
            gone = False
            for _ in range(60):
                strata_down = http_json(f"http://127.0.0.1:{c.strata_ports[1]}/health",
                                        timeout=2)[0] is None
                if strata_down and c.workers[1].poll() is not None:
                    gone = True
                    break
                time.sleep(0.5)
            check(gone, f"kill {what}: the other half of the killed worker still runs")
            if what == "worker":
                c.replace_worker(1)
                c.wait_ready()
    except Exception as e:
        check(False, f"{type(e).__name__}: {e}")
    finally:
        result["seconds"] = round(time.time() - t0, 1)
        c.stop()
        if FAILURES:
            c.print_logs()
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
