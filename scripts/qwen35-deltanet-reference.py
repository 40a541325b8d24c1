#!/usr/bin/env python3
"""transformers' own Gated DeltaNet pieces (Qwen3.5, transformers 5.x's modeling_qwen3_5)
on small random inputs: the independent reference src/model/delta_net.rs is tested
against. Records the recurrent gated delta rule (token by token, from a random initial
state, q/k L2-normalised in the kernel as Qwen3.5 calls it), the chunked form of the same
(prefill's), the depthwise causal conv1d + SiLU over a sequence and one decode step from
its state, and RMSNormGated.

    python3 scripts/qwen35-deltanet-reference.py tests/data/qwen3_5/deltanet_reference.json
"""
import json
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

torch.manual_seed(35)
T, NK, NV, DK, DV, KERNEL = 40, 2, 4, 8, 6, 4
q = torch.randn(1, T, NK, DK)
k = torch.randn(1, T, NK, DK)
v = torch.randn(1, T, NV, DV)
a = torch.randn(1, T, NV)
b = torch.randn(1, T, NV)
A_log = torch.log(torch.empty(NV).uniform_(0.5, 8))
dt_bias = torch.randn(NV) * 0.5
beta = b.sigmoid()
g = -A_log.exp() * F.softplus(a + dt_bias)
s0 = torch.randn(1, NV, DK, DV) * 0.3
out, state = m.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
chunk_out, chunk_state = m.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)

C = 2 * NK * DK + NV * DV  # the conv's channels: q, k and v
x = torch.randn(1, C, T)
w = torch.randn(C, KERNEL) * 0.5
conv = m.causal_conv1d_fn(x, w, None, activation="silu")  # [1, C, T]
conv_state = x[:, :, -(KERNEL - 1):].clone()  # the tail a decode step continues from
x_next = torch.randn(1, C, 1)
conv_next = m.causal_conv1d_update(x_next, conv_state, w, None, activation="silu")  # also updates the state

norm = m.Qwen3_5RMSNormGated(DV, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(DV) * 0.5 + 1)
hx, hz = torch.randn(5, DV), torch.randn(5, DV)
normed = norm(hx, hz)

flat = lambda t: [round(float(x), 8) for x in t.reshape(-1)]
ref = {
    "what": "transformers' modeling_qwen3_5 Gated DeltaNet functions on random inputs",
    "command": "python3 scripts/qwen35-deltanet-reference.py tests/data/qwen3_5/deltanet_reference.json",
    "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    "shape": {"tokens": T, "k_heads": NK, "v_heads": NV, "dk": DK, "dv": DV, "kernel": KERNEL},
    "delta": {
        "q": flat(q), "k": flat(k), "v": flat(v),   # [T, heads, d]
        "g": flat(g), "beta": flat(beta),           # [T, v_heads]
        "a": flat(a), "b": flat(b), "A_log": flat(A_log), "dt_bias": flat(dt_bias),
        "state0": flat(s0),                         # [v_heads, dk, dv]
        "out": flat(out), "state": flat(state),     # [T, v_heads, dv], [v_heads, dk, dv]
        "chunk_out": flat(chunk_out), "chunk_state": flat(chunk_state),
    },
    "conv": {
        "x": flat(x[0].T), "w": flat(w),            # x as [T, C]; w [C, kernel]
        "out": flat(conv[0].T),                     # [T, C]
        "x_next": flat(x_next[0, :, 0]), "out_next": flat(conv_next[0, :, 0]),
        "state_next": flat(conv_state[0].T),        # [kernel - 1, C] after the step
    },
    "gated_norm": {"x": flat(hx), "z": flat(hz), "w": flat(norm.weight.detach()), "out": flat(normed.detach())},
}
json.dump(ref, open(sys.argv[1], "w"))
print("max |recurrent - chunked|", float((out - chunk_out).abs().max()))
