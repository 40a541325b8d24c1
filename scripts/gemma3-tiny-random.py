#!/usr/bin/env python3
"""A tiny random Gemma 3 made by Hugging Face transformers, and transformers' own f32
forward on it: the independent reference tests/gemma3.rs checks strata's Gemma 3 port
(Hugging Face safetensors path) against.

Real layer pattern (12 layers, sliding window on 5 of every 6, layers 5 and 11 full),
GQA (4 query heads, 2 KV heads), a window of 16 tokens (the 100-token prompt crosses it
six times), query_pre_attn_scalar 24 (not head_dim: the scale is exercised), linear RoPE
scaling on the full layers only, every weight (norms included) random, rounded to bf16 and
saved as bf16 (transformers computes in f32 on the upcast values).

    python scripts/gemma3-tiny-random.py tests/data/gemma3/tiny_random
"""
import json
import sys

import torch
import transformers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

out = sys.argv[1]
torch.manual_seed(58)
cfg = Gemma3TextConfig(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    sliding_window=16,
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=True,
    attn_implementation="eager",
)
model = Gemma3ForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        scale = 0.5 if "norm" in name else 0.2
        p.copy_((torch.randn_like(p) * scale).to(torch.bfloat16).to(torch.float32))
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
model = Gemma3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32, attn_implementation="eager").eval()

g = torch.Generator().manual_seed(7)
prompt = [2] + torch.randint(3, 512, (99,), generator=g).tolist()
with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0]  # [100, vocab]
    ids = torch.tensor([prompt])
    greedy = []
    for _ in range(20):
        nxt = int(model(ids).logits[0, -1].argmax())
        greedy.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
ref = {
    "what": "transformers' own Gemma3ForCausalLM f32 forward (eager) on this random checkpoint",
    "command": "python scripts/gemma3-tiny-random.py tests/data/gemma3/tiny_random",
    "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    "prompt_ids": prompt,
    "logits_rows": [0, 15, 16, 17, 50, 99],
    "logits": [logits[r].tolist() for r in [0, 15, 16, 17, 50, 99]],
    "greedy_ids": greedy,
}
json.dump(ref, open(f"{out}/reference.json", "w"))
print(cfg.layer_types, greedy)
