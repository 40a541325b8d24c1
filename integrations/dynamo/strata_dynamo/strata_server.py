"""The `strata serve` a worker fronts: started as a child process, or attached to by URL.

Everything the worker registers with comes from the running server itself: the KV
geometry and the KV-events endpoint from `GET /v1/models`, the tokenizer files from
`GET /v1/strata/model_card` (made from strata's own tokenizer, so Dynamo's frontend
tokenizes exactly as strata does, GGUF models included).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp

logger = logging.getLogger(__name__)

# prctl(PR_SET_PDEATHSIG): the child strata gets SIGTERM when the worker dies, even by
# SIGKILL, so a killed worker never leaves a strata process serving nobody.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the worker's cleanup still stops it


def _forward(stream) -> None:
    for line in stream:
        sys.stdout.write(line)


@dataclass
class ServerInfo:
    """What `GET /v1/models` says about the server (strata's extension fields)."""

    model: str
    # Where strata runs the model: "cpu" or "cuda" (None from a strata that does not say).
    device: Optional[str]
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # (endpoint to connect to, topic), or None when the server publishes no KV events.
    kv_events: Optional[tuple[str, str]]

    @classmethod
    def from_models(cls, body: dict, url_host: str) -> "ServerInfo":
        m = body["data"][0]
        kv = m.get("kv_events")
        events = None
        if kv:
            # A wildcard bind is reachable where the HTTP server is.
            endpoint = kv["endpoint"].replace("tcp://0.0.0.0:", f"tcp://{url_host}:")
            events = (endpoint, kv["topic"])
        return cls(
            model=m["id"],
            device=m.get("device"),
            max_model_len=m["max_model_len"],
            block_size=m["kv_cache_block_size"],
            num_gpu_blocks=m["num_gpu_blocks"],
            max_num_seqs=m["max_num_seqs"],
            max_num_batched_tokens=m["max_num_batched_tokens"],
            kv_events=events,
        )


class StrataServer:
    """A running `strata serve` and the HTTP session to it."""

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None):
        self.url = url.rstrip("/")
        self.process = process
        self.session: Optional[aiohttp.ClientSession] = None
        self.info: Optional[ServerInfo] = None

    @classmethod
    async def launch(cls, strata_bin: str, serve_args: list[str]) -> "StrataServer":
        """Starts `strata serve` with `serve_args`; its first stdout line names its address.
        Without `--kv-events-endpoint` among them, events go to any free local port."""
        args = [strata_bin, "serve", *serve_args]
        if "--port" not in serve_args:
            args += ["--port", "0"]
        if "--kv-events-endpoint" not in serve_args:
            args += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
        logger.info("starting %s", " ".join(args))
        # Spawned from this (the event loop's, long-lived) thread: PDEATHSIG fires when the
        # spawning *thread* exits, so a pool thread would take strata down with it.
        process = subprocess.Popen(
            args, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
        )
        assert process.stdout is not None
        line = await asyncio.to_thread(process.stdout.readline)
        # "strata serve: listening on http://127.0.0.1:PORT (model `NAME`)"
        if "http://" not in line:
            await asyncio.to_thread(process.wait)
            raise RuntimeError(
                f"strata serve exited with status {process.returncode} before listening"
            )
        url = "http://" + line.split("http://", 1)[1].split()[0]
        # Keep draining its stdout, so a later line never blocks it on a full pipe.
        threading.Thread(target=_forward, args=(process.stdout,), daemon=True).start()
        return cls(url, process)

    async def connect(self, ready_timeout_s: float) -> ServerInfo:
        """Waits for /health (the model loads), then reads the server's description."""
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"strata serve exited with status {self.process.returncode} while loading"
                )
            try:
                async with self.session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if loop.time() > deadline:
                raise RuntimeError(f"strata serve at {self.url} not ready in {ready_timeout_s}s")
            await asyncio.sleep(0.2)
        async with self.session.get(f"{self.url}/v1/models") as r:
            r.raise_for_status()
            host = self.url.split("://", 1)[1].rsplit(":", 1)[0]
            self.info = ServerInfo.from_models(await r.json(), host)
        return self.info

    async def write_model_card(self, directory: Path) -> dict:
        """Writes tokenizer.json, tokenizer_config.json, config.json, generation_config.json;
        returns config.json's content."""
        assert self.session is not None
        async with self.session.get(f"{self.url}/v1/strata/model_card") as r:
            r.raise_for_status()
            files = (await r.json())["files"]
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            # Other workers of the component share the directory: replace atomically.
            path = directory / Path(name).name
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(content))
            os.replace(tmp, path)
        return files.get("config.json", {})

    async def load(self) -> Optional[dict[str, float]]:
        """The load gauges and counters the router's snapshot needs, from strata's
        /metrics (vLLM's names), or None when strata does not answer."""
        assert self.session is not None
        wanted = ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                  "vllm:prefix_cache_queries_total", "vllm:num_requests_waiting",
                  "vllm:num_requests_running")
        try:
            async with self.session.get(f"{self.url}/metrics") as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except aiohttp.ClientError:
            return None
        got = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in wanted:
                got[name] = float(line.rsplit(" ", 1)[1])
        return got

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.process is not None and self.process.poll() is None:
            # SIGTERM: strata finishes in-flight requests (its --shutdown-timeout), then exits.
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    async def watch(self, period_s: float = 0.5, hung_after_s: float = 5.0) -> str:
        """Returns, saying why, when strata stops serving: a child exits, the server
        refuses connections twice in a row (it is gone), or /health has not answered for
        `hung_after_s` (it hangs). The worker then leaves the pool at once instead of
        waiting for its discovery lease to lapse while routers still pick it."""
        assert self.session is not None
        loop = asyncio.get_running_loop()
        refused, last_answer = 0, loop.time()
        timeout = aiohttp.ClientTimeout(total=min(2.0, hung_after_s))
        while True:
            if self.process is not None and self.process.poll() is not None:
                return f"strata serve exited (status {self.process.returncode})"
            try:
                async with self.session.get(f"{self.url}/health", timeout=timeout) as r:
                    await r.read()
                refused, last_answer = 0, loop.time()  # any answer: it is alive
            except aiohttp.ClientConnectorError:
                refused += 1
                if refused >= 2:
                    return f"strata serve at {self.url} refuses connections"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                refused = 0
            if loop.time() - last_answer > hung_after_s:
                return f"strata serve at {self.url} has not answered for {hung_after_s:.0f} s"
            await asyncio.sleep(period_s)


def stop_this_worker() -> None:
    """The Rust Worker shuts down gracefully on SIGTERM (unregister, then cleanup)."""
    os.kill(os.getpid(), signal.SIGTERM)
