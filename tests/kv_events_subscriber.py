"""A KV-event subscriber written from vLLM's wire format alone (vllm/distributed/kv_events.py),
with pyzmq and msgpack, against a live `strata serve --kv-events-endpoint`.

Run by tests/kv_events.rs:
    python3 tests/kv_events_subscriber.py --events tcp://H:P --topic T --base-url URL
        --model NAME --block-size B --gpu-blocks N --pid PID

vLLM's format: a ZMQ PUB socket; every message is [topic, sequence number (8 bytes,
big-endian), payload]; the payload is a msgpack array [ts, events, data_parallel_rank];
each event a map tagged by "type": BlockStored {block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window}, BlockRemoved {block_hashes, medium, group_idx},
AllBlocksCleared {}. vLLM announces every full block of KV a request computes, prompt and
generated, whatever the prefill chunking; a prompt hits every cached full block but the
one holding its last token.

Exits 0 when every check passes, 1 otherwise, 3 when pyzmq or msgpack is missing.
"""

import argparse
import json
import os
import signal
import sys
import time
import urllib.request

try:
    import msgpack
    import zmq
except ImportError as e:
    print(f"kv_events_subscriber.py: {e} (pip install pyzmq msgpack)")
    sys.exit(3)

FAILURES = []
STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                 "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window"}


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)
    return cond


class Subscriber:
    def __init__(self, endpoint, topic):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topic = topic.encode()
        self.next_seq = None
        time.sleep(0.5)  # ZMQ's slow joiner: let the subscription reach the publisher

    def events(self, quiet_s=1.0, until=None):
        """Every event until none arrived for `quiet_s` seconds (or `until(event)` is true)."""
        got = []
        while self.sock.poll(int(quiet_s * 1000)):
            frames = self.sock.recv_multipart()
            if not check(len(frames) == 3, f"a message has {len(frames)} frames, not 3"):
                continue
            topic, seq, payload = frames
            check(topic == self.topic, f"topic frame {topic!r}, want {self.topic!r}")
            check(len(seq) == 8, f"sequence frame of {len(seq)} bytes")
            n = int.from_bytes(seq, "big")
            if self.next_seq is not None:
                check(n == self.next_seq, f"sequence number {n}, want {self.next_seq}")
            self.next_seq = n + 1
            batch = msgpack.unpackb(payload)
            check(isinstance(batch, list) and len(batch) in (2, 3),
                  f"payload is not [ts, events, dp_rank]: {batch!r:.200}")
            ts, events = batch[0], batch[1]
            check(isinstance(ts, float) and abs(ts - time.time()) < 60, f"ts {ts!r}")
            if len(batch) == 3:
                check(batch[2] in (0, None), f"data_parallel_rank {batch[2]!r}")
            for e in events:
                kind = e.get("type")
                if kind == "BlockStored":
                    check(STORED_FIELDS <= set(e), f"BlockStored lacks {STORED_FIELDS - set(e)}")
                    check(e.get("group_idx") == 0 and e.get("kv_cache_spec_kind") == "full_attention"
                          and e.get("kv_cache_spec_sliding_window") is None,
                          f"a full-attention model's block is not in group 0: {e}")
                elif kind == "BlockRemoved":
                    check({"type", "block_hashes", "medium", "group_idx"} <= set(e), f"BlockRemoved {e}")
                else:
                    check(kind == "AllBlocksCleared", f"unknown event type {kind!r}")
                got.append(e)
                if until and until(e):
                    return got
        return got


def post(args, path, body):
    req = urllib.request.Request(f"{args.base_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def complete(args, prompt, max_tokens=1):
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return post(args, "/v1/completions", body)


def prefix_hit_tokens(args):
    """vllm:prefix_cache_hits_total from /metrics."""
    with urllib.request.urlopen(f"{args.base_url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prefix_cache_hits_total{"):
                return float(line.rsplit(" ", 1)[1])
    check(False, "no vllm:prefix_cache_hits_total in /metrics")
    return 0.0


def stored_chain(events, bs):
    """(hashes, parent of the first, token ids) of consecutive BlockStored events on the GPU."""
    hashes, parent, tokens = [], None, []
    for i, e in enumerate(events):
        check(e["type"] == "BlockStored" and e["medium"] == "GPU", f"event {i}: {e}")
        check(e["block_size"] == bs, f"block_size {e['block_size']}, want {bs}")
        check(e["lora_id"] is None and e["lora_name"] is None, "a LoRA named")
        check(len(e["token_ids"]) == bs * len(e["block_hashes"]),
              f"{len(e['token_ids'])} token ids for {len(e['block_hashes'])} blocks of {bs}")
        if i == 0:
            parent = e["parent_block_hash"]
        else:
            check(e["parent_block_hash"] == hashes[-1], "the chain breaks between events")
        hashes += e["block_hashes"]
        tokens += e["token_ids"]
    return hashes, parent, tokens


def main():
    ap = argparse.ArgumentParser()
    for flag in ("--events", "--topic", "--base-url", "--model"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--gpu-blocks", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    args = ap.parse_args()
    bs = args.block_size
    sub = Subscriber(args.events, args.topic)

    # A prompt of k full blocks: BlockStored events carrying those blocks' tokens, in order.
    k = 8
    a = list(range(1000, 1000 + k * bs))
    complete(args, a)
    events = sub.events()
    hashes_a, parent, tokens = stored_chain(events, bs)
    check(tokens == a, f"the stored blocks' token ids are not the prompt's, in order: {tokens[:20]}...")
    check(len(hashes_a) == k and len(set(hashes_a)) == k, f"{len(hashes_a)} distinct hashes for {k} blocks")
    check(parent is None, f"the first block's parent is {parent}")
    stored = set(hashes_a)

    # The same prompt again: its blocks are cached already, so nothing new is stored.
    complete(args, a)
    check(sub.events() == [], "a repeated prompt announced its blocks again")

    # A prompt sharing the first half: only the new half is stored, chained to the hash of
    # the shared block before it (equal prefixes, equal hashes).
    b = a[: k // 2 * bs] + list(range(5000, 5000 + k // 2 * bs))
    complete(args, b)
    hashes_b, parent, tokens = stored_chain(sub.events(), bs)
    check(tokens == b[k // 2 * bs:], "the second prompt's new blocks carry other tokens")
    check(parent == hashes_a[k // 2 - 1], f"parent {parent}, want the shared block's {hashes_a[k // 2 - 1]}")
    stored |= set(hashes_b)

    # A prompt of 117 tokens, 7 full blocks and 5 tokens: the 7 blocks are announced
    # (however the prefill is chunked), the partial one is not.
    c = list(range(20000, 20117))
    complete(args, c)
    hashes_c, parent, tokens = stored_chain(sub.events(), bs)
    check(len(hashes_c) == 7 and tokens == c[:7 * bs],
          f"a 117-token prompt announced {len(hashes_c)} blocks, want 7 (vLLM's count)")
    stored |= set(hashes_c)

    # 64 prompt tokens and 100 generated: the KV of 163 tokens (the last one sampled is
    # never computed) fills 10 blocks, the prompt's 4 and 6 of generated tokens, chained.
    d = list(range(30000, 30064))
    complete(args, d, max_tokens=100)
    hashes_d, parent, tokens = stored_chain(sub.events(), bs)
    check(len(hashes_d) == 10, f"64 prompt + 100 generated tokens announced {len(hashes_d)} blocks, want 10")
    check(tokens[:64] == d and parent is None, "the generated blocks do not follow the prompt's")
    stored |= set(hashes_d)

    # A repeated 161-token prompt hits every cached block: 160 tokens (the last one is
    # always computed), announcing nothing new.
    e = list(range(40000, 40161))
    complete(args, e)
    stored |= set(stored_chain(sub.events(), bs)[0])
    before = prefix_hit_tokens(args)
    complete(args, e)
    check(sub.events() == [], "a repeated prompt announced blocks again")
    hit = prefix_hit_tokens(args) - before
    check(hit == 160, f"a repeated 161-token prompt hit {hit} tokens of cache, want 160")

    # vLLM's prefix-cache reset: AllBlocksCleared, after which the same prompt is computed
    # and announced again from its first block.
    post(args, "/reset_prefix_cache", {})
    cleared = sub.events()
    check([ev["type"] for ev in cleared] == ["AllBlocksCleared"],
          f"a reset sent {cleared[:3]}, want one AllBlocksCleared")
    complete(args, e)
    again, parent, tokens = stored_chain(sub.events(), bs)
    check(parent is None and tokens == e[:10 * bs], "after the reset the prompt was not announced anew")
    check(prefix_hit_tokens(args) - before == 160, "a prompt hit the cache after the reset")
    stored = set(again)  # everything before the reset is gone

    # More distinct prompts than the GPU pages hold: the oldest cached blocks are evicted,
    # each announced by BlockRemoved before the pages are reused.
    removed = set()
    for i in range(args.gpu_blocks // k + 2):
        complete(args, list(range(10000 + i * 1000, 10000 + i * 1000 + k * bs)))
        for e in sub.events(quiet_s=0.5):
            if e["type"] == "BlockStored":
                check(not set(e["block_hashes"]) & stored - removed, "a live block stored twice")
                stored |= set(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                check(e["medium"] == "GPU", f"removed from {e['medium']}")
                check(set(e["block_hashes"]) <= stored - removed,
                      "BlockRemoved names a block not stored (or removed already)")
                removed |= set(e["block_hashes"])
    check(removed, "no BlockRemoved although the GPU pages ran out")
    check(len(stored - removed) <= args.gpu_blocks,
          f"{len(stored - removed)} blocks announced as cached on {args.gpu_blocks} pages")
    check(again[0] in removed, "the least recently used block (the first after the reset) was not evicted")

    # Shutdown drops the GPU cache: the last event is AllBlocksCleared.
    os.kill(args.pid, signal.SIGTERM)
    last = sub.events(quiet_s=10, until=lambda e: e["type"] == "AllBlocksCleared")
    check(last and last[-1]["type"] == "AllBlocksCleared", f"no AllBlocksCleared at shutdown: {last[-3:]}")

    print(f"stored {len(stored)} blocks, removed {len(removed)}")
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
