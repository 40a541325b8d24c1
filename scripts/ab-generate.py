#!/usr/bin/env python3
"""Interleaved A/B timing of `strata generate` (prefill and decode tokens/s).

Runs each variant in turn, round after round (A B C A B C ...), so a shared machine's
drift lands on every variant alike, and prints each variant's median over the rounds and
its ratio to the first. A variant is `NAME=BINARY[:ENV=VALUE,...][+FLAG,...]`, e.g.

  scripts/ab-generate.py --rounds 7 --prompt-tokens 1024 --max-tokens 64 -- \\
      base=/tmp/strata-base new=target/release/strata \\
      checked=target/release/strata:STRATA_CHECK_ORDER=1 \\
      q8=target/release/strata+--dtype,q8

(`+FLAG,...`: flags for that variant's `generate` only, after the shared ones.)

Extra arguments after the variants go to every `generate` (default: offload with 4
buffers). Used for docs/benchmarks.md ("Stream-ordering checker").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def variant(spec):
    name, _, rest = spec.partition("=")
    rest, _, own = rest.partition("+")
    binary, _, env = rest.partition(":")
    extra = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return name, binary, extra, [f for f in own.split(",") if f]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024,
                    help="approximate prompt length (words of filler)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("variants", nargs="+")
    args, extra = ap.parse_known_args()
    variants = [variant(v) for v in args.variants if "=" in v]
    flags = [a for a in args.variants if "=" not in a] + extra
    if not flags:
        flags = ["--enable-offload", "--num-kv-buffers", "4"]
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_tokens // 9))
    base = ["generate", "--prompt", prompt, "--max-tokens", str(args.max_tokens), "--json"]
    if args.model:
        base += ["--model", args.model]
    results = {name: {"prefill": [], "decode": []} for name, *_ in variants}
    for r in range(args.rounds):
        for name, binary, env, own in variants:
            out = subprocess.run([binary, *base, *flags, *own], env={**os.environ, **env},
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name}: {out.stderr.strip()}", file=sys.stderr)
                return 1
            j = json.loads(out.stdout)
            results[name]["prefill"].append(j["prefill_tokens_per_s"])
            results[name]["decode"].append(j["decode_tokens_per_s"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    first = variants[0][0]
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    # Each round's ratio to the first variant: the machine's drift cancels within a round.
    def ratios(name, key):
        return [x / y for x, y in zip(results[name][key], results[first][key])]

    def rng(v):
        return f"{min(v):.3f}–{max(v):.3f}"

    print("| variant | prefill tok/s (median) | ratio (median of rounds; range) "
          "| decode tok/s (median) | ratio (median of rounds; range) |")
    print("| --- | --- | --- | --- | --- |")
    for name, *_ in variants:
        p, d = med[name]["prefill"], med[name]["decode"]
        rp, rd = ratios(name, "prefill"), ratios(name, "decode")
        print(f"| {name} | {p:.1f} | {statistics.median(rp):.3f} ({rng(rp)}) | {d:.2f} | "
              f"{statistics.median(rd):.3f} ({rng(rd)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
