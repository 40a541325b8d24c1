#!/usr/bin/env python3
"""Run lm-evaluation-harness's `local-completions` model against an OpenAI-compatible
server (strata serve) on the repo's `strata_mc` task and compare with the HF
transformers reference in tests/data/lm_eval/hf_reference.json.

    python tests/lm_eval_compare.py --base-url http://127.0.0.1:PORT [--tokenizer-dir DIR]

Checks, all against the reference (an `lm_eval --model hf` run of the same GGUF,
dequantized to f32 by transformers):
  * acc and acc_norm are equal;
  * per item, the chosen index for acc (argmax of the log-likelihoods) and for
    acc_norm (argmax of log-likelihood / len(choice text)) are equal;
  * per choice, the log-likelihood is within --tol nats (default 0.02) absolute;
  * is_greedy is NOT compared by default (it is an exact float comparison inside
    lm_eval; --check-greedy turns it on).

Exit status: 0 all equal (one summary line on stdout); 1 a mismatch (each printed);
2 a usage or setup problem (server unreachable, tokenizer does not reproduce the
reference token ids, lm_eval failed); 77 lm_eval (or transformers) is not importable,
which the Rust test treats as "skipped".

Needs: lm_eval[api]==0.4.13, transformers (5.x), and a HF tokenizer for the model.
Without --tokenizer-dir one is built into a temporary directory from the GGUF: with
transformers' GGUF loader when torch is installed, otherwise directly from the GGUF's
vocabulary and merges with the `gguf` and `tokenizers` packages (gpt2-style BPE only).
Either way the tokenizer must reproduce the reference's token ids for all 160
requests, or the run stops (exit 2) before lm_eval is started.

How local-completions is configured (see the lm_eval source, api_models.py and
openai_completions.py in 0.4.13): token-id prompts (tokenized_requests=True), so the
server sees exactly the ids the HF run scored (no BOS: the GGUF says
add_bos_token=false); tokenizer_backend=huggingface (skips the /tokenizer_info probe);
batch_size=1, num_concurrent=1. Each request is
  {"model": M, "prompt": [[ids...]], "temperature": 0, "max_tokens": 1,
   "logprobs": 1, "seed": 1234, "echo": true}
and lm_eval reads choices[i].index and choices[i].logprobs.token_logprobs /
.top_logprobs, sliced [ctxlen:-1]: the response must hold one entry per prompt token
plus exactly one for the generated token.
"""

import argparse
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request

SKIP = 77
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join("tests", "data", "lm_eval")  # relative to REPO (data_files is)
DEFAULT_REF = os.path.join(REPO, TASK_DIR, "hf_reference.json")
DEFAULT_GGUF = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def die(code, msg):
    print(f"lm_eval_compare: {msg}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------- comparison logic


def choice_index(lls, choices, norm):
    """lm_eval's pred / pred_norm for multiple_choice (np.argmax: first max wins)."""
    scores = [ll / float(len(c)) for ll, c in zip(lls, choices)] if norm else list(lls)
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best


def compare(ref, got, tol, check_greedy=False):
    """ref: the hf_reference.json dict; got: {"acc", "acc_norm", "items": {doc_id:
    {"lls": [...], "greedy": [...]}}}. Returns (problems, stats)."""
    problems = []
    max_diff, max_where = 0.0, None
    greedy_diffs = 0
    if set(got["items"]) != {it["doc_id"] for it in ref["items"]}:
        problems.append(
            f"item sets differ: reference has {len(ref['items'])} items, run has {len(got['items'])}"
        )
    for it in ref["items"]:
        g = got["items"].get(it["doc_id"])
        if g is None:
            continue
        d = it["doc_id"]
        ref_lls = [c["loglikelihood"] for c in it["choices_scored"]]
        ref_greedy = [c["is_greedy"] for c in it["choices_scored"]]
        if len(g["lls"]) != len(ref_lls):
            problems.append(f"item {d}: {len(g['lls'])} choices scored, reference {len(ref_lls)}")
            continue
        for k, (a, b) in enumerate(zip(g["lls"], ref_lls)):
            diff = abs(a - b)
            if diff > max_diff or max_where is None:
                max_diff, max_where = diff, (d, k)
            if not diff <= tol:  # also catches NaN
                problems.append(
                    f"item {d} choice {k} ({it['choices'][k]!r}): loglikelihood {a:.6f}, "
                    f"reference {b:.6f}, |diff| {diff:.6f} > tol {tol}"
                )
        for k, (a, b) in enumerate(zip(g["greedy"], ref_greedy)):
            if a != b:
                greedy_diffs += 1
                if check_greedy:
                    problems.append(f"item {d} choice {k}: is_greedy {a}, reference {b}")
        for norm, key, mkey in ((False, "pred_acc", "margin_acc"), (True, "pred_acc_norm", "margin_acc_norm")):
            pred = choice_index(g["lls"], it["choices"], norm)
            if pred != it[key]:
                name = "acc_norm" if norm else "acc"
                problems.append(
                    f"item {d} ({it['question']!r}): {name} chose {pred} "
                    f"({it['choices'][pred]!r}), reference chose {it[key]} "
                    f"({it['choices'][it[key]]!r}); reference margin {it[mkey]:.4f}"
                )
    for m in ("acc", "acc_norm"):
        if abs(got[m] - ref[m]) > 1e-9:
            problems.append(f"{m}: {got[m]:.4f}, reference {ref[m]:.4f}")
    stats = {"max_abs_diff": max_diff, "max_where": max_where, "greedy_diffs": greedy_diffs}
    return problems, stats


def got_from_samples(results):
    """Extract per-item scores from lm_eval's results dict (log_samples=True)."""
    samples = results["samples"]["strata_mc"]
    items = {}
    for s in samples:
        resps = s["filtered_resps"]
        items[s["doc_id"]] = {
            "lls": [float(r[0]) for r in resps],
            "greedy": [r[1] in (True, "True") for r in resps],
        }
    r = results["results"]["strata_mc"]
    return {"acc": float(r["acc,none"]), "acc_norm": float(r["acc_norm,none"]), "items": items}


def got_from_reference(ref):
    """The reference in the shape of a run (for --self-test)."""
    items = {
        it["doc_id"]: {
            "lls": [c["loglikelihood"] for c in it["choices_scored"]],
            "greedy": [c["is_greedy"] for c in it["choices_scored"]],
        }
        for it in ref["items"]
    }
    return {"acc": ref["acc"], "acc_norm": ref["acc_norm"], "items": items}


# ---------------------------------------------------------------- tokenizer


def build_tokenizer_dir(gguf_path, out_dir):
    """A HF tokenizer directory for the GGUF. Returns a description of how."""
    try:
        import torch  # noqa: F401  (transformers' GGUF reader needs it)
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
        )
        tok.save_pretrained(out_dir)
        return "transformers' GGUF loader"
    except ImportError:
        pass
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    r = gguf.GGUFReader(gguf_path)

    def field(name, default=None):
        f = r.fields.get(name)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise RuntimeError(f"tokenizer.ggml.model is {kind!r}; only gpt2 (byte-level BPE) is built here")
    tokens = field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in field("tokenizer.ggml.merges")]
    types = field("tokenizer.ggml.token_type")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tk = Tokenizer(bpe)
    # What transformers' GGUF converter builds for a gpt2 vocabulary (checked against it
    # for SmolLM2: identical tokenizer.json model and added tokens).
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tk.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tk.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    tk.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    )
    os.makedirs(out_dir, exist_ok=True)
    tk.save(os.path.join(out_dir, "tokenizer.json"))

    def name(key):
        i = field(key)
        return None if i is None else tokens[int(i)]

    cfg = {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "model_max_length": 1000000000000000019884624838656,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2)
    return "gguf + tokenizers (no torch)"


def check_tokenizer(tok_dir, ref):
    """The tokenizer must give the reference's context / continuation ids (lm_eval's
    TemplateLM._encode_pair, no special tokens). Returns a list of mismatches."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    bad = []

    def enc(s):
        return tok(s, add_special_tokens=False).input_ids

    for it in ref["items"]:
        for c in it["choices_scored"]:
            context = "Question: " + it["question"] + "\nAnswer:"
            whole, ctx = enc(context + c["continuation"]), enc(context)
            if ctx != c["context_token_ids"] or whole[len(ctx):] != c["continuation_token_ids"]:
                bad.append(f"item {it['doc_id']} {c['continuation']!r}")
    return bad


# ---------------------------------------------------------------- server


def completions_url(base):
    base = base.rstrip("/")
    if base.endswith("/v1/completions"):
        return base
    if base.endswith("/v1"):
        return base + "/completions"
    return base + "/v1/completions"


def served_model(url):
    models_url = url[: -len("/completions")] + "/models"
    try:
        with urllib.request.urlopen(models_url, timeout=30) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as e:
        die(2, f"cannot read {models_url}: {e} (is the server up? or pass --model-name)")
    try:
        return data["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        die(2, f"{models_url} answered without data[0].id: {str(data)[:200]}")


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="server root, .../v1 or .../v1/completions")
    ap.add_argument("--model-name", help="the `model` field to send (default: /v1/models' first id)")
    ap.add_argument("--tokenizer-dir", help="HF tokenizer directory (default: built from --gguf)")
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="model file, to build the tokenizer from")
    ap.add_argument("--reference", default=DEFAULT_REF)
    ap.add_argument("--tol", type=float, default=0.02, help="per-choice |loglikelihood diff| in nats")
    ap.add_argument("--check-greedy", action="store_true", help="also require equal is_greedy")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per request")
    ap.add_argument("--output", help="write the run's per-item scores as JSON here")
    ap.add_argument(
        "--self-test",
        action="store_true",
        help="compare the reference with itself and with planted mismatches; no server",
    )
    args = ap.parse_args()

    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"lm_eval_compare: skipped: lm_eval or transformers is not importable ({e})")
        sys.exit(SKIP)

    with open(args.reference) as f:
        ref = json.load(f)
    import hashlib

    with open(os.path.join(REPO, TASK_DIR, "strata_mc.jsonl"), "rb") as f:
        items_sha = hashlib.sha256(f.read()).hexdigest()
    if ref["header"].get("items_sha256") not in (None, items_sha):
        die(2, f"{TASK_DIR}/strata_mc.jsonl is not the file {args.reference} was made from "
               "(items_sha256 differs): regenerate the reference")

    if args.self_test:
        self_test(ref, args.tol)
        return
    if not args.base_url:
        die(2, "--base-url is required (or --self-test)")

    url = completions_url(args.base_url)
    model_name = args.model_name or served_model(url)

    tmp = None
    tok_dir = args.tokenizer_dir
    if tok_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="strata-lmeval-tok-")
        tok_dir = tmp.name
        try:
            how = build_tokenizer_dir(args.gguf, tok_dir)
        except Exception as e:  # noqa: BLE001
            die(2, f"cannot build a tokenizer from {args.gguf}: {e!r} (pass --tokenizer-dir)")
        print(f"lm_eval_compare: tokenizer built from the GGUF with {how}", file=sys.stderr)
    bad = check_tokenizer(tok_dir, ref)
    if bad:
        die(2, f"tokenizer {tok_dir} does not reproduce the reference token ids for "
               f"{len(bad)} requests, e.g. {bad[:3]}")

    import lm_eval
    from lm_eval.tasks import TaskManager

    os.chdir(REPO)  # the task's data_files path is relative to the repository root
    model_args = {
        "base_url": url,
        "model": model_name,
        "tokenizer": tok_dir,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 2,
        "max_length": 2048,
        "timeout": args.timeout,
    }
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["strata_mc"],
            task_manager=TaskManager(include_path=os.path.join(REPO, TASK_DIR)),
            batch_size=1,
            log_samples=True,
            bootstrap_iters=0,
        )
    except Exception as e:  # noqa: BLE001
        die(2, f"lm_eval failed against {url}: {type(e).__name__}: {e}")
    if results is None:
        die(2, "lm_eval returned no results")
    got = got_from_samples(results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(got, f, indent=1)

    problems, st = compare(ref, got, args.tol, args.check_greedy)
    if problems:
        print(f"lm_eval_compare: {len(problems)} mismatch(es) against {args.reference}:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        print(
            f"lm_eval_compare: FAIL acc {got['acc']:.4f} (ref {ref['acc']:.4f}), acc_norm "
            f"{got['acc_norm']:.4f} (ref {ref['acc_norm']:.4f}), max |dll| {st['max_abs_diff']:.6f}",
            file=sys.stderr,
        )
        sys.exit(1)
    print(
        f"lm_eval_compare: OK strata_mc {len(got['items'])} items: acc {got['acc']:.4f} acc_norm "
        f"{got['acc_norm']:.4f} equal to HF reference; per-item choices equal; max |loglikelihood "
        f"diff| {st['max_abs_diff']:.6f} nats (item {st['max_where'][0]} choice {st['max_where'][1]}, "
        f"tol {args.tol}); is_greedy differs on {st['greedy_diffs']} of {4 * len(got['items'])}"
    )


def self_test(ref, tol):
    """The comparison logic against the reference itself and planted mismatches."""
    got = got_from_reference(ref)
    problems, st = compare(ref, got, tol)
    assert not problems and st["max_abs_diff"] == 0.0, problems
    for it in ref["items"]:  # the stored preds are lm_eval's, recomputed the same way
        lls = [c["loglikelihood"] for c in it["choices_scored"]]
        assert choice_index(lls, it["choices"], False) == it["pred_acc"]
        assert choice_index(lls, it["choices"], True) == it["pred_acc_norm"]
    # Within tolerance: no problem.
    g = got_from_reference(ref)
    g["items"][0]["lls"][0] += tol / 2
    assert not compare(ref, g, tol)[0]
    # Beyond tolerance on a non-chosen choice: one problem, choices unchanged.
    g = got_from_reference(ref)
    it = ref["items"][0]
    loser = next(k for k in range(4) if k not in (it["pred_acc"], it["pred_acc_norm"]))
    g["items"][0]["lls"][loser] -= 1.0
    p = compare(ref, g, tol)[0]
    assert len(p) == 1 and "choice" in p[0], p
    # A flipped choice (and so a different acc): caught.
    g = got_from_reference(ref)
    it = ref["items"][0]
    other = (it["pred_acc"] + 1) % 4
    g["items"][0]["lls"][other] = max(g["items"][0]["lls"]) + 5.0
    p = compare(ref, g, tol)[0]
    assert any("acc chose" in x for x in p), p
    # A missing item: caught.
    g = got_from_reference(ref)
    del g["items"][ref["items"][-1]["doc_id"]]
    assert compare(ref, g, tol)[0]
    print(f"lm_eval_compare: self-test OK ({len(ref['items'])} items, acc {ref['acc']}, acc_norm {ref['acc_norm']})")


if __name__ == "__main__":
    main()
