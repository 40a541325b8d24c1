"""Build tests/data/lm_eval/hf_reference.json from an `lm_eval --model hf` run.

Usage (full venv, from the strata repo root):
  python scripts/lm-eval-hf-reference.py /tmp/lmeval-hf "<the lm_eval command>"

Reads the results_*.json / samples_strata_mc_*.jsonl that lm_eval wrote, and
adds per-choice token ids (the same split lm_eval's TemplateLM._encode_pair
makes) and per-token continuation log-probs from a direct transformers
forward pass (for debugging token-level differences; the comparison uses
lm_eval's own numbers).
"""
import datetime, glob, json, math, os, platform, sys

import numpy as np
import torch
import transformers
import lm_eval
from importlib.metadata import version

out_dir, command = sys.argv[1], sys.argv[2]
res_path = sorted(glob.glob(os.path.join(out_dir, "*", "results_*.json")))[-1]
smp_path = sorted(glob.glob(os.path.join(out_dir, "*", "samples_strata_mc_*.jsonl")))[-1]
results = json.load(open(res_path))
samples = sorted((json.loads(l) for l in open(smp_path)), key=lambda s: s["doc_id"])

MODEL_DIR, GGUF = "models", "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF)
model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF, dtype=torch.float32)
model.eval()

def enc(s):
    return tok(s, add_special_tokens=False).input_ids

def encode_pair(context, continuation):  # lm_eval TemplateLM._encode_pair, causal
    n = len(context) - len(context.rstrip())
    if n > 0:
        continuation = context[-n:] + continuation
        context = context[:-n]
    whole, ctx = enc(context + continuation), enc(context)
    return ctx, whole[len(ctx):]

items, max_direct_diff = [], 0.0
for s in samples:
    doc = s["doc"]
    args = [s["arguments"][f"gen_args_{i}"] for i in range(len(doc["choices"]))]
    lls = [float(r[0][0]) for r in s["resps"]]
    greedy = [r[0][1] == "True" for r in s["resps"]]
    choices_out = []
    for a, ll, g in zip(args, lls, greedy):
        ctx, cont = encode_pair(a["arg_0"], a["arg_1"])
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        per_tok = [lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)]
        max_direct_diff = max(max_direct_diff, abs(sum(per_tok) - ll))
        choices_out.append({
            "continuation": a["arg_1"],
            "loglikelihood": ll,
            "is_greedy": g,
            "context_token_ids": ctx,
            "continuation_token_ids": cont,
            "continuation_token_logprobs_direct": per_tok,
        })
    lens = np.array([float(len(c)) for c in doc["choices"]])
    arr = np.array(lls)
    pred, pred_norm = int(np.argmax(arr)), int(np.argmax(arr / lens))
    def margin(v):
        v = sorted(v, reverse=True)
        return float(v[0] - v[1])
    items.append({
        "doc_id": s["doc_id"],
        "question": doc["question"],
        "choices": doc["choices"],
        "answer": doc["answer"],
        "pred_acc": pred,
        "pred_acc_norm": pred_norm,
        "acc": s["acc"],
        "acc_norm": s["acc_norm"],
        "margin_acc": margin(arr),
        "margin_acc_norm": margin(arr / lens),
        "choices_scored": choices_out,
    })
    assert (pred == doc["answer"]) == bool(s["acc"]) and (pred_norm == doc["answer"]) == bool(s["acc_norm"])

r = results["results"]["strata_mc"]
ref = {
    "header": {
        "what": "Independent reference for tests/lm_eval_compare.py: lm-evaluation-harness on HF transformers, "
                "task strata_mc (tests/data/lm_eval), model models/SmolLM2-135M-Instruct.Q4_1.gguf dequantized to f32 "
                "by transformers' GGUF loader.",
        "command": command,
        "cwd": "strata repository root",
        "lm_eval_version": version("lm_eval"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_py_version": version("gguf"),
        "datasets_version": version("datasets"),
        "python": platform.python_version(),
        "device": "cpu (2 cores), dtype float32, batch_size 1",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lm_eval_results_file_date": results.get("date"),
        "model_sha256_note": "see model_sha256",
        "bos": "no BOS: GGUF tokenizer.ggml.add_bos_token=false; HFLM and local-completions both encode without special tokens",
        "fields": {
            "loglikelihood": "lm_eval's per-choice log-likelihood (sum over continuation tokens), from samples resps",
            "is_greedy": "lm_eval's is_greedy (every continuation token is the argmax)",
            "pred_acc / pred_acc_norm": "argmax of loglikelihood, and of loglikelihood / len(choice text in chars), as lm_eval computes acc / acc_norm",
            "margin_acc / margin_acc_norm": "gap between best and second-best score; a small margin is where a legitimate numeric difference could flip a choice",
            "continuation_token_logprobs_direct": "per-token log-probs from a separate direct transformers forward pass (debugging aid)",
        },
        "max_abs_diff_direct_vs_lm_eval": max_direct_diff,
        "extraction_script": "scripts/lm-eval-hf-reference.py",
    },
    "task": "strata_mc",
    "n_items": len(items),
    "acc": r["acc,none"],
    "acc_norm": r["acc_norm,none"],
    "items": items,
}
import hashlib
h = hashlib.sha256()
with open(os.path.join(MODEL_DIR, GGUF), "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
ref["header"]["model_sha256"] = h.hexdigest()
ref["header"]["items_sha256"] = hashlib.sha256(open("tests/data/lm_eval/strata_mc.jsonl", "rb").read()).hexdigest()
ref["header"]["torch_note"] = ("PyPI's torch wheel (CUDA build, +cu130) run on CPU: the +cpu wheel is not on the "
                               "package mirror this machine reaches")
ref["header"]["min_margin_acc"] = min(i["margin_acc"] for i in items)
ref["header"]["min_margin_acc_norm"] = min(i["margin_acc_norm"] for i in items)
del ref["header"]["model_sha256_note"]
out = "tests/data/lm_eval/hf_reference.json"
with open(out, "w") as f:
    json.dump(ref, f, indent=1)
    f.write("\n")
print("acc", ref["acc"], "acc_norm", ref["acc_norm"], "max direct diff", max_direct_diff)
print("min margin acc", min(i["margin_acc"] for i in items), "min margin acc_norm", min(i["margin_acc_norm"] for i in items))
print(sorted((round(i["margin_acc"],4), i["doc_id"]) for i in items)[:5])
print(sorted((round(i["margin_acc_norm"],4), i["doc_id"]) for i in items)[:5])
