#!/usr/bin/env python3
"""llama.cpp's logits on the tiny random Qwen3.5 checkpoints as GGUF (scripts/qwen35-gguf.py),
the independent reference tests/qwen3_5.rs checks strata's `qwen35` / `qwen35moe` GGUF path
against.

llama.cpp as bundled by llama-cpp-python 0.3.36 (built from source with native flags, AMX
off; its llama.cpp has `qwen35` / `qwen35moe`, 0.3.16 before it did not), CPU, f32 KV cache,
flash attention off, 2 threads. Records, for the prompt of each checkpoint's
reference.json, the logits at its rows and 64 greedy tokens, with each file's SHA-256
(the test checks it rebuilt the same bytes).

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
        pip install --no-deps --target /tmp/lcpp llama-cpp-python==0.3.36   # ~12 min on 2 cores
    python3 scripts/qwen35-gguf.py /tmp/q35 && PYTHONPATH=/tmp/lcpp \\
    python3 scripts/qwen35-llamacpp-reference.py /tmp/q35 tests/data/qwen3_5/llamacpp_reference.json
"""
import json
import sys
from pathlib import Path

import llama_cpp

from gguf_fixtures import llama_cpp_run

gguf_dir, out = Path(sys.argv[1]), sys.argv[2]
data = Path(__file__).resolve().parent.parent / "tests/data/qwen3_5"
ref = {
    "what": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}'s build, CPU, f32 KV, no flash attention) on scripts/qwen35-gguf.py's files",
    "command": "python3 scripts/qwen35-llamacpp-reference.py OUT tests/data/qwen3_5/llamacpp_reference.json",
    "versions": {"llama_cpp_python": llama_cpp.__version__},
    "files": {},
}
for stem, src in [("qwen35-tiny", "tiny_random"), ("qwen35moe-tiny", "tiny_random_moe")]:
    hf = json.loads((data / src / "reference.json").read_text())
    prompt, rows = hf["prompt_ids"], hf["logits_rows"]
    name = f"{stem}.f32.gguf"
    run = llama_cpp_run(gguf_dir / name, prompt, rows)
    ref["files"][name] = {"sha256": run["sha256"], "prompt_ids": prompt, "logits_rows": rows,
                          "logits": run["logits"], "greedy_ids": run["greedy_ids"]}
    print(name, run["greedy_ids"][:12], "hf greedy", hf["greedy_ids"][:12])
json.dump(ref, open(out, "w"))
