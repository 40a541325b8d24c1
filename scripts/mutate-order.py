#!/usr/bin/env python3
"""Proof by mutation of the stream ordering (docs/offload.md, "Proof by mutation").

Deletes, one at a time, every event `wait(...)` and `record(...)` the device is asked for
in the offload engine, the serving transfers and sparse decode — found by pattern (a
call on a receiver named `d`: `self.d.wait(`, `p.d.record(` ...), not from a list of
lines, so a new wait is covered the day it is written — rebuilds, runs the suites the
stream-ordering checker guards (tests/stream_order.rs), and fails unless every deletion
is caught. The deleted call becomes `Ok::<(), anyhow::Error>(())`, which type-checks
wherever the call did (a statement ending in `?;` or a tail expression).

  scripts/mutate-order.py            run every mutation; print the table; exit 1 if any survives
  scripts/mutate-order.py --list     list the mutations only
  scripts/mutate-order.py --only 3   run mutation 3 only
  scripts/mutate-order.py --markdown FILE   also write the table as markdown to FILE

Each mutation rebuilds the crate incrementally (~10 s on 2 cores) and runs the suite
(~10 s): a full run takes about ten minutes, and `.ci/run` runs it.
"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where cross-stream ordering is decided.
FILES = [
    "src/offload/engine.rs",
    "src/offload/experts.rs",
    "src/serve/device_pages.rs",
    "src/serve/disk/backend.rs",
]

SUITE = ["--test", "stream_order"]

# Incremental compilation of this crate alone (its dependencies are built as usual): a
# mutated build then takes ~10 s instead of ~90 s on 2 cores.
CARGO = ["cargo", "test", "--release", "--config", "profile.release.package.strata.incremental=true"]

CALL = re.compile(r"\b(?:self|[a-z_][a-z0-9_]*)\.d\s*\.\s*(wait|record)\s*\(")
REPLACEMENT = "Ok::<(), anyhow::Error>(())"


def call_end(text, open_paren):
    """Index just past the parenthesis closing the one at `open_paren`."""
    depth = 0
    for i in range(open_paren, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("unbalanced call")


def in_comment(text, pos):
    line_start = text.rfind("\n", 0, pos) + 1
    return text[line_start:pos].lstrip().startswith("//")


def test_module_start(text):
    """Where a file's `#[cfg(test)]` module begins (mutations there prove nothing)."""
    m = re.search(r"^#\[cfg\(test\)\]", text, re.M)
    return m.start() if m else len(text)


def mutations():
    out = []
    for path in FILES:
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            continue
        text = open(full).read()
        limit = test_module_start(text)
        for m in CALL.finditer(text):
            if m.start() >= limit or in_comment(text, m.start()):
                continue
            end = call_end(text, m.end() - 1)
            line = text.count("\n", 0, m.start()) + 1
            snippet = " ".join(text[m.start():end].split())
            fn = enclosing_fn(text, m.start())
            out.append(dict(path=path, start=m.start(), end=end, line=line,
                            call=snippet, fn=fn))
    return out


def enclosing_fn(text, pos):
    names = re.findall(r"\bfn\s+([a-z_][a-z0-9_]*)", text[:pos])
    return names[-1] if names else "?"


def run(cmd, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        f.write(p.stdout)
    return p.returncode, p.stdout


def failing_tests(output):
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", output, re.M)
    races = "stream-order race" in output
    return failed, races


def suite(log):
    """(built, passed, failing tests, a race was reported)."""
    rc, out = run([*CARGO, *SUITE, "--no-run"], log)
    if rc != 0:
        return False, False, [], False
    rc, out = run([*CARGO, *SUITE], log)
    failed, races = failing_tests(out)
    return True, rc == 0, failed, races


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--only", type=int)
    ap.add_argument("--markdown")
    ap.add_argument("--log", default=os.path.join(ROOT, "target", "mutate-order.log"))
    args = ap.parse_args()

    muts = mutations()
    if args.list:
        for i, m in enumerate(muts):
            print(f"{i:3} {m['path']}:{m['line']} ({m['fn']}) {m['call']}")
        return 0
    os.makedirs(os.path.dirname(args.log), exist_ok=True)
    open(args.log, "w").close()

    t0 = time.time()
    built, passed, failed, _ = suite(args.log)
    if not (built and passed):
        print(f"the unmutated suite does not pass ({failed}); see {args.log}", file=sys.stderr)
        return 2
    rows = []
    chosen = [args.only] if args.only is not None else range(len(muts))
    for i in chosen:
        m = muts[i]
        full = os.path.join(ROOT, m["path"])
        original = open(full).read()
        try:
            open(full, "w").write(original[:m["start"]] + REPLACEMENT + original[m["end"]:])
            built, passed, failed, races = suite(args.log)
        finally:
            open(full, "w").write(original)
        if not built:
            verdict, by = "did not build", ""
        elif passed:
            verdict, by = "SURVIVED", ""
        else:
            verdict = "caught (race reported)" if races else "caught"
            by = ", ".join(f"`{t}`" for t in failed)
        rows.append((i, m, verdict, by))
        print(f"{i:3} {m['path']}:{m['line']} ({m['fn']}) {m['call']}: {verdict} {by}", flush=True)
    # Restore the build of the unmutated sources.
    run([*CARGO, *SUITE, "--no-run"], args.log)

    survivors = [r for r in rows if r[2] in ("SURVIVED", "did not build")]
    took = time.time() - t0
    summary = (f"{len(rows)} deletions, {len(rows) - len(survivors)} caught, "
               f"{len(survivors)} survived or did not build; {took / 60:.1f} min")
    print(summary)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("| # | where | deleted | result | failing tests |\n| --- | --- | --- | --- | --- |\n")
            for i, m, verdict, by in rows:
                f.write(f"| {i} | `{m['path']}` `{m['fn']}` | `{m['call']}` | {verdict} | {by} |\n")
            f.write(f"\n{summary}\n")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
