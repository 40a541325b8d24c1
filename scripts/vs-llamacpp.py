#!/usr/bin/env python3
"""strata against llama.cpp on the same GGUF file: prefill and decode tokens/s, interleaved.

Each round runs every variant once, alternating llama.cpp and strata (llama.cpp Q4_1,
strata stored, llama.cpp Q4_0, strata q8, ...), so a shared machine's drift lands on both
alike. Every variant prefills each context from an empty cache in one process, then times
greedy decode steps from the end of that prefill:

  llama.cpp: llama-batched-bench -m FILE -npp C1,C2 -ntg STEPS -npl 1 -t T -tb T
             (its defaults otherwise: n_batch 2048, n_ubatch 512, f16 KV, no flash attention)
  strata:    strata bench decode --model FILE --context C1,C2 --decode-steps STEPS
             --rounds 1 --dtype MODE --json   (RAYON_NUM_THREADS=T)

The table gives each variant's median and range over the rounds, and strata's ratios:
decode against llama.cpp's fastest format, prefill against llama.cpp on the same file
(issue 33's bars), each the median (range) of the per-round ratios. The load average is
recorded before and after every round. This script never builds llama.cpp: point
--llama-dir at a build's bin directory (docs/benchmarks.md says how it was built).

  scripts/vs-llamacpp.py --llama-dir /work/llama/build/bin --rounds 3 \\
      --llama-model-q4_0 /work/llama/SmolLM2-135M-Instruct.Q4_0.gguf
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


class Fail(Exception):
    """A one-line error for the user."""


def positive_ints(text):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--llama-dir", required=True,
                    help="llama.cpp build's bin directory (holding llama-batched-bench)")
    ap.add_argument("--strata", default="target/release/strata",
                    help="strata binary (default: %(default)s)")
    ap.add_argument("--model", default=os.environ.get("STRATA_MODEL", DEFAULT_MODEL),
                    help="GGUF file both run (default: $STRATA_MODEL, else %(default)s)")
    ap.add_argument("--llama-model-q4_0", metavar="PATH",
                    help="also run llama.cpp on this Q4_0 file (its fastest format here)")
    ap.add_argument("--contexts", type=positive_ints, default=[1024, 4096],
                    help="context depths / prompt lengths, comma-separated (default: 1024,4096)")
    ap.add_argument("--decode-steps", type=positive_int, default=32,
                    help="greedy decode steps timed after each prefill (default: %(default)s)")
    ap.add_argument("--threads", type=positive_int, default=2,
                    help="compute threads for both (default: %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--dtypes", default="stored,q8",
                    help="strata --dtype modes, comma-separated (default: %(default)s)")
    ap.add_argument("--llama-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for llama.cpp's runs, repeatable (e.g. "
                         "OMP_WAIT_POLICY=passive: its OpenMP barriers sleep instead of "
                         "spinning, which a loaded machine needs)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (every round's numbers) instead of the table")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write that JSON object to FILE")
    return ap.parse_args(argv)


def executable(path, what):
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise Fail(f"{what} not found or not executable: {path}")
    return path


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run(cmd, env=None):
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    except OSError as e:
        raise Fail(f"cannot run {cmd[0]}: {e}")
    if out.returncode != 0:
        raise Fail(f"{os.path.basename(cmd[0])} exited {out.returncode}: "
                   f"{last_line(out.stderr or out.stdout)}")
    return out


def llama_variant(bench, model, fmt, args):
    cmd = [bench, "-m", model, "-c", str(max(args.contexts) + args.decode_steps),
           "-npp", ",".join(map(str, args.contexts)), "-ntg", str(args.decode_steps),
           "-npl", "1", "-t", str(args.threads), "-tb", str(args.threads),
           "--output-format", "jsonl"]

    env = {**os.environ, **args.llama_env}

    def measure():
        out = run(cmd, env)
        rows = {}
        for line in (out.stdout + "\n" + out.stderr).splitlines():
            line = line.strip()
            if line.startswith("{") and '"speed_tg"' in line:
                j = json.loads(line)
                rows[j["pp"]] = {"prefill": j["speed_pp"], "decode": j["speed_tg"]}
        missing = [c for c in args.contexts if c not in rows]
        if missing:
            raise Fail(f"llama-batched-bench gave no result for context {missing[0]} "
                       f"(is the model's context large enough?): {last_line(out.stderr)}")
        return rows

    return {"name": f"llama.cpp {fmt}", "kind": "llama.cpp", "format": fmt, "model": model,
            "command": cmd, "env": args.llama_env, "measure": measure}


def strata_variant(strata, model, dtype, args):
    cmd = [strata, "bench", "decode", "--model", model,
           "--context", ",".join(map(str, args.contexts)),
           "--decode-steps", str(args.decode_steps), "--rounds", "1",
           "--dtype", dtype, "--json"]
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}

    def measure():
        out = run(cmd, env)
        try:
            report = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise Fail(f"strata bench decode printed no JSON: {last_line(out.stdout)}")
        if report.get("threads") != args.threads:
            raise Fail(f"strata ran {report.get('threads')} threads, asked {args.threads}")
        return {r["context"]: {"prefill": r["prefill_tokens_per_s"],
                               "decode": r["decode_tokens_per_s"]} for r in report["rows"]}

    return {"name": f"strata {dtype}", "kind": "strata", "format": dtype, "model": model,
            "command": cmd, "env": {"RAYON_NUM_THREADS": str(args.threads)},
            "measure": measure}


def file_format(path):
    """The quantisation named in a GGUF file's name (e.g. Q4_1), else "same file"."""
    m = re.search(r"(?i)[.-](I?Q\d_[0-9A-Z_]+|BF16|F16|F32)\.gguf$", os.path.basename(path))
    return m.group(1).upper() if m else "same file"


def interleave(llama, strata):
    """A B A B ...: llama.cpp and strata alternating, the longer list's tail at the end."""
    order = []
    for i in range(max(len(llama), len(strata))):
        order += llama[i:i + 1] + strata[i:i + 1]
    return order


def loadavg():
    return [round(x, 2) for x in os.getloadavg()]


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def analyse(variants, rounds, contexts):
    """Per variant, metric and context: median and range over rounds. Per strata variant:
    the per-round ratios against llama.cpp's fastest format (decode) and against llama.cpp
    on the same file (prefill, the first llama.cpp variant)."""
    stats = {}
    for v in variants:
        stats[v["name"]] = {
            m: {c: summary([r["results"][v["name"]][c][m] for r in rounds]) for c in contexts}
            for m in ("prefill", "decode")}
    llama = [v["name"] for v in variants if v["kind"] == "llama.cpp"]
    same_file = llama[0]
    ratios = {}
    for v in variants:
        if v["kind"] != "strata":
            continue
        ratios[v["name"]] = {}
        for c in contexts:
            dec = [r["results"][v["name"]][c]["decode"]
                   / max(r["results"][l][c]["decode"] for l in llama) for r in rounds]
            pre = [r["results"][v["name"]][c]["prefill"]
                   / r["results"][same_file][c]["prefill"] for r in rounds]
            ratios[v["name"]][c] = {"decode_vs_fastest": summary(dec),
                                    "prefill_vs_same_file": summary(pre)}
    return stats, ratios


def fmt_range(s, digits):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def fmt_ratio(s):
    return f"**{s['median']:.2f}×** ({s['min']:.2f}–{s['max']:.2f})"


def table(variants, rounds, contexts, stats, ratios):
    lines = []
    llama = [v["name"] for v in variants if v["kind"] == "llama.cpp"]
    head = "| variant | " + " | ".join(
        [f"decode tok/s @ {c}" for c in contexts] + [f"prefill tok/s, {c} prompt" for c in contexts])
    lines.append(head + " |")
    lines.append("| --- " + "| ---: " * (2 * len(contexts)) + "|")
    for v in variants:
        s = stats[v["name"]]
        cells = [fmt_range(s["decode"][c], 1) for c in contexts]
        cells += [fmt_range(s["prefill"][c], 0) for c in contexts]
        lines.append(f"| {v['name']} | " + " | ".join(cells) + " |")
    for name, per in ratios.items():
        cells = [fmt_ratio(per[c]["decode_vs_fastest"]) for c in contexts]
        cells += [fmt_ratio(per[c]["prefill_vs_same_file"]) for c in contexts]
        lines.append(f"| {name} ÷ llama.cpp | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Median (range) over {len(rounds)} rounds. Ratios: the median (range) of "
                 f"each round's ratio; decode against the fastest llama.cpp format in that "
                 f"round (of: {', '.join(llama)}), prefill against {llama[0]} (the same file "
                 f"as strata).")
    env = next((v["env"] for v in variants if v["kind"] == "llama.cpp"), {})
    if env:
        lines.append("llama.cpp ran with " + " ".join(f"{k}={x}" for k, x in env.items()) + ".")
    lines.append("Load average (1, 5, 15 min) before → after each round: " + "; ".join(
        f"{i + 1}: {r['load_before'][0]:.2f}/{r['load_before'][1]:.2f}/{r['load_before'][2]:.2f}"
        f" → {r['load_after'][0]:.2f}/{r['load_after'][1]:.2f}/{r['load_after'][2]:.2f}"
        for i, r in enumerate(rounds)))
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    env = {}
    for kv in args.llama_env:
        key, eq, value = kv.partition("=")
        if not key or not eq:
            raise Fail(f"--llama-env takes KEY=VALUE, got {kv!r}")
        env[key] = value
    args.llama_env = env
    bench = executable(os.path.join(args.llama_dir, "llama-batched-bench"),
                       "llama-batched-bench")
    strata = executable(args.strata, "strata binary")
    for path in [args.model] + ([args.llama_model_q4_0] if args.llama_model_q4_0 else []):
        if not os.path.isfile(path):
            raise Fail(f"model file not found: {path}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes:
        raise Fail("--dtypes is empty")
    llama = [llama_variant(bench, args.model, file_format(args.model), args)]
    if args.llama_model_q4_0:
        llama.append(llama_variant(bench, args.llama_model_q4_0, "Q4_0", args))
    variants = interleave(llama, [strata_variant(strata, args.model, d, args) for d in dtypes])

    rounds = []
    for i in range(args.rounds):
        before = loadavg()
        results = {}
        for v in variants:
            results[v["name"]] = v["measure"]()
            print(f"round {i + 1}/{args.rounds} {v['name']}: " + ", ".join(
                f"{c}: decode {r['decode']:.1f} prefill {r['prefill']:.0f}"
                for c, r in sorted(results[v["name"]].items())), file=sys.stderr)
        after = loadavg()
        print(f"round {i + 1}/{args.rounds} load average {before} -> {after}", file=sys.stderr)
        rounds.append({"load_before": before, "load_after": after, "results": results})

    stats, ratios = analyse(variants, rounds, args.contexts)
    report = json.dumps({
        "model": args.model, "threads": args.threads, "contexts": args.contexts,
        "decode_steps": args.decode_steps,
        "variants": [{k: v[k] for k in ("name", "kind", "format", "model", "command", "env")}
                     for v in variants],
        "rounds": [{**r, "results": {n: {str(c): x for c, x in res.items()}
                                     for n, res in r["results"].items()}}
                   for r in rounds],
        "stats": {n: {m: {str(c): x for c, x in per.items()} for m, per in s.items()}
                  for n, s in stats.items()},
        "ratios": {n: {str(c): x for c, x in per.items()} for n, per in ratios.items()},
    }, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(report + "\n")
    if args.json:
        print(report)
    else:
        print(table(variants, rounds, args.contexts, stats, ratios))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Fail as e:
        print(f"vs-llamacpp: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
