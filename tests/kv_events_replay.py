"""vLLM's KV-event replay protocol, from a libzmq DEALER (pyzmq), against a live
`strata serve --kv-events-replay-endpoint`: what a subscriber that missed messages asks.

Run by tests/kv_events.rs:
    python3 tests/kv_events_replay.py --events tcp://H:P --replay tcp://H:P --topic T
        --base-url URL --model NAME --buffer N

The protocol (vllm/distributed/kv_events.py, ZmqEventPublisher, and Dynamo's mocker):
the requester sends [b"", start (8 bytes, big-endian)]; the ROUTER answers one message
[b"", topic, seq (8 bytes BE), payload] per buffered batch with seq >= start, oldest
first, then [b"", b"", -1 (8 bytes, signed BE), b""]. Checked: the replay of everything
equals the live stream a SUB received (same topic, sequence numbers and payload bytes),
holds only the last N batches when the buffer keeps N, starts where asked, ends with the
marker when nothing is newer, and a malformed request gets no answer and harms nothing.

Exits 0 when every check passes, 1 otherwise, 3 when pyzmq is missing.
"""

import argparse
import json
import sys
import time
import urllib.request

try:
    import zmq
except ImportError as e:
    print(f"kv_events_replay.py: {e} (pip install pyzmq)")
    sys.exit(3)

FAILURES = []
END = (-1).to_bytes(8, "big", signed=True)


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)
    return cond


def complete(base_url, model, prompt):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    req = urllib.request.Request(f"{base_url}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def replay(dealer, start):
    """Every reply to one request from `start`: [(topic, seq, payload)], until the end
    marker (which must come within 10 s)."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        if not dealer.poll(10000):
            check(False, f"replay from {start}: no end marker within 10 s")
            return got
        frames = dealer.recv_multipart()
        if not check(len(frames) == 4 and frames[0] == b"",
                     f"replay from {start}: a reply of {len(frames)} frames {frames[:2]}"):
            return got
        _, topic, seq, payload = frames
        if topic == b"" and seq == END and payload == b"":
            return got
        got.append((topic, int.from_bytes(seq, "big"), payload))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--buffer", type=int, required=True, help="the server's replay buffer")
    args = ap.parse_args()
    topic = args.topic.encode()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(args.events)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    time.sleep(0.5)  # ZMQ's slow joiner

    # Six requests, six distinct prompts: several batches (one per engine step).
    for i in range(6):
        check(complete(args.base_url, args.model, f"Replay test prompt {i}: " + "word " * (40 + 7 * i)) == 200,
              f"request {i} failed")
    live = {}
    while sub.poll(1000):
        t, seq, payload = sub.recv_multipart()
        live[int.from_bytes(seq, "big")] = (t, payload)
    if not check(len(live) >= 3, f"only {len(live)} live batches"):
        return
    last = max(live)

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(args.replay)
    everything = replay(dealer, 0)
    seqs = [s for _, s, _ in everything]
    first = max(0, last + 1 - args.buffer)
    check(seqs == list(range(first, last + 1)),
          f"a replay from 0 gave batches {seqs[:5]}..{seqs[-5:]}, want {first}..{last}")
    for t, s, payload in everything:
        if s in live:
            check((t, payload) == live[s], f"batch {s} replayed differs from the live one")
    check(any(s in live for s in seqs), "no replayed batch was also seen live")

    middle = (first + last + 1) // 2
    tail = replay(dealer, middle)
    check([s for _, s, _ in tail] == list(range(middle, last + 1)),
          f"a replay from {middle} gave {[s for _, s, _ in tail]}")
    check(replay(dealer, last + 100) == [], "a replay from past the end was not empty")

    # A malformed request is ignored (no answer); the connection still serves.
    dealer.send_multipart([b"not", b"a request", b"at all"])
    again = replay(dealer, last)
    check([s for _, s, _ in again] == [last],
          f"after a malformed request, a replay from {last} gave {[s for _, s, _ in again]}")
    print(json.dumps({"live": len(live), "last": last, "replayed_from_0": len(everything)}))
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
