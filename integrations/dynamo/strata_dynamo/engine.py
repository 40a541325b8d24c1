"""`StrataEngine`: Dynamo's `LLMEngine` contract (`dynamo.common.backend`) over a
`strata serve`.

Lifecycle: `from_args` parses the flags; `start` launches (or attaches to) strata, writes
the model card the frontend tokenizes with, and returns the registration (strata's block
size, context, capacity); `generate` streams one request's token ids from strata;
`abort` closes that request's HTTP stream, which cancels it in strata at its next step;
`kv_event_sources` hands Dynamo strata's ZMQ KV-events socket to relay to the KV router;
`attach_snapshot_publisher` receives the per-rank load publisher, fed from strata's
/metrics (KV blocks in use, prefix-cache hit rate) a few times a second so the router and
its busy thresholds see each worker's load; `is_quiescent` says whether strata has no
request running or waiting; `health_check_payload` is the canary Dynamo
sends through `generate` when the worker is idle (one greedy token after BOS);
`cleanup` stops a launched strata. A watchdog stops the worker (it unregisters at once)
when strata exits, refuses connections, or leaves /health unanswered for 5 s, so routers
stop picking a worker whose engine is gone instead of waiting out its discovery lease.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Optional

import aiohttp
from dynamo._core import Context
from dynamo.common.backend import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    WorkerConfig,
)
from dynamo.common.backend.health_check import build_health_check_payload
from dynamo.common.backend.publisher import ComponentSnapshot, KvEventSource, ZmqSource
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from .protocol import completion_body, dynamo_chunk, sse_data
from .strata_server import StrataServer, stop_this_worker

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m strata_dynamo",
        description="A Dynamo worker over strata serve (docs/distributed.md).",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--strata-bin",
        help="start this strata binary as `strata serve` (flags for it in --strata-args)",
    )
    where.add_argument("--strata-url", help="attach to a running strata serve (http://HOST:PORT)")
    p.add_argument(
        "--strata-args",
        default="",
        help="flags for `strata serve`, one shell-quoted string (e.g. \"--model M --port 8001\"); "
        "--port 0 and --kv-events-endpoint tcp://127.0.0.1:0 are added unless given",
    )
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--component", default="strata")
    p.add_argument("--endpoint", default="generate")
    p.add_argument(
        "--served-model-name", help="the model name clients send [default: strata's]"
    )
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"))
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    p.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE"))
    p.add_argument(
        "--no-kv-events",
        action="store_true",
        help="do not relay strata's KV events (the KV router then guesses from its own routing)",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for strata to load")
    p.add_argument(
        "--model-card-dir",
        type=Path,
        help="where the tokenizer files the frontend loads are written [default: "
        "$TMPDIR/strata-dynamo/NAMESPACE.COMPONENT]; every worker of a component must "
        "register the same path (Dynamo compares the cards, path included)",
    )
    args = p.parse_args(argv)
    if args.strata_url and args.strata_args:
        p.error("--strata-args needs --strata-bin (an attached server is already configured)")
    if args.model_card_dir is None:
        args.model_card_dir = (
            Path(tempfile.gettempdir()) / "strata-dynamo" / f"{args.namespace}.{args.component}"
        )
    return args


class StrataEngine(LLMEngine):
    def __init__(self, args: argparse.Namespace, card_dir: Path):
        self.args = args
        self.card_dir = card_dir
        self.server: Optional[StrataServer] = None
        self.model = ""
        # Dynamo request id → the HTTP response streaming it from strata.
        self.streams: dict[str, aiohttp.ClientResponse] = {}
        self.watchdog: Optional[asyncio.Task] = None
        self.bos_token_id: Optional[int] = None
        # The framework's per-rank load publisher, and the task feeding it.
        self.snapshots = None
        self.snapshot_task: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    @classmethod
    async def from_args(cls, argv: Optional[list[str]] = None):
        args = parse_args(argv)
        # Registration reads the model card after start(): the directory is named now and
        # filled from the running server in start().
        card_dir = args.model_card_dir
        engine = cls(args, card_dir)
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            model_name=str(card_dir),
            served_model_name=args.served_model_name,
            endpoint_types="chat,completions",
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            enable_kv_routing=not args.no_kv_events,
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        if self.args.strata_bin:
            self.server = await StrataServer.launch(
                self.args.strata_bin, shlex.split(self.args.strata_args)
            )
        else:
            self.server = StrataServer(self.args.strata_url)
        info = await self.server.connect(self.args.ready_timeout)
        config = await self.server.write_model_card(self.card_dir)
        self.bos_token_id = config.get("bos_token_id")
        self.model = info.model
        if info.device == "cpu":
            # Dynamo 1.6.1 registers an endpoint's device from this process's
            # CUDA_VISIBLE_DEVICES alone (empty, -1 or none: cpu; else cuda). Registration
            # comes after start(), and strata (already running) keeps its own environment.
            os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
        self.watchdog = asyncio.create_task(self._stop_when_strata_stops())
        self.loop = asyncio.get_running_loop()
        self._start_snapshots()
        logger.info(
            "strata serve at %s: model %s, block size %d, KV events %s",
            self.server.url,
            info.model,
            info.block_size,
            info.kv_events[0] if info.kv_events else "off",
        )
        return EngineConfig(
            model=str(self.card_dir),
            served_model_name=self.args.served_model_name or info.model,
            llm=LlmRegistration(
                context_length=info.max_model_len,
                kv_cache_block_size=info.block_size,
                total_kv_blocks=info.num_gpu_blocks,
                max_num_seqs=info.max_num_seqs,
                max_num_batched_tokens=info.max_num_batched_tokens,
            ),
        )

    async def _stop_when_strata_stops(self) -> None:
        assert self.server is not None
        why = await self.server.watch()
        logger.error("%s: stopping this worker (it leaves the routing pool now)", why)
        stop_this_worker()

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]  # one strata engine: rank 0

    def attach_snapshot_publisher(self, publisher) -> None:
        self.snapshots = publisher
        if self.loop is not None:  # started already: begin feeding it
            self.loop.call_soon_threadsafe(self._start_snapshots)

    def _start_snapshots(self) -> None:
        if self.snapshots is not None and self.server is not None and self.snapshot_task is None:
            self.snapshot_task = asyncio.ensure_future(self._publish_snapshots())

    async def _publish_snapshots(self, period_s: float = 0.25) -> None:
        """Feeds the router strata's load: KV blocks in use of the GPU pool (vLLM's
        kv_cache_usage_perc × blocks) and the prefix-cache hit rate, whenever they change."""
        last = None
        while self.server is not None and self.server.info is not None:
            load = await self.server.load()
            if load is not None:
                total = self.server.info.num_gpu_blocks
                usage = load.get("vllm:kv_cache_usage_perc", 0.0)
                queries = load.get("vllm:prefix_cache_queries_total", 0.0)
                hits = load.get("vllm:prefix_cache_hits_total", 0.0)
                snap = ComponentSnapshot(
                    kv_used_blocks=round(usage * total),
                    kv_total_blocks=total,
                    gpu_cache_usage=usage,
                    dp_rank=0,
                    kv_cache_hit_rate=hits / queries if queries > 0 else None,
                )
                if snap != last:
                    try:
                        self.snapshots.publish(0, snap)
                    except Exception as e:  # the framework is shutting down
                        logger.debug("load snapshot not published: %s", e)
                        return
                    last = snap
            await asyncio.sleep(period_s)

    async def is_quiescent(self) -> Optional[bool]:
        """No request running or waiting in strata (Dynamo asks prefill workers before
        their cleanup; strata's workers are aggregated, so it is informative here)."""
        if self.server is None or self.server.session is None:
            return True
        load = await self.server.load()
        if load is None:
            return None  # strata does not answer: no introspection
        busy = load.get("vllm:num_requests_running", 0) + load.get("vllm:num_requests_waiting", 0)
        return busy == 0

    async def health_check_payload(self):
        if self.bos_token_id is None:
            return None  # no BOS to send: no active probing
        return build_health_check_payload(self.bos_token_id)

    async def kv_event_sources(self) -> list[KvEventSource]:
        info = self.server.info if self.server else None
        if self.args.no_kv_events or info is None:
            return []
        if info.kv_events is None:
            logger.warning(
                "strata serve publishes no KV events (--kv-events-endpoint): the KV router "
                "cannot see its prefix cache"
            )
            return []
        endpoint, topic = info.kv_events
        return [ZmqSource(endpoint=endpoint, topic=topic)]

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        if self.server is None or self.server.session is None:
            raise EngineShutdown("strata is not running")
        body = completion_body(self.model, dict(request))
        prompt_tokens = len(body["prompt"])
        generated = 0
        try:
            resp = await self.server.session.post(f"{self.server.url}/v1/completions", json=body)
        except aiohttp.ClientError as e:
            raise EngineShutdown(f"strata is unreachable: {e}") from e
        self.streams[context.id()] = resp
        try:
            if resp.status != 200:
                raise _http_error(resp.status, await resp.text())
            async for line in resp.content:
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    return
                chunk = dynamo_chunk(json.loads(data), prompt_tokens, generated)
                if chunk is None:
                    continue
                generated += len(chunk["token_ids"])
                yield chunk
                if "finish_reason" in chunk:
                    return
            raise EngineShutdown("strata closed the stream before the request finished")
        except aiohttp.ClientError as e:
            if context.is_stopped() or context.is_killed():
                return  # aborted: `abort` closed the stream
            raise EngineShutdown(f"strata stream failed: {e}") from e
        finally:
            self.streams.pop(context.id(), None)
            resp.close()

    async def abort(self, context: Context) -> None:
        # Closing the connection is strata's cancellation: the request leaves its batch
        # and its KV blocks are freed at the next step.
        resp = self.streams.pop(context.id(), None)
        if resp is not None:
            resp.close()

    async def cleanup(self) -> None:
        if self.snapshot_task is not None:
            self.snapshot_task.cancel()
            self.snapshot_task = None
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.server is not None:
            await self.server.close()
            self.server = None


def _http_error(status: int, text: str) -> Exception:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    if status == 400:
        return InvalidArgument(f"strata: {message}")
    return EngineShutdown(f"strata answered {status}: {message}")
