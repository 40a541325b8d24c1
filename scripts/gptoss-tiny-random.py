#!/usr/bin/env python3
"""A tiny random gpt-oss made by Hugging Face transformers, and transformers' own f32
forward on it: the independent reference tests/gpt_oss.rs checks strata's gpt-oss port
(Hugging Face safetensors path) against.

gpt-oss-20b's attention shape (64 query heads, 8 KV heads, head_dim 64) and its layer
pattern (sliding window on even layers, full attention on odd ones), attention sinks,
biases on q/k/v/o, its YaRN RoPE (factor 32 over 4,096 positions, base 150,000), 32
experts with 4 chosen per token and its clamped SwiGLU; hidden size 32, 4 layers, a
window of 32 tokens (the 200-token prompt crosses it six times). Every weight (norms,
sinks and biases included) random, rounded to bf16 and saved as bf16 (transformers
computes in f32 on the upcast values); the experts run transformers' eager loop.

    python scripts/gptoss-tiny-random.py tests/data/gpt_oss/tiny_random
"""
import json
import sys

import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

out = sys.argv[1]
torch.manual_seed(62)
cfg = GptOssConfig(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=32,
    max_position_embeddings=131072,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
    attn_implementation="eager",
    experts_implementation="eager",
)
model = GptOssForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + torch.randn_like(p) * 0.2)
        elif "sinks" in name:
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) * 0.2)
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
model = GptOssForCausalLM.from_pretrained(
    out, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
).eval()

g = torch.Generator().manual_seed(7)
prompt = [2] + torch.randint(3, 512, (199,), generator=g).tolist()
rows = list(range(0, 200, 8)) + [199]
with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0]  # [200, vocab]
    ids = torch.tensor([prompt])
    greedy, last = [], None
    for _ in range(64):
        last = model(ids).logits[0, -1]
        nxt = int(last.argmax())
        greedy.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
r6 = lambda xs: [round(float(x), 6) for x in xs]
ref = {
    "what": "transformers' own GptOssForCausalLM f32 forward (eager attention, eager experts) on this random checkpoint",
    "command": "python scripts/gptoss-tiny-random.py tests/data/gpt_oss/tiny_random",
    "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    "prompt_ids": prompt,
    "logits_rows": rows,
    "logits": [r6(logits[r]) for r in rows],
    "greedy_ids": greedy,
    # The logits the last greedy step chose from (position 262: 200 + 63 decoded tokens).
    "last_step_logits": r6(last),
}
json.dump(ref, open(f"{out}/reference.json", "w"))
print(cfg.layer_types, cfg.rope_parameters, greedy)
