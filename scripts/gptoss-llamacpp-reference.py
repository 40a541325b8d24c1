#!/usr/bin/env python3
"""llama.cpp's logits on the tiny random gpt-oss as GGUF (scripts/gptoss-gguf.py), the
independent reference tests/gpt_oss.rs checks strata's GGUF path against.

llama.cpp 0.3.16's bundled build (llama-cpp-python, built from source with native flags,
AMX off), CPU, f32 KV cache, flash attention off; the f32 file (every matrix f32, so
llama.cpp's matmuls keep f32 activations) and the MXFP4 file. Records, for the prompt of
tests/data/gpt_oss/tiny_random/reference.json, the logits at its rows and 64 greedy
tokens, with each file's SHA-256 (the test checks it rebuilt the same bytes).

    python3 scripts/gptoss-gguf.py /tmp/oss && \\
    python3 scripts/gptoss-llamacpp-reference.py /tmp/oss tests/data/gpt_oss/llamacpp_reference.json
"""
import json
import sys
from pathlib import Path

import llama_cpp

from gguf_fixtures import llama_cpp_run

gguf_dir, out = Path(sys.argv[1]), sys.argv[2]
root = Path(__file__).resolve().parent.parent
hf = json.loads((root / "tests/data/gpt_oss/tiny_random/reference.json").read_text())
prompt, rows = hf["prompt_ids"], hf["logits_rows"]
ref = {
    "what": "llama.cpp (llama-cpp-python 0.3.16's build, CPU, f32 KV, no flash attention) on scripts/gptoss-gguf.py's files",
    "command": "python3 scripts/gptoss-llamacpp-reference.py OUT tests/data/gpt_oss/llamacpp_reference.json",
    "versions": {"llama_cpp_python": llama_cpp.__version__},
    "prompt_ids": prompt,
    "logits_rows": rows,
    "files": {},
}
for kind in ["f32", "mxfp4"]:
    ref["files"][kind] = llama_cpp_run(gguf_dir / f"gpt-oss-tiny.{kind}.gguf", prompt, rows)
json.dump(ref, open(out, "w"))
print({k: v["greedy_ids"][:10] for k, v in ref["files"].items()})
