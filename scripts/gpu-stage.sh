#!/usr/bin/env bash
# Prepares what a GPU session carries (docs/cuda.md, "What a GPU session must check first"):
# the release binaries stripped and gzipped into target/gpu/, and the default model split
# in two, target/model-part-1/part.aa and target/model-part-2/part.ab (with the model's
# SHA-256), one per call, because the device tool carries at most 64 MiB a call and the
# model is 94 MiB. Run here, after `cargo build
# --release` (no `cargo test` in between: that build links the stream-ordering checker in).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[[ -f "$model" ]] || { echo "gpu-stage: no model file $model (models/fetch.sh)" >&2; exit 2; }
rm -rf target/gpu target/model-part-1 target/model-part-2
mkdir -p target/gpu target/model-part-1 target/model-part-2
for b in strata strata-gpucheck needle; do
    [[ -x target/release/$b ]] || { echo "gpu-stage: build first: cargo build --release" >&2; exit 2; }
    strip -o "target/gpu/$b" "target/release/$b"
    gzip -9 "target/gpu/$b"
done
split -b 47M "$model" target/model-part-1/part.
[[ ! -e target/model-part-1/part.ac ]] || { echo "gpu-stage: the model needs more than two parts" >&2; exit 2; }
mv target/model-part-1/part.ab target/model-part-2/
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") >target/model-part-2/SHA256
du -b target/gpu/* target/model-part-1/* target/model-part-2/*
