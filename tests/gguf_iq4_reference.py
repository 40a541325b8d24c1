"""gguf-py's dequantization of every tensor of a GGUF file, as f32 bit patterns.

Run by tests/gguf_iq4.rs:
    python3 tests/gguf_iq4_reference.py FILE

gguf-py (llama.cpp's own Python package, `gguf.quants`, numpy) is an implementation of
ggml's formats that strata's was not derived from. Prints one JSON object: tensor name →
{"shape": outermost first, "bits": the dequantized values' f32 bits, row-major}. Exits 3
when gguf is missing.
"""

import json
import sys

try:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
except ImportError as e:
    print(f"gguf_iq4_reference.py: {e} (pip install gguf)")
    sys.exit(3)

reader = GGUFReader(sys.argv[1])
out = {}
for t in reader.tensors:
    values = dequantize(t.data, t.tensor_type).astype(np.float32)
    shape = [int(d) for d in reversed(t.shape)]
    out[t.name] = {"shape": shape, "bits": values.reshape(-1).view(np.uint32).tolist()}
print(json.dumps(out))
