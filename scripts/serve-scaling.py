#!/usr/bin/env python3
"""Generated tokens/s of a live `strata serve` at 1 and at N concurrent clients, and their
ratio: gpu-check's serving-throughput step. Standard library only (the GPU machine has no
`openai` package and no network); `scripts/loadgen.py` is the fuller tool (TTFT, ITL,
the real client).

    scripts/serve-scaling.py --url http://127.0.0.1:8000 [--streams 16] [--output-len 64]

Each client sends --requests-per-client non-streaming completions one after another
(`ignore_eos`, so each generates exactly --output-len tokens, counted from `usage`). Prints
one JSON object; exits 1 if a request fails or returns fewer tokens than asked.
"""

import argparse
import json
import sys
import threading
import time
import urllib.request


def complete(url, model, prompt, output_len, timeout):
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
        "ignore_eos": True,
    }).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)["usage"]["completion_tokens"]


def level(url, model, clients, per_client, output_len, timeout):
    """Tokens/s with `clients` concurrent clients; raises on any short or failed request."""
    tokens, errors = [], []

    def client(i):
        for j in range(per_client):
            prompt = f"Client {i}, request {j}: write a long story about the sea."
            try:
                n = complete(url, model, prompt, output_len, timeout)
                if n != output_len:
                    errors.append(f"client {i} request {j}: {n} tokens, asked {output_len}")
                tokens.append(n)
            except Exception as e:  # noqa: BLE001 - any failure fails the step
                errors.append(f"client {i} request {j}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return sum(tokens) / secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="", help="served model name (default: the server's first)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    model = a.model
    if not model:
        with urllib.request.urlopen(a.url + "/v1/models", timeout=a.timeout) as r:
            model = json.load(r)["data"][0]["id"]
    try:
        level(a.url, model, 1, 1, a.output_len, a.timeout)  # warm-up
        one = level(a.url, model, 1, a.requests_per_client, a.output_len, a.timeout)
        many = level(a.url, model, a.streams, a.requests_per_client, a.output_len, a.timeout)
    except RuntimeError as e:
        print(f"serve-scaling: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"streams": a.streams, "tok_s_1": round(one, 2),
                      f"tok_s_{a.streams}": round(many, 2), "ratio": round(many / one, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
