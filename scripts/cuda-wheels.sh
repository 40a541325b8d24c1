#!/usr/bin/env bash
# Installs PyPI's CUDA 13.0 wheels into .cuda/ (git-ignored): NVRTC and its builtins, the
# runtime headers, and with --nvcc the nvcc wheel (ptxas, for scripts/kernel-report.sh).
# Idempotent: a stamp file records what is installed, so a second run costs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=("nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*")
[[ "${1:-}" == "--nvcc" ]] && pkgs+=("nvidia-cuda-nvcc==13.0.*")
stamp=.cuda/.installed  # one installed requirement per line
missing=()
for p in "${pkgs[@]}"; do
    grep -qxF "$p" "$stamp" 2>/dev/null || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --upgrade --target .cuda "${pkgs[@]}"
ls .cuda/nvidia/*/lib/libnvrtc.so.* >/dev/null
printf '%s\n' "${pkgs[@]}" > "$stamp"
echo "cuda-wheels: installed ${pkgs[*]} into .cuda/"
