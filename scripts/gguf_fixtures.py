"""What the scripts that turn tests/data's tiny random checkpoints into GGUF files
(scripts/*-gguf.py), and record llama.cpp's logits on them (scripts/*-llamacpp-reference.py),
share: reading the checkpoint, the byte-level vocabulary the files carry, and one llama.cpp
run. Imported from the scripts' own folder (Python puts a script's folder on its path)."""
import hashlib
import json
import struct

import numpy as np


def read_safetensors(path):
    """name -> (dtype, shape, array); bf16 kept as its uint16 bits (`f32` widens it)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[8 + n + a : 8 + n + b]
        dt = {"BF16": np.uint16, "F32": np.float32}.get(t["dtype"])
        if dt is None:
            raise SystemExit(f"{name}: unexpected dtype {t['dtype']}")
        out[name] = (t["dtype"], t["shape"], np.frombuffer(raw, dtype=dt).reshape(t["shape"]))
    return out


def f32(x):
    """bf16 bits (uint16) or f32 -> f32."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def gguf_bytes():
    """GPT-2's byte-to-unicode alphabet (the byte-level BPE symbols), as code points."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return cs


def add_byte_level_vocab(w, cfg, pre):
    """A byte-level BPE vocabulary of the checkpoint's `vocab_size` ids (the tests feed ids
    directly): three control tokens, the 256 byte symbols, one merge, pads; `pre` the
    pre-tokenizer llama.cpp names; the config's BOS and EOS."""
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in sorted(gguf_bytes())] + ["ab"]
    tokens += [f"<pad{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def llama_cpp_run(path, prompt, rows):
    """llama.cpp on GGUF `path` (CPU, f32 KV, no flash attention, 2 threads): the file's
    SHA-256, the logits at `rows` of `prompt` and 64 greedy tokens after it."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, n_threads=2,
                type_k=0, type_v=0, flash_attn=False, verbose=False)
    llm.eval(prompt)
    scores = np.array(llm.scores[: len(prompt)])
    greedy = []
    for _ in range(64):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "logits": [[round(float(x), 6) for x in scores[r]] for r in rows],
        "greedy_ids": greedy,
    }
