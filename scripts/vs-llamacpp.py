#!/usr/bin/env python3
"""strata against llama.cpp over GGUF formats: prefill and decode tokens/s, one table.

Takes a list of GGUF files, one format each (--files), or one source file and a list of
formats (--source, --formats), making each missing file with llama-quantize (named
<stem>.<FORMAT>.gguf next to the source or in --out-dir; existing files are reused, the
source itself stands for its own format). Without either it runs --model alone (and the
--llama-model-q4_0 file, if given), as earlier versions of this script did.

For each file, llama.cpp runs in two configurations, "default" (no flash attention) and
"fa" (flash attention), and strata in each --dtypes mode (default q8). Every run prefills
each context from an empty cache, then times greedy decode steps at that depth:

  llama.cpp, llama-batched-bench (preferred):
      llama-batched-bench -m FILE -c MAX+STEPS -npp C1,C2 -ntg STEPS -npl 1 -t T -tb T
          --output-format jsonl          [fa: -fa; builds whose -fa takes on|off|auto get
                                          -fa off / -fa on, since their default is auto]
  llama.cpp, llama-bench (when llama-batched-bench is not built, or --llama-tool bench):
      llama-bench -m FILE -p C1,C2 -n 0 -r 1 -t T -fa 0|1 -o jsonl            (prefill)
      llama-bench -m FILE -p 0 -n STEPS -d C1,C2 -r 1 -t T -fa 0|1 -o jsonl   (decode)
  strata:
      strata bench decode --model FILE --context C1,C2 --decode-steps STEPS --rounds 1
          --dtype MODE --json             (RAYON_NUM_THREADS=T)

Each round runs every (file, variant) once: per file llama.cpp default, strata, llama.cpp
fa, files one after another, and every second round in reverse order, so a shared
machine's drift lands on all alike. The load average is recorded before and after each
round. The table has one row per format and context: strata's prefill and decode, llama.cpp's
best of its two configurations in each round (and which won, in how many rounds), and the
ratios strata / that best. Values are the median (range) over rounds; a ratio is the
median (range) of the per-round ratios. Under the table: each context's fastest decode of
either program over all formats (issue 33's bar), and the load average's range.

This script never builds llama.cpp: point --llama-dir at a build's bin directory
(docs/benchmarks.md says how it was built). --dry-run prints what would run.

  scripts/vs-llamacpp.py --llama-dir /work/llama/build/bin \\
      --source models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --formats Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0 --out-dir /tmp/formats \\
      --contexts 1024,4096 --rounds 2

  scripts/vs-llamacpp.py --llama-dir /work/llama/build/bin --rounds 3 \\
      --files models/SmolLM2-135M-Instruct.Q4_1.gguf,/tmp/formats/SmolLM2-135M-Instruct.Q8_0.gguf
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

DEFAULT_MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CONFIGS = ("default", "fa")
FORMAT_IN_NAME = re.compile(
    r"(?i)[.-](I?Q\d_[0-9A-Z_]+|TQ\d_\d|MXFP4_MOE|BF16|F16|F32)\.gguf$")


class Fail(Exception):
    """A one-line error for the user."""


# ---------------------------------------------------------------- arguments

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


def name_list(text):
    """Comma-separated names, empty entries dropped, duplicates dropped (first kept)."""
    values = []
    for x in text.split(","):
        if x.strip() and x.strip() not in values:
            values.append(x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Fail(f"{message} (see --help)")


def parse_args(argv):
    ap = Parser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--llama-dir", required=True,
                    help="llama.cpp build's bin directory (llama-batched-bench or llama-bench, "
                         "and llama-quantize for --source)")
    ap.add_argument("--llama-tool", choices=("auto", "batched-bench", "bench"), default="auto",
                    help="llama.cpp program that measures: llama-batched-bench, llama-bench, "
                         "or auto: the first if it is in --llama-dir (default: %(default)s)")
    ap.add_argument("--strata", default="target/release/strata",
                    help="strata binary (default: %(default)s)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--files", type=name_list, metavar="F1.gguf,F2.gguf",
                       help="GGUF files to compare, one format each")
    which.add_argument("--source", metavar="SRC.gguf",
                       help="make each --formats file from this one with llama-quantize")
    which.add_argument("--model",
                       help="one GGUF file (default when neither --files nor --source: "
                            f"$STRATA_MODEL, else {DEFAULT_MODEL})")
    ap.add_argument("--formats", type=name_list, metavar="Q4_0,Q8_0",
                    help="with --source: llama-quantize types, comma-separated "
                         "(e.g. Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0)")
    ap.add_argument("--out-dir", metavar="DIR",
                    help="with --source: where made files go (default: the source's directory)")
    ap.add_argument("--llama-model-q4_0", metavar="PATH",
                    help="with --model: a second file to compare (the older form of --files)")
    ap.add_argument("--contexts", type=positive_ints, default=[1024, 4096],
                    help="context depths / prompt lengths, comma-separated (default: 1024,4096)")
    ap.add_argument("--decode-steps", type=positive_int, default=32,
                    help="greedy decode steps timed after each prefill (default: %(default)s)")
    ap.add_argument("--threads", type=positive_int, default=2,
                    help="compute threads for both, and for llama-quantize (default: %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--dtypes", type=name_list, default=["q8"],
                    help="strata --dtype modes, comma-separated (default: q8)")
    ap.add_argument("--llama-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for llama.cpp's runs, repeatable (e.g. "
                         "OMP_WAIT_POLICY=passive: its OpenMP barriers sleep instead of "
                         "spinning, which a loaded machine needs)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the llama-quantize commands and each round's runs, run nothing")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (every round's numbers) instead of the table")
    ap.add_argument("--json-out", metavar="FILE",
                    help="also write that JSON object to FILE")
    args = ap.parse_args(argv)
    if args.formats and not args.source:
        ap.error("--formats needs --source")
    if args.source and not args.formats:
        ap.error("--source needs --formats")
    if args.out_dir and not args.source:
        ap.error("--out-dir needs --source")
    if args.llama_model_q4_0 and (args.files or args.source):
        ap.error("--llama-model-q4_0 goes with --model; list the file in --files instead")
    args.llama_env = parse_env(args.llama_env)
    return args


def parse_env(pairs):
    env = {}
    for kv in pairs:
        key, eq, value = kv.partition("=")
        if not key or not eq:
            raise Fail(f"--llama-env takes KEY=VALUE, got {kv!r}")
        env[key] = value
    return env


# ---------------------------------------------------------------- processes

def executable(path, what):
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise Fail(f"{what} not found or not executable: {path}")
    return path


def last_line(text):
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
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


def help_text(binary):
    """A program's --help output (either stream), whatever its exit status."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Fail(f"cannot run {binary} --help: {e}")
    return out.stdout + out.stderr


def shell_line(cmd, env=None):
    words = [f"{k}={v}" for k, v in (env or {}).items()] + list(cmd)
    return " ".join(w if re.fullmatch(r"[\w@%+=:,./-]+", w) else repr(w) for w in words)


# ---------------------------------------------------------------- files and formats

def file_format(path):
    """The quantisation named in a GGUF file's name (e.g. Q4_1), else None."""
    m = FORMAT_IN_NAME.search(os.path.basename(path))
    return m.group(1).upper() if m else None


def file_stem(path):
    """The file name less its format and .gguf (SmolLM2-135M-Instruct.Q4_1.gguf:
    SmolLM2-135M-Instruct)."""
    name = os.path.basename(path)
    m = FORMAT_IN_NAME.search(name)
    if m:
        return name[:m.start()]
    return name[:-5] if name.lower().endswith(".gguf") else name


def quantize_types(quantize):
    """The type names llama-quantize's --help lists (Q4_0, Q4_K_M, ...), COPY left out."""
    text = help_text(quantize)
    names = re.findall(r"(?m)^\s*(?:\d+\s+or\s+)?([A-Z][A-Z0-9_]*)\s+:", text)
    return [n for n in names if n != "COPY"]


def check_formats(formats, quantize):
    known = quantize_types(quantize)
    wanted = [f.upper() for f in formats]
    bad = [f for f in wanted if f not in known]
    if bad and known:
        raise Fail(f"unknown format {bad[0]} (llama-quantize knows: {', '.join(known)})")
    return list(dict.fromkeys(wanted))


def quantize_command(quantize, source, output, fmt, threads):
    """llama-quantize writing OUTPUT.part (make_file renames it once complete, so a failed
    run leaves nothing to reuse). --allow-requantize only allows: it changes nothing for an
    f16/f32 source, and a quantized source (the usual Q4_1 here) needs it."""
    return [quantize, "--allow-requantize", source, output + ".part", fmt, str(threads)]


def make_file(cmd, output):
    part = output + ".part"
    try:
        run(cmd)
    except Fail as e:
        if os.path.exists(part):
            os.remove(part)
        raise Fail(f"making {os.path.basename(output)}: {e}")
    os.replace(part, output)


def source_files(args, quantize):
    """(format, path, command or None) per --formats entry: the source for its own format,
    an existing <stem>.<FORMAT>.gguf, else the llama-quantize command that makes it."""
    if not os.path.isfile(args.source):
        raise Fail(f"source file not found: {args.source}")
    formats = check_formats(args.formats, quantize)
    out_dir = args.out_dir or os.path.dirname(args.source) or "."
    stem, own = file_stem(args.source), file_format(args.source)
    plan = []
    for fmt in formats:
        if fmt == own:
            plan.append((fmt, args.source, None))
            continue
        path = os.path.join(out_dir, f"{stem}.{fmt}.gguf")
        cmd = None if os.path.isfile(path) else quantize_command(
            quantize, args.source, path, fmt, args.threads)
        plan.append((fmt, path, cmd))
    return plan


def listed_files(paths):
    """(label, path, None) per file: its format from its name, else its name; names that
    would repeat a label are shown whole."""
    for p in paths:
        if not os.path.isfile(p):
            raise Fail(f"model file not found: {p}")
    labels = [file_format(p) or file_stem(p) for p in paths]
    if len(set(labels)) < len(labels):
        labels = [os.path.basename(p) for p in paths]
    if len(set(labels)) < len(labels):
        twice = next(l for l in labels if labels.count(l) > 1)
        raise Fail(f"two files named {twice}: list each file once, under distinct names")
    return [(label, p, None) for label, p in zip(labels, paths)]


def plan_files(args, llama_dir):
    if args.source:
        quantize = executable(os.path.join(llama_dir, "llama-quantize"), "llama-quantize")
        return source_files(args, quantize)
    if args.files:
        return listed_files(args.files)
    model = args.model or os.environ.get("STRATA_MODEL", DEFAULT_MODEL)
    return listed_files([model] + ([args.llama_model_q4_0] if args.llama_model_q4_0 else []))


# ---------------------------------------------------------------- variants

def pick_llama_tool(llama_dir, choice):
    names = {"batched-bench": "llama-batched-bench", "bench": "llama-bench"}
    if choice == "auto":
        batched = os.path.join(llama_dir, names["batched-bench"])
        choice = "batched-bench" if os.path.isfile(batched) else "bench"
        if choice == "bench" and not os.path.isfile(os.path.join(llama_dir, names["bench"])):
            raise Fail(f"neither llama-batched-bench nor llama-bench in {llama_dir}")
    return choice, executable(os.path.join(llama_dir, names[choice]), names[choice])


def batched_bench_fa_flags(bench):
    """Flags per configuration. Older builds take a bare -fa (default off); newer ones take
    -fa on|off|auto with default auto, which picks flash attention on a CPU, so 'default'
    pins the older default (off) there."""
    if re.search(r"--flash-attn\s+\[?on\|off", help_text(bench)):
        return {"default": ["-fa", "off"], "fa": ["-fa", "on"]}
    return {"default": [], "fa": ["-fa"]}


def llama_fa_flags(tool, binary):
    if tool == "bench":
        return {"default": ["-fa", "0"], "fa": ["-fa", "1"]}
    return batched_bench_fa_flags(binary)


def llama_commands(tool, binary, model, flags, args):
    ctx = ",".join(map(str, args.contexts))
    t = str(args.threads)
    if tool == "bench":
        common = ["-m", model, "-r", "1", "-t", t, *flags, "-o", "jsonl"]
        return [[binary, *common, "-p", ctx, "-n", "0"],
                [binary, *common, "-p", "0", "-n", str(args.decode_steps), "-d", ctx]]
    return [[binary, "-m", model, "-c", str(max(args.contexts) + args.decode_steps),
             "-npp", ctx, "-ntg", str(args.decode_steps), "-npl", "1", "-t", t, "-tb", t,
             *flags, "--output-format", "jsonl"]]


def json_lines(text):
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except ValueError:
                pass


def parse_batched_bench(outs):
    rows = {}
    for out in outs:
        for j in json_lines(out.stdout + "\n" + out.stderr):
            if "speed_tg" in j:
                rows[j["pp"]] = {"prefill": j["speed_pp"], "decode": j["speed_tg"]}
    return rows


def parse_llama_bench(outs):
    prefill, decode = {}, {}
    for out in outs:
        for j in json_lines(out.stdout):
            if "avg_ts" not in j:
                continue
            if j.get("n_gen", 0) == 0 and j.get("n_depth", 0) == 0:
                prefill[j["n_prompt"]] = j["avg_ts"]
            elif j.get("n_prompt", 0) == 0:
                decode[j.get("n_depth", 0)] = j["avg_ts"]
    return {c: {"prefill": prefill[c], "decode": decode[c]} for c in prefill if c in decode}


def llama_variant(tool, binary, label, model, config, flags, args):
    cmds = llama_commands(tool, binary, model, flags, args)
    env = {**os.environ, **args.llama_env}
    parse = parse_llama_bench if tool == "bench" else parse_batched_bench

    def measure():
        outs = [run(cmd, env) for cmd in cmds]
        rows = parse(outs)
        missing = [c for c in args.contexts if c not in rows]
        if missing:
            raise Fail(f"{os.path.basename(binary)} gave no result for context {missing[0]} "
                       f"(is the model's context large enough?): {last_line(outs[-1].stderr)}")
        return rows

    return {"name": f"{label} llama.cpp {config}", "file": label, "kind": "llama.cpp",
            "config": config, "model": model, "commands": cmds, "env": args.llama_env,
            "measure": measure}


def strata_variant(strata, label, model, dtype, args):
    cmd = [strata, "bench", "decode", "--model", model,
           "--context", ",".join(map(str, args.contexts)),
           "--decode-steps", str(args.decode_steps), "--rounds", "1",
           "--dtype", dtype, "--json"]
    env = {"RAYON_NUM_THREADS": str(args.threads)}

    def measure():
        out = run(cmd, {**os.environ, **env})
        try:
            report = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise Fail(f"strata bench decode printed no JSON: {last_line(out.stdout)}")
        if report.get("threads") != args.threads:
            raise Fail(f"strata ran {report.get('threads')} threads, asked {args.threads}")
        return {r["context"]: {"prefill": r["prefill_tokens_per_s"],
                               "decode": r["decode_tokens_per_s"]} for r in report["rows"]}

    return {"name": f"{label} strata {dtype}", "file": label, "kind": "strata",
            "config": dtype, "model": model, "commands": [cmd], "env": env,
            "measure": measure}


def interleave(llama, strata):
    """A B A B ...: llama.cpp and strata alternating, the longer list's tail at the end."""
    order = []
    for i in range(max(len(llama), len(strata))):
        order += llama[i:i + 1] + strata[i:i + 1]
    return order


def round_order(variants, i):
    """Round i's order: the variant list, reversed every second round."""
    return list(variants) if i % 2 == 0 else list(reversed(variants))


# ---------------------------------------------------------------- rounds

def loadavg():
    return [round(x, 2) for x in os.getloadavg()]


def measure_rounds(variants, args):
    rounds = []
    for i in range(args.rounds):
        order = round_order(variants, i)
        before = loadavg()
        results = {}
        for v in order:
            results[v["name"]] = v["measure"]()
            print(f"round {i + 1}/{args.rounds} {v['name']}: " + ", ".join(
                f"{c}: decode {r['decode']:.1f} prefill {r['prefill']:.0f}"
                for c, r in sorted(results[v["name"]].items())), file=sys.stderr)
        after = loadavg()
        print(f"round {i + 1}/{args.rounds} load average {before} -> {after}", file=sys.stderr)
        rounds.append({"order": [v["name"] for v in order], "load_before": before,
                       "load_after": after, "results": results})
    return rounds


def dry_run(plan, variants, args):
    for fmt, path, cmd in plan:
        if cmd:
            print(f"# make {fmt}: {path}\n{shell_line(cmd)}\nmv {path}.part {path}")
        else:
            print(f"# {fmt}: {path} (exists)")
    for i in range(args.rounds):
        print(f"# round {i + 1}/{args.rounds} (load average before and after)")
        for v in round_order(variants, i):
            print(f"#   {v['name']}")
            for cmd in v["commands"]:
                print(shell_line(cmd, v["env"]))


# ---------------------------------------------------------------- analysis

def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def per_round(rounds, name, context, metric):
    return [r["results"][name][context][metric] for r in rounds]


def llama_best(rounds, label, context, metric):
    """llama.cpp's best configuration per round: values and winners."""
    best, won = [], []
    for r in rounds:
        by_config = {c: r["results"][f"{label} llama.cpp {c}"][context][metric]
                     for c in LLAMA_CONFIGS}
        winner = max(LLAMA_CONFIGS, key=lambda c: by_config[c])
        best.append(by_config[winner])
        won.append(winner)
    return best, {c: won.count(c) for c in LLAMA_CONFIGS}


def analyse_rows(files, dtypes, rounds, contexts):
    """One row per file, context and strata mode: medians (ranges) over rounds, llama.cpp's
    per-round best and who won, and the per-round ratios strata / that best."""
    rows = []
    for label, path, _ in files:
        for c in contexts:
            llama = {}
            for metric in ("prefill", "decode"):
                best, wins = llama_best(rounds, label, c, metric)
                llama[metric] = {
                    "best": summary(best), "won": wins, "per_round_best": best,
                    "configs": {
                        cfg: summary(per_round(rounds, f"{label} llama.cpp {cfg}", c, metric))
                        for cfg in LLAMA_CONFIGS}}
            for d in dtypes:
                name = f"{label} strata {d}"
                strata = {m: summary(per_round(rounds, name, c, m)) for m in ("prefill", "decode")}
                ratio = {m: summary([s / b for s, b in zip(per_round(rounds, name, c, m),
                                                            llama[m]["per_round_best"])])
                         for m in ("prefill", "decode")}
                rows.append({"format": label, "file": path, "context": c, "dtype": d,
                             "strata": strata, "llama.cpp": llama, "ratio": ratio})
    return rows


def fastest_decode(rows, contexts):
    """Per context: strata's and llama.cpp's fastest decode (median) over every file."""
    out = {}
    for c in contexts:
        at = [r for r in rows if r["context"] == c]
        s = max(at, key=lambda r: r["strata"]["decode"]["median"])
        l = max(at, key=lambda r: r["llama.cpp"]["decode"]["best"]["median"])
        ld = l["llama.cpp"]["decode"]
        out[c] = {"strata": {"format": s["format"], "dtype": s["dtype"],
                             "decode": s["strata"]["decode"]["median"]},
                  "llama.cpp": {"format": l["format"], "decode": ld["best"]["median"],
                                "config": max(LLAMA_CONFIGS, key=lambda k: ld["won"][k])},
                  "ratio": s["strata"]["decode"]["median"] / ld["best"]["median"]}
    return out


# ---------------------------------------------------------------- output

def fmt_range(s, digits):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def fmt_ratio(s):
    return f"**{s['median']:.2f}×** ({s['min']:.2f}–{s['max']:.2f})"


def fmt_won(wins):
    """'fa' when fa won every round, 'fa 2/3' when most, 'tie' when even."""
    total = sum(wins.values())
    top = max(LLAMA_CONFIGS, key=lambda c: wins[c])
    if wins[top] == total:
        return top
    if list(wins.values()).count(wins[top]) > 1:
        return f"tie {wins[top]}/{total}"
    return f"{top} {wins[top]}/{total}"


def table(rows, dtypes, rounds, tool, flags, args, fastest):
    many = len(dtypes) > 1
    s = "strata" if many else f"strata {dtypes[0]}"
    head = (["format", "context"] + (["strata"] if many else [])
            + [f"{s} prefill t/s", f"{s} decode t/s", "llama.cpp prefill t/s (best)", "won",
               "llama.cpp decode t/s (best)", "won", "prefill ratio", "decode ratio"])
    lines = ["| " + " | ".join(head) + " |",
             "| --- | ---: " + ("| --- " if many else "")
             + "| ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        lp, ld = r["llama.cpp"]["prefill"], r["llama.cpp"]["decode"]
        cells = ([r["format"], str(r["context"])] + ([r["dtype"]] if many else [])
                 + [fmt_range(r["strata"]["prefill"], 0), fmt_range(r["strata"]["decode"], 1),
                    fmt_range(lp["best"], 0), fmt_won(lp["won"]),
                    fmt_range(ld["best"], 1), fmt_won(ld["won"]),
                    fmt_ratio(r["ratio"]["prefill"]), fmt_ratio(r["ratio"]["decode"])])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    prog = "llama-bench" if tool == "bench" else "llama-batched-bench"
    lines.append(
        f"Median (range) over {len(rounds)} rounds, {args.threads} threads, {args.decode_steps} "
        f"decode steps. llama.cpp: {prog}, the faster of 'default' "
        f"({' '.join(flags['default']) or 'no flag'}) and 'fa' ({' '.join(flags['fa'])}) in each "
        f"round ('won': which, in how many rounds if not all). Ratios: the median (range) of "
        f"each round's strata / that best, same file and context.")
    if args.llama_env:
        lines.append("llama.cpp ran with "
                     + " ".join(f"{k}={x}" for k, x in args.llama_env.items()) + ".")
    for c, f in fastest.items():
        lines.append(f"Fastest decode @ {c}: strata {f['strata']['dtype']} {f['strata']['format']} "
                     f"{f['strata']['decode']:.1f} t/s, llama.cpp {f['llama.cpp']['format']} "
                     f"{f['llama.cpp']['config']} {f['llama.cpp']['decode']:.1f} t/s: "
                     f"**{f['ratio']:.2f}×** (medians).")
    lines.append(load_line(rounds))
    return "\n".join(lines)


def load_1min(rounds):
    return [x for r in rounds for x in (r["load_before"][0], r["load_after"][0])]


def load_line(rounds):
    ones = load_1min(rounds)
    return (f"Load average (1 min): {min(ones):.2f}–{max(ones):.2f}; "
            "before → after each round: "
            + "; ".join(f"{i + 1}: {r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}"
                        for i, r in enumerate(rounds)) + ".")


def report_json(files, variants, rounds, rows, fastest, tool, flags, args):
    return json.dumps({
        "files": [{"format": f, "path": p} for f, p, _ in files],
        "threads": args.threads, "contexts": args.contexts, "decode_steps": args.decode_steps,
        "llama_tool": tool, "llama_configs": flags, "dtypes": args.dtypes,
        "variants": [{k: v[k] for k in ("name", "file", "kind", "config", "model",
                                        "commands", "env")} for v in variants],
        "rounds": [{**r, "results": {n: {str(c): x for c, x in res.items()}
                                     for n, res in r["results"].items()}}
                   for r in rounds],
        "rows": rows,
        "fastest_decode": {str(c): f for c, f in fastest.items()},
        "load_1min": {"min": min(load_1min(rounds)), "max": max(load_1min(rounds))},
    }, indent=1)


# ---------------------------------------------------------------- main

def main(argv):
    args = parse_args(argv)
    if not os.path.isdir(args.llama_dir):
        raise Fail(f"--llama-dir is not a directory: {args.llama_dir}")
    tool, llama_bin = pick_llama_tool(args.llama_dir, args.llama_tool)
    strata = executable(args.strata, "strata binary")
    files = plan_files(args, args.llama_dir)
    flags = llama_fa_flags(tool, llama_bin)
    variants = []
    for label, path, _ in files:
        llama = [llama_variant(tool, llama_bin, label, path, c, flags[c], args)
                 for c in LLAMA_CONFIGS]
        variants += interleave(llama, [strata_variant(strata, label, path, d, args)
                                       for d in args.dtypes])
    if args.dry_run:
        dry_run(files, variants, args)
        return 0

    for fmt, path, cmd in files:
        if cmd:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            print(f"making {fmt}: {path}", file=sys.stderr)
            make_file(cmd, path)
    rounds = measure_rounds(variants, args)
    rows = analyse_rows(files, args.dtypes, rounds, args.contexts)
    fastest = fastest_decode(rows, args.contexts)
    report = report_json(files, variants, rounds, rows, fastest, tool, flags, args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(report + "\n")
    if args.json:
        print(report)
    else:
        print(table(rows, args.dtypes, rounds, tool, flags, args, fastest))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Fail as e:
        print(f"vs-llamacpp: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
