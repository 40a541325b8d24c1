#!/usr/bin/env python3
"""The tiny random gpt-oss (tests/data/gpt_oss/tiny_random) as GGUF files in llama.cpp's
layout, as its `convert_hf_to_gguf.py` (GptOssModel) writes a gpt-oss checkpoint:

    OUT/gpt-oss-tiny.bf16.gguf    every matrix bf16 as stored (experts split into
                                  ffn_{gate,up,down}_exps, transposed to [out, in]),
                                  1-D tensors f32
    OUT/gpt-oss-tiny.f32.gguf     the same values, every matrix f32 (so llama.cpp's CPU
                                  matmuls do not round the activations to bf16)
    OUT/gpt-oss-tiny.mxfp4.gguf   the same with the experts quantized to MXFP4 by gguf-py
                                  (as the released gpt-oss GGUFs store them)

Deterministic (the same bytes every run: their SHA-256 is printed, one line per file),
so llama.cpp's logits recorded on them (scripts/gptoss-llamacpp-reference.py) apply to
the files tests/gpt_oss.rs rebuilds. Needs only numpy and gguf (pip install gguf).

Written with gguf-py rather than by running convert_hf_to_gguf.py itself: that script
needs a recognised tokenizer and transformers 4.x's `rope_scaling`/`rope_theta` keys,
which this transformers-5 checkpoint does not have. llama.cpp reading these files and
matching transformers' logits (docs/models.md) is what checks the layout.

    python3 scripts/gptoss-gguf.py OUT
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

from gguf_fixtures import add_byte_level_vocab, f32, read_safetensors

SRC = Path(__file__).resolve().parent.parent / "tests/data/gpt_oss/tiny_random"


def write(out_path, cfg, tensors, kind):
    w = gguf.GGUFWriter(str(out_path), "gpt-oss")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    add_byte_level_vocab(w, cfg, "gpt-4o")  # gpt-oss's pre-tokenizer (o200k)

    def mat(name, x):
        if x.dtype == np.uint16 and kind != "f32":
            w.add_tensor(name, x.copy(), raw_shape=x.shape, raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, f32(x))

    def experts(name, x):  # x: [E, out, in] f32
        if kind == "f32":
            w.add_tensor(name, x)
        elif kind == "mxfp4":
            q = gguf.quants.quantize(x, Q.MXFP4)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=Q.MXFP4)
        else:
            bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # exact: the values are bf16
            w.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=Q.BF16)

    t = {k: v[2] for k, v in tensors.items()}
    mat("token_embd.weight", t["model.embed_tokens.weight"])
    mat("output_norm.weight", f32(t["model.norm.weight"]))
    mat("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        mat(b + "attn_norm.weight", f32(t[p + "input_layernorm.weight"]))
        mat(b + "post_attention_norm.weight", f32(t[p + "post_attention_layernorm.weight"]))
        for hf, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
            mat(b + g + ".weight", t[p + f"self_attn.{hf}.weight"])
            mat(b + g + ".bias", f32(t[p + f"self_attn.{hf}.bias"]))
        mat(b + "attn_sinks.weight", f32(t[p + "self_attn.sinks"]))
        mat(b + "ffn_gate_inp.weight", t[p + "mlp.router.weight"])
        mat(b + "ffn_gate_inp.bias", f32(t[p + "mlp.router.bias"]))
        gu = f32(t[p + "mlp.experts.gate_up_proj"]).transpose(0, 2, 1)  # [E, 2 inter, hidden]
        gub = f32(t[p + "mlp.experts.gate_up_proj_bias"])  # [E, 2 inter]
        experts(b + "ffn_gate_exps.weight", np.ascontiguousarray(gu[:, ::2, :]))
        experts(b + "ffn_up_exps.weight", np.ascontiguousarray(gu[:, 1::2, :]))
        mat(b + "ffn_gate_exps.bias", np.ascontiguousarray(gub[:, ::2]))
        mat(b + "ffn_up_exps.bias", np.ascontiguousarray(gub[:, 1::2]))
        down = f32(t[p + "mlp.experts.down_proj"]).transpose(0, 2, 1)  # [E, hidden, inter]
        experts(b + "ffn_down_exps.weight", np.ascontiguousarray(down))
        mat(b + "ffn_down_exps.bias", f32(t[p + "mlp.experts.down_proj_bias"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((SRC / "config.json").read_text())
    tensors = read_safetensors(SRC / "model.safetensors")
    for kind in ["bf16", "f32", "mxfp4"]:
        path = out / f"gpt-oss-tiny.{kind}.gguf"
        write(path, cfg, tensors, kind)
        print(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}")


main()
