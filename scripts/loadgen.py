#!/usr/bin/env python3
"""Load generator for a live `strata serve` (or any OpenAI-compatible server).

For each concurrency level C, C streaming clients each send --requests-per-client
completions one after another; the levels run one after another in this one run, so their
ratios are measured side by side. Reports generated tokens/s, time to first token (TTFT)
p50/p99 and inter-token latency (ITL) p50/p99.

    scripts/loadgen.py --url http://127.0.0.1:8000 --concurrency 1,16 [--json]

Needs `pip install openai`. Requests use `ignore_eos` (a vLLM/strata extension) so every
request generates exactly --output-len tokens.
"""

import argparse
import asyncio
import json
import random
import statistics
import time

from openai import AsyncOpenAI


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def one_request(client, model, prompt, output_len):
    t0 = time.perf_counter()
    times = []
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    ttft = times[0] - t0 if times else float("nan")
    itl = [b - a for a, b in zip(times, times[1:])]
    return ttft, itl, usage.completion_tokens if usage else len(times)


async def run_level(client, model, prompts, concurrency, per_client, output_len):
    async def worker(w):
        out = []
        for r in range(per_client):
            p = prompts[(w * per_client + r) % len(prompts)]
            out.append(await one_request(client, model, p, output_len))
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - t0
    flat = [x for r in results for x in r]
    ttfts = [x[0] for x in flat]
    itls = [d for x in flat for d in x[1]]
    tokens = sum(x[2] for x in flat)
    return {
        "concurrency": concurrency,
        "requests": len(flat),
        "generated_tokens": tokens,
        "wall_s": wall,
        "throughput_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
    }


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="model name [default: the server's first /v1/models entry]")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--input-words", type=int, default=100, help="words per prompt (~tokens)")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.requests_per_client < 1 or args.output_len < 1:
        ap.error("concurrency levels, --requests-per-client and --output-len must be >= 1")

    client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key,
                         max_retries=0, timeout=3600)
    model = args.model or (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    words = "time people way year day thing man world life hand part child eye woman place work week case point government company number group problem fact".split()
    n_prompts = max(levels) * args.requests_per_client
    prompts = [" ".join(rng.choice(words) for _ in range(args.input_words)) for _ in range(n_prompts)]

    # Warm-up request (first-touch allocations), not measured.
    await one_request(client, model, prompts[0], 4)
    rows = [await run_level(client, model, prompts, c, args.requests_per_client, args.output_len)
            for c in levels]
    base = rows[0]["throughput_tokens_per_s"]
    for r in rows:
        r["speedup_vs_first_level"] = r["throughput_tokens_per_s"] / base
    if args.json:
        print(json.dumps({"url": args.url, "model": model, "input_words": args.input_words,
                          "output_len": args.output_len, "levels": rows}))
        return
    print(f"{args.url} model={model} input~{args.input_words} words output={args.output_len} tokens")
    print(f"{'conc':>5} {'reqs':>5} {'tok/s':>8} {'×':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['requests']:>5} {r['throughput_tokens_per_s']:>8.1f} "
              f"{r['speedup_vs_first_level']:>6.2f} {r['ttft_p50_s']*1e3:>7.0f}ms {r['ttft_p99_s']*1e3:>7.0f}ms "
              f"{r['itl_p50_s']*1e3:>6.0f}ms {r['itl_p99_s']*1e3:>6.0f}ms")


if __name__ == "__main__":
    asyncio.run(main())
