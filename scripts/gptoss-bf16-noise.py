# transformers' own bf16 forward vs its f32 forward on the tiny random gpt-oss checkpoint:
# the noise floor a bf16 implementation (strata's CUDA model) is measured against.
import torch, numpy as np
from transformers import AutoModelForCausalLM
import os
d = os.path.join(os.path.dirname(__file__), "..", "tests/data/gpt_oss/tiny_random")
m32 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
m16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
for seed in [7, 8, 9]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (1, 304), generator=g)
    with torch.no_grad():
        a = m32(ids).logits[0, 299:].float()
        b = m16(ids).logits[0, 299:].float()
    for p in range(a.shape[0]):
        d_ = b[p] - a[p]
        rr = (d_.pow(2).mean().sqrt() / a[p].pow(2).mean().sqrt()).item()
        rm = (d_.abs().max() / a[p].abs().max()).item()
        print(f"seed {seed} pos {299+p}: rel rms {rr:.4f} rel max {rm:.4f} argmax eq {bool(a[p].argmax()==b[p].argmax())}")
