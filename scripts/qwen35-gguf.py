#!/usr/bin/env python3
"""The tiny random Qwen3.5 checkpoints (tests/data/qwen3_5/tiny_random and tiny_random_moe)
as GGUF files in llama.cpp's `qwen35` / `qwen35moe` layout, as its converter
(`conversion/qwen.py`: Qwen3_5TextModel, Qwen3_5MoeTextModel) writes a Qwen3.5 checkpoint:

- norms stored as `1 + w` (the zero-centred HF norms made plain), but not the gated norm
  of the state layers (`ssm_norm`, already plain);
- `ssm_a` = −exp(A_log); `dt_bias` as `ssm_dt.bias`; the conv kernel squeezed to
  `[channels, kernel]`;
- value heads reordered from grouped by key head (HF: `[K0: v0 v1 | K1: v0 v1 | ...]`) to
  tiled (`[K0 K1 ... | K0 K1 ...]`) in `attn_qkv`'s V rows, `attn_gate`, `ssm_beta`,
  `ssm_alpha`, `ssm_a`, `ssm_dt`, the conv's V channels and `ssm_out`'s columns, as
  `_LinearAttentionVReorderBase` does (so ggml can broadcast key heads);
- the full layers' `attn_q` kept as HF's `[q | gate]` per head; experts stacked into
  `ffn_{gate,up,down}_exps`, the shared expert as `ffn_*_shexp` and its gate
  `ffn_gate_inp_shexp` `[hidden]`;
- the dense file also carries a multi-token-prediction block after the model's own, as
  the converter writes a real Qwen3.5's `mtp.*` (`block_count` counts it,
  `nextn_predict_layers` = 1, `attention.recurrent_layers` has an entry for it): its
  weights made up here (transformers' model has none), so a reader that ran it as a layer
  would give other logits.

    OUT/qwen35-tiny.f32.gguf       every tensor f32 (llama.cpp's matmuls keep f32 activations)
    OUT/qwen35moe-tiny.f32.gguf    the MoE checkpoint, likewise

f32 only: these random checkpoints are chaotic under small weight changes (Q8_0 weights
alone, llama.cpp's or strata's reading of them, move transformers' logits by 2.6 on the
dense one and 4.5 on the MoE one; its embedding alone by 1.5), so a quantized file would
compare nothing but that noise. Reading quantized blocks is tested format by format
(src/model/weights.rs, tests/gguf_models.rs, tests/gguf_iq4.rs).

Deterministic (the same bytes every run; one `name sha256` line per file), so llama.cpp's
logits recorded on them (scripts/qwen35-llamacpp-reference.py) apply to the files
tests/qwen3_5.rs rebuilds. Needs numpy and gguf (pip install gguf); written with gguf-py
rather than by running the converter, which needs a recognised tokenizer.

    python3 scripts/qwen35-gguf.py OUT
"""
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import gguf

from gguf_fixtures import add_byte_level_vocab, f32, read_safetensors

DATA = Path(__file__).resolve().parent.parent / "tests/data/qwen3_5"


def tiled(x, axis, k_heads, per_k, width):
    """Value heads along `axis` (`k_heads · per_k` heads of `width`) from grouped by key
    head to tiled order (llama.cpp's `_reorder_v_heads`)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(k_heads, per_k, width, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
    return np.moveaxis(np.ascontiguousarray(x).reshape(k_heads * per_k * width, *rest), 0, axis)


def write(out_path, cfg, t):
    moe = "num_experts" in cfg
    arch = "qwen35moe" if moe else "qwen35"
    n_layers = cfg["num_hidden_layers"]
    mtp = 0 if moe else 1
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_k = vh // kh
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(n_layers + mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(kh)
    w.add_ssm_time_step_rank(vh)
    w.add_ssm_inner_size(dv * vh)
    w.add_full_attention_interval(4)
    # What the converter writes from `layer_types` (gguf-py 0.19 has no helper for it yet).
    recurrent = [t == "linear_attention" for t in cfg["layer_types"]] + [False] * mtp
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", mtp)
    if moe:
        w.add_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
    add_byte_level_vocab(w, cfg, "qwen35")
    # ChatML, the frame of Qwen's templates (the real one adds thinking and tools).
    w.add_chat_template(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )

    def vec(name, x):
        w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))

    mat = vec

    mat("token_embd.weight", t["model.embed_tokens.weight"])
    vec("output_norm.weight", 1 + t["model.norm.weight"])
    mat("output.weight", t["lm_head.weight"])
    for i, layer_type in enumerate(cfg["layer_types"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        vec(b + "attn_norm.weight", 1 + t[p + "input_layernorm.weight"])
        vec(b + "post_attention_norm.weight", 1 + t[p + "post_attention_layernorm.weight"])
        if layer_type == "linear_attention":
            la = p + "linear_attn."
            qkv = t[la + "in_proj_qkv.weight"]
            qk = 2 * kh * dk
            mat(b + "attn_qkv.weight", np.concatenate([qkv[:qk], tiled(qkv[qk:], 0, kh, per_k, dv)]))
            mat(b + "attn_gate.weight", tiled(t[la + "in_proj_z.weight"], 0, kh, per_k, dv))
            mat(b + "ssm_beta.weight", tiled(t[la + "in_proj_b.weight"], 0, kh, per_k, 1))
            mat(b + "ssm_alpha.weight", tiled(t[la + "in_proj_a.weight"], 0, kh, per_k, 1))
            conv = t[la + "conv1d.weight"].squeeze(1)  # [channels, kernel]
            vec(b + "ssm_conv1d.weight", np.concatenate([conv[:qk], tiled(conv[qk:], 0, kh, per_k, dv)]))
            vec(b + "ssm_a", tiled(neg_exp(t[la + "A_log"]), 0, kh, per_k, 1))
            vec(b + "ssm_dt.bias", tiled(t[la + "dt_bias"], 0, kh, per_k, 1))
            vec(b + "ssm_norm.weight", t[la + "norm.weight"])
            mat(b + "ssm_out.weight", tiled(t[la + "out_proj.weight"], 1, kh, per_k, dv))
        else:
            sa = p + "self_attn."
            mat(b + "attn_q.weight", t[sa + "q_proj.weight"])
            mat(b + "attn_k.weight", t[sa + "k_proj.weight"])
            mat(b + "attn_v.weight", t[sa + "v_proj.weight"])
            mat(b + "attn_output.weight", t[sa + "o_proj.weight"])
            vec(b + "attn_q_norm.weight", 1 + t[sa + "q_norm.weight"])
            vec(b + "attn_k_norm.weight", 1 + t[sa + "k_norm.weight"])
        if moe:
            m = p + "mlp."
            mat(b + "ffn_gate_inp.weight", t[m + "gate.weight"])
            for hf, g in [("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")]:
                stacked = np.stack([t[f"{m}experts.{x}.{hf}.weight"] for x in range(cfg["num_experts"])])
                mat(f"{b}ffn_{g}_exps.weight", stacked)
                mat(f"{b}ffn_{g}_shexp.weight", t[f"{m}shared_expert.{hf}.weight"])
            vec(b + "ffn_gate_inp_shexp.weight", t[m + "shared_expert_gate.weight"].reshape(-1))
        else:
            for hf, g in [("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")]:
                mat(f"{b}ffn_{g}.weight", t[f"{p}mlp.{hf}.weight"])
    if mtp:
        write_mtp_block(vec, cfg, n_layers)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def neg_exp(x):
    """−exp(x) for f32 `x`, each through Python's `math.exp` in f64 then rounded to f32:
    numpy's vectorised exp may differ by an ulp between CPUs (its SIMD paths), and the
    bytes must not (the test checks their SHA-256)."""
    return np.array([-math.exp(float(v)) for v in x.reshape(-1)], dtype=np.float32).reshape(x.shape)


def write_mtp_block(add, cfg, i):
    """Block `i`: a full-attention layer with a dense MLP and the prediction head's
    `nextn.*` tensors, values a fixed formula (no RNG, so the bytes never change)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    inter = cfg["intermediate_size"]
    made = [0]

    def values(*shape):
        # Integers to exact f32 steps of 1/1024 in [-0.049, 0.049]: no transcendental.
        n = int(np.prod(shape))
        i = np.arange(made[0], made[0] + n, dtype=np.int64)
        made[0] += n
        return (((i * 37) % 101 - 50) / 1024).astype(np.float32).reshape(shape)

    b = f"blk.{i}."
    for name, shape in [
        ("attn_norm.weight", (h,)), ("post_attention_norm.weight", (h,)),
        ("attn_q.weight", (2 * q, h)), ("attn_k.weight", (kv, h)), ("attn_v.weight", (kv, h)),
        ("attn_output.weight", (h, q)), ("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,)),
        ("ffn_gate.weight", (inter, h)), ("ffn_up.weight", (inter, h)), ("ffn_down.weight", (h, inter)),
        ("nextn.eh_proj.weight", (h, 2 * h)), ("nextn.enorm.weight", (h,)),
        ("nextn.hnorm.weight", (h,)), ("nextn.shared_head_norm.weight", (h,)),
    ]:
        add(b + name, (1 + values(*shape)) if name.endswith("norm.weight") else values(*shape))


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for src, stem in [("tiny_random", "qwen35-tiny"), ("tiny_random_moe", "qwen35moe-tiny")]:
        cfg = json.loads((DATA / src / "config.json").read_text())
        raw = read_safetensors(DATA / src / "model.safetensors")
        tensors = {name: f32(x) for name, (_, _, x) in raw.items()}
        path = out / f"{stem}.f32.gguf"
        write(path, cfg, tensors)
        print(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}")


main()
