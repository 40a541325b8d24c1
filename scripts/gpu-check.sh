#!/usr/bin/env bash
# GPU acceptance checks for a machine with an NVIDIA GPU (CUDA 13 driver, no cargo), run
# from a prebuilt binary. Prints one summary table; exits non-zero on any failure.
#   1. every kernel against its CPU twin on random inputs (`strata-gpucheck kernels`)
#   2. logits CUDA vs CPU                      3. offload (and sparse decode) equality on CUDA
#   4. pinned bandwidth sweep 64 KB..256 MB    5. offload benchmark at 4K/8K/32K (Qwen3-4B-shaped;
#      full loading vs sparse decode at 1/8)
#   6. the serving path on CUDA: batch invariance, preemption bitwise, tokens vs the CPU engine,
#      the disk tier (spill/load, restart reuse, corrupted slots never used)
# Steps 3 and 6 run under the stream-ordering checker (STRATA_CHECK_ORDER=1): every
# cross-stream access of KV memory must have a happens-before path (docs/offload.md).
# Each step is a `strata-gpucheck` subcommand under a time limit (worst case 560 s in
# all, 590 s with the kill grace; about 2 minutes expected on an H200). A correctness failure (FAIL) makes the exit
# status non-zero; a missed performance goal of step 5 shows as MISS, and fails only
# with --strict.
set -uo pipefail

usage() {
    cat <<USAGE
usage: scripts/gpu-check.sh [--steps LIST] GPUCHECK_BINARY
  GPUCHECK_BINARY a strata-gpucheck binary built on another machine (cargo build
                  --release; strip it to carry it: see docs/cuda.md)
  --steps LIST    comma-separated steps to run (default 1,2,3,4,5,6)
  --strict        a missed step-5 performance goal fails the run too
  -h, --help      this help
Environment: STRATA_CUDA_LIBS (extra library dirs), STRATA_KERNEL_CACHE (CUBIN cache).
USAGE
}

steps="1,2,3,4,5,6"
bin=""
strict=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --strict) strict=1; shift ;;
        --steps) [[ $# -ge 2 ]] || { echo "gpu-check: --steps needs a value" >&2; exit 2; }
                 steps="$2"; shift 2 ;;
        -*) echo "gpu-check: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [[ -z "$bin" ]] || { echo "gpu-check: one binary only" >&2; exit 2; }
           bin="$1"; shift ;;
    esac
done
if [[ -z "$bin" ]]; then
    echo "gpu-check: missing GPUCHECK_BINARY (see --help)" >&2; exit 2
fi
if [[ ! -f "$bin" ]]; then
    echo "gpu-check: no such file: $bin" >&2; exit 2
fi
if [[ ! -x "$bin" ]]; then
    echo "gpu-check: not executable: $bin" >&2; exit 2
fi
if [[ ! "$steps" =~ ^[1-6](,[1-6])*$ ]]; then
    echo "gpu-check: --steps must list numbers 1-6, got '$steps'" >&2; exit 2
fi

rows=()   # "step|check|result|detail"
failed=0
add() {
    rows+=("$1|$2|$3|$4")
    if [[ "$3" == FAIL || ( "$3" != ok && $strict -eq 1 ) ]]; then failed=1; fi
}

# run LIMIT_S ARGS...: runs the binary under a time limit; sets $out and $rc.
run() {
    local limit=$1; shift
    out=$(timeout --kill-after=5 "$limit" "$bin" "$@" 2>&1); rc=$?
    echo "$out"
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then out+=$'\n'"timed out after ${limit}s"; fi
}

# A check table's step: ok when the subcommand exits 0, else its last line.
table_step() {
    local step=$1 name=$2 limit=$3; shift 3
    run "$limit" "$@"
    if [[ $rc -eq 0 ]]; then
        add "$step" "$name" ok "$(grep -c ' ok' <<<"$out") checks passed"
    else
        add "$step" "$name" FAIL "exit $rc: $(tail -n1 <<<"$out")"
    fi
}

want() { [[ ",$steps," == *",$1,"* ]]; }

want 1 && table_step 1 "kernels vs CPU twins" 75 kernels
want 2 && table_step 2 "logits CUDA vs CPU" 85 logits
want 3 && STRATA_CHECK_ORDER=1 table_step 3 "offload + sparse equality on CUDA" 80 offload
want 6 && STRATA_CHECK_ORDER=1 table_step 6 "serving path on CUDA" 100 serve
if want 4; then
    run 40 bandwidth
    if [[ $rc -eq 0 ]]; then
        add 4 "pinned bandwidth 64 KB..256 MB" ok "$(grep '^peak' <<<"$out")"
    else
        add 4 "pinned bandwidth 64 KB..256 MB" FAIL "exit $rc: $(tail -n1 <<<"$out")"
    fi
fi
if want 5; then
    run 180 bench-offload --layers 8 --contexts 4096,8192,32768 --decode-steps 16
    if [[ $rc -ne 0 ]]; then
        add 5 "offload benchmark 4K/8K/32K" FAIL "exit $rc: $(tail -n1 <<<"$out")"
    elif grep -q MISSED <<<"$out"; then
        add 5 "offload benchmark 4K/8K/32K" MISS "$(grep -c MISSED <<<"$out") goal(s) missed (see above)"
    else
        add 5 "offload benchmark 4K/8K/32K" ok "$(grep -c '^goal' <<<"$out") goals met"
    fi
fi

echo
printf '%-5s %-32s %-6s %s\n' step check result detail
for r in "${rows[@]}"; do
    IFS='|' read -r s c res d <<<"$r"
    printf '%-5s %-32s %-6s %s\n' "$s" "$c" "$res" "$d"
done
exit $failed
