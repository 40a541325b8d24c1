#!/usr/bin/env python3
"""transformers' own gpt-oss forward with the experts as the MXFP4 GGUF holds them: the
f32 reference for strata's MXFP4 path (tests/gpt_oss.rs).

Loads tests/data/gpt_oss/tiny_random in f32, replaces every expert matrix and nothing
else with gguf-py's dequantization of the same tensor in scripts/gptoss-gguf.py's MXFP4
file (gate and up re-interleaved, transposed back to transformers' `x @ W` layout), and
records the logits at the prompt rows of tiny_random/reference.json and 64 greedy tokens,
with the file's SHA-256.

    python3 scripts/gptoss-gguf.py /tmp/oss && \\
    python3 scripts/gptoss-mxfp4-hf-reference.py /tmp/oss tests/data/gpt_oss/mxfp4_hf_reference.json
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import GptOssForCausalLM

gguf_dir, out = Path(sys.argv[1]), sys.argv[2]
root = Path(__file__).resolve().parent.parent
src = root / "tests/data/gpt_oss/tiny_random"
hf = json.loads((src / "reference.json").read_text())
path = gguf_dir / "gpt-oss-tiny.mxfp4.gguf"
reader = GGUFReader(str(path))
tensors = {t.name: t for t in reader.tensors}


def deq(name):
    t = tensors[name]
    shape = [int(d) for d in reversed(t.shape)]
    return torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))


model = GptOssForCausalLM.from_pretrained(
    src, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
).eval()
with torch.no_grad():
    for i, layer in enumerate(model.model.layers):
        gate, up = deq(f"blk.{i}.ffn_gate_exps.weight"), deq(f"blk.{i}.ffn_up_exps.weight")  # [E, inter, h]
        gu = torch.empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        gu[:, ::2], gu[:, 1::2] = gate, up
        layer.mlp.experts.gate_up_proj.copy_(gu.transpose(1, 2))  # [E, h, 2 inter]
        layer.mlp.experts.down_proj.copy_(deq(f"blk.{i}.ffn_down_exps.weight").transpose(1, 2))
prompt, rows = hf["prompt_ids"], hf["logits_rows"]
with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0]
    ids = torch.tensor([prompt])
    greedy = []
    for _ in range(64):
        nxt = int(model(ids).logits[0, -1].argmax())
        greedy.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
ref = {
    "what": "transformers' GptOssForCausalLM f32 forward (eager) with the experts dequantized from the MXFP4 GGUF by gguf-py",
    "command": "python3 scripts/gptoss-mxfp4-hf-reference.py OUT tests/data/gpt_oss/mxfp4_hf_reference.json",
    "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    "logits_rows": rows,
    "logits": [[round(float(x), 6) for x in logits[r]] for r in rows],
    "greedy_ids": greedy,
}
json.dump(ref, open(out, "w"))
print(greedy[:10])
