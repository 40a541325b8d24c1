#!/usr/bin/env python3
"""What a sparse draft verified by full attention would cost, from `strata bench sparse-eval --json`.

Self-speculative decoding with a sparse draft (docs/offload.md, "Toward lossless sparse
decode"): each round, sparse decode drafts K tokens (K loads of the budget's pages), then
one full-attention pass over them (one load of the whole KV) keeps the drafted tokens up to
the first one full attention would not have chosen, and adds full attention's own token
there (or after the K-th). With greedy sampling the output is full attention's, token for
token; the question is the cost.

The rounds are replayed from sparse-eval's teacher-forced steps: `forced[].disagreed`
lists, per case and budget, the decode steps where sparse decode fed full attention's
tokens chose another token. A drafted token is accepted when sparse agreed at that step.
(An approximation: a real draft's earlier rows within the round come from sparse
attention, the teacher-forced pass's from its own sparse steps too, but its rows before
the round from full attention's verified pass.)

Per context and budget, the table gives the acceptance rate, tokens per round and the KV
bytes a token reads, as a fraction of full loading (K · budget/context + 1 per round, over
the tokens it yields); on a link-bound device its inverse is the speed-up over full
loading, before the verify pass's compute.

  scripts/spec-rounds.py /tmp/eval.json --draft 2,4,8
"""

import argparse
import json
import sys
from collections import defaultdict


def rounds(steps, disagreed, k):
    """(rounds, tokens) to produce `steps` decode tokens with drafts of `k`."""
    bad = set(disagreed)
    s = n = 0
    while s < steps:
        run = 0
        while run < k and s + run < steps and (s + run) not in bad:
            run += 1
        s += run + 1  # the accepted drafts, then full attention's token
        n += 1
    return n, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="output of strata bench sparse-eval --json")
    ap.add_argument("--draft", default="2,4,8", help="draft lengths K (comma-separated)")
    a = ap.parse_args()
    drafts = [int(x) for x in a.draft.split(",")]
    with open(a.json) as f:
        report = json.load(f)
    cells = defaultdict(lambda: {"steps": 0, "agreed": 0, "rounds": defaultdict(int)})
    for case in report["cases"]:
        for f in case.get("forced", []):
            if "disagreed" not in f:
                sys.exit("this JSON has no forced[].disagreed: rerun with a newer strata")
            c = cells[(case["context"], f["budget"])]
            c["steps"] += f["steps"]
            c["agreed"] += f["agreed"]
            for k in drafts:
                c["rounds"][k] += rounds(f["steps"], f["disagreed"], k)[0]
    print("context budget   steps  accept " + " ".join(
        f"  K={k}: tok/round bytes/tok" for k in drafts))
    for (context, budget), c in sorted(cells.items()):
        row = f"{context:>7} {budget:>6} {c['steps']:>7} {c['agreed'] / max(c['steps'], 1):>7.3f} "
        for k in drafts:
            n = c["rounds"][k]
            per_round = c["steps"] / max(n, 1)
            bytes_per_tok = n * (k * budget / context + 1) / max(c["steps"], 1)
            row += f"  {'':>4}{per_round:>9.2f} {bytes_per_tok:>9.3f}"
        print(row)


if __name__ == "__main__":
    main()
