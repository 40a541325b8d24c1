#!/usr/bin/env python3
"""A tiny random Qwen3.5 (dense) made by Hugging Face transformers, and transformers' own
f32 forward on it: the independent reference for strata's Qwen3.5 port (its state kind).

Qwen3.5's layer pattern (three Gated DeltaNet layers, then one gated full-attention
layer, twice), its attention head counts (16 query heads, 4 KV heads; head_dim 64 here),
its linear-attention head counts (16 key heads, 32 value heads; 16 wide here), partial
RoPE (a quarter of each head), zero-centred norms; hidden size 64. Every weight random
(norms, A_log, dt_bias and the conv included), rounded to bf16 and saved as bf16.

    python scripts/qwen35-tiny-random.py tests/data/qwen3_5/tiny_random
    python scripts/qwen35-tiny-random.py tests/data/qwen3_5/tiny_random_moe --moe

`--moe`: Qwen3.5 MoE (`Qwen3_5MoeForCausalLM`) at the same shape, every layer's MLP a
router over 16 experts (4 per token, 32 wide) plus a gated shared expert (48 wide).
"""
import json
import sys

import torch
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

out = sys.argv[1]
moe = "--moe" in sys.argv[2:]
if moe:
    from transformers import Qwen3_5MoeForCausalLM as Qwen3_5ForCausalLM
    from transformers import Qwen3_5MoeTextConfig as Qwen3_5TextConfig
    extra = dict(
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
else:
    extra = dict(intermediate_size=128)
torch.manual_seed(35)
cfg = Qwen3_5TextConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
    attn_implementation="eager",
    **extra,
)
model = Qwen3_5ForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        scale = 0.3 if ("norm" in name or "A_log" in name or "dt_bias" in name) else 0.2
        p.copy_((torch.randn_like(p) * scale).to(torch.bfloat16).to(torch.float32))
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
model = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()

g = torch.Generator().manual_seed(7)
prompt = [2] + torch.randint(3, 512, (99,), generator=g).tolist()
rows = list(range(0, 100, 8)) + [99]
with torch.no_grad():
    logits = model(torch.tensor([prompt])).logits[0]
    ids = torch.tensor([prompt])
    greedy = []
    for _ in range(64):
        nxt = int(model(ids).logits[0, -1].argmax())
        greedy.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
r6 = lambda xs: [round(float(x), 6) for x in xs]
ref = {
    "what": f"transformers' own {type(model).__name__} f32 forward (eager; the torch reference Gated DeltaNet) on this random checkpoint",
    "command": "python scripts/qwen35-tiny-random.py " + " ".join(sys.argv[1:]),
    "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    "prompt_ids": prompt,
    "logits_rows": rows,
    "logits": [r6(logits[r]) for r in rows],
    "greedy_ids": greedy,
}
json.dump(ref, open(f"{out}/reference.json", "w"))
print(cfg.layer_types, greedy[:16])
