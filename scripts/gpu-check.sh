#!/usr/bin/env bash
# GPU acceptance checks for a machine with an NVIDIA GPU (CUDA 13 driver, no cargo), run
# from a prebuilt binary. Prints one summary table; exits non-zero on any failure.
#   1. every kernel against its CPU twin on random inputs (`strata-gpucheck kernels`)
#   2. logits CUDA vs CPU                      3. offload (and sparse decode) equality on CUDA
#   4. pinned bandwidth sweep 64 KB..256 MB    5. offload benchmark at 4K/8K/32K (Qwen3-4B-shaped;
#      full loading vs sparse decode at 1/8)
#   6. the serving path on CUDA: batch invariance, preemption bitwise, tokens vs the CPU engine,
#      the disk tier (spill/load, restart reuse, corrupted slots never used)
# With --cli DIR (a folder holding stripped `strata` and `needle` binaries) and the model file:
#   7. `strata generate` on a ~4K-token prompt: resident, offload (4 slots), sparse 1/8 and
#      verified sparse (`--sparse-verify 4`): offload's tokens = resident's, verified's =
#      offload's; decode tok/s of each (issue 32's speed on a real link)
#   8. `needle --compare-offload` at 2K and 8K         9. `strata serve` with 16 streams vs 1
#  10. compute-sanitizer memcheck and racecheck on step 1, NVTX ranges under nsys (each SKIP
#      when the tool is missing)
# `--device cpu` runs steps 7-9 on the CPU device instead: how they are tested without a GPU.
# Steps 3 and 6 run under the stream-ordering checker (STRATA_CHECK_ORDER=1): every
# cross-stream access of KV memory must have a happens-before path (docs/offload.md).
# Each step is a `strata-gpucheck` subcommand under a time limit (worst case 560 s in
# all, 590 s with the kill grace; about 2 minutes expected on an H200). A correctness failure (FAIL) makes the exit
# status non-zero; a missed performance goal of step 5 shows as MISS, and fails only
# with --strict.
set -uo pipefail

usage() {
    cat <<USAGE
usage: scripts/gpu-check.sh [--steps LIST] [--cli DIR [--model PATH] [--device cuda|cpu]] GPUCHECK_BINARY
  GPUCHECK_BINARY a strata-gpucheck binary built on another machine (cargo build
                  --release; strip it to carry it: see docs/cuda.md)
  --steps LIST    comma-separated steps to run (default 1-6, and 7-10 with --cli)
  --cli DIR       a folder with the strata and needle binaries: enables steps 7-10
  --model PATH    the model of steps 7-9 (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --device DEV    cuda (default) or cpu: steps 7-9 on the CPU device (the script's own test)
  --out DIR       where steps 7-10 keep their JSON and logs (default: a new temporary folder)
  --strict        a missed performance goal (steps 5 and 9) fails the run too
  -h, --help      this help
Environment: STRATA_CUDA_LIBS (extra library dirs), STRATA_KERNEL_CACHE (CUBIN cache),
GPU_CHECK_PROMPT_CHARS (step 7's prompt: the first N characters of docs/offload.md, default
14000, ~4K tokens), GPU_CHECK_NEEDLE_LENS (step 8, default 2048,8000),
GPU_CHECK_SERVE_TOKENS (step 9's output length, default 64).
USAGE
}

steps=""
bin=""
strict=0
cli=""
model="models/SmolLM2-135M-Instruct.Q4_1.gguf"
device="cuda"
outdir=""
needs_value() { [[ $# -ge 2 ]] || { echo "gpu-check: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --strict) strict=1; shift ;;
        --steps) needs_value "$@"; steps="$2"; shift 2 ;;
        --cli) needs_value "$@"; cli="$2"; shift 2 ;;
        --model) needs_value "$@"; model="$2"; shift 2 ;;
        --device) needs_value "$@"; device="$2"; shift 2 ;;
        --out) needs_value "$@"; outdir="$2"; shift 2 ;;
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
if [[ -z "$steps" ]]; then
    steps="1,2,3,4,5,6"
    [[ -n "$cli" ]] && steps+=",7,8,9,10"
fi
if [[ ! "$steps" =~ ^([1-9]|10)(,([1-9]|10))*$ ]]; then
    echo "gpu-check: --steps must list numbers 1-10, got '$steps'" >&2; exit 2
fi
if [[ "$device" != cuda && "$device" != cpu ]]; then
    echo "gpu-check: --device must be cuda or cpu, got '$device'" >&2; exit 2
fi
if [[ "$steps" =~ (^|,)(7|8|9|10)(,|$) ]]; then
    if [[ -z "$cli" ]]; then
        echo "gpu-check: steps 7-10 need --cli DIR (the strata and needle binaries)" >&2; exit 2
    fi
    for b in strata needle; do
        [[ -x "$cli/$b" ]] || { echo "gpu-check: no executable $cli/$b" >&2; exit 2; }
    done
    [[ -f "$model" ]] || { echo "gpu-check: no model file $model (--model)" >&2; exit 2; }
    if [[ -z "$outdir" ]]; then outdir=$(mktemp -d); fi
    mkdir -p "$outdir" || exit 2
fi

rows=()   # "step|check|result|detail"
failed=0
add() {
    rows+=("$1|$2|$3|$4")
    if [[ "$3" == FAIL || ( "$3" == MISS && $strict -eq 1 ) ]]; then failed=1; fi
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

# json FILE EXPR: a Python expression over the JSON object `j` read from FILE.
json() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1"; }

# clirun LIMIT NAME BIN ARGS...: one CLI run under a time limit, stdout to $outdir/NAME.json,
# stderr to $outdir/NAME.log; sets $rc.
clirun() {
    local limit=$1 name=$2; shift 2
    timeout --kill-after=5 "$limit" "$@" >"$outdir/$name.json" 2>"$outdir/$name.log"; rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "$name: exit $rc: $(tail -n1 "$outdir/$name.log")"
    fi
}

if want 7; then
    prompt="$outdir/prompt.txt"
    head -c "${GPU_CHECK_PROMPT_CHARS:-14000}" docs/offload.md >"$prompt"
    gen=("$cli/strata" generate --device "$device" --model "$model" --prompt-file "$prompt"
         --max-tokens 48 --temperature 0 --json)
    off=(--enable-offload --num-kv-buffers 4)
    ok7=1
    clirun 150 resident "${gen[@]}" || true; [[ $rc -eq 0 ]] || ok7=0
    clirun 150 offload "${gen[@]}" "${off[@]}"; [[ $rc -eq 0 ]] || ok7=0
    if [[ $ok7 -eq 1 ]]; then
        # 1/8 of the prompt in pages of 16, at least the sink page and a 256-token window.
        budget=$(( $(json "$outdir/offload.json" "j['prompt_tokens']") / 8 / 16 * 16 ))
        (( budget < 272 )) && budget=272
        clirun 150 sparse "${gen[@]}" "${off[@]}" --sparse-budget "$budget"; [[ $rc -eq 0 ]] || ok7=0
        clirun 150 verified "${gen[@]}" "${off[@]}" --sparse-budget "$budget" --sparse-verify 4
        [[ $rc -eq 0 ]] || ok7=0
    fi
    if [[ $ok7 -eq 0 ]]; then
        add 7 "generate: offload, sparse, verified" FAIL "a run failed (logs in $outdir)"
    else
        same() { [[ "$(json "$outdir/$1.json" "j['token_ids']")" == "$(json "$outdir/$2.json" "j['token_ids']")" ]]; }
        tps() { json "$outdir/$1.json" "round(j['decode_tokens_per_s'], 1)"; }
        ratio() { python3 -c "print(f'{$1 / max($2, 1e-9):.2f}')"; }
        detail="$(json "$outdir/offload.json" "j['prompt_tokens']") prompt tokens, budget $budget; decode tok/s full $(tps offload), sparse $(tps sparse) ($(ratio "$(tps sparse)" "$(tps offload)")x), verified $(tps verified) ($(ratio "$(tps verified)" "$(tps offload)")x, $(json "$outdir/verified.json" "'%.0f%% kept' % (100 * j['sparse_verify']['accepted'] / max(1, j['sparse_verify']['drafted']))"))"
        if ! same offload resident; then
            add 7 "generate: offload = resident" FAIL "tokens differ; $detail"
        elif ! same verified offload; then
            add 7 "generate: verified = offload" FAIL "tokens differ; $detail"
        else
            add 7 "generate: offload, sparse, verified" ok "tokens equal; $detail"
        fi
    fi
fi
if want 8; then
    clirun 240 needle "$cli/needle" --device "$device" --model "$model" --compare-offload \
        --input-len "${GPU_CHECK_NEEDLE_LENS:-2048,8000}" --depth 0.2,0.8 --json
    if [[ $rc -eq 0 ]]; then
        add 8 "needle --compare-offload" ok "${GPU_CHECK_NEEDLE_LENS:-2048,8000} tokens, depths 0.2,0.8"
    else
        add 8 "needle --compare-offload" FAIL "exit $rc: $(tail -n1 "$outdir/needle.log")"
    fi
fi
if want 9; then
    log="$outdir/serve.log"
    timeout --kill-after=5 200 "$cli/strata" serve --device "$device" --model "$model" \
        --port 0 --max-num-seqs 16 >"$log" 2>&1 &
    server=$!
    url=""
    for _ in $(seq 1 120); do
        url=$(grep -o 'listening on http://[^ ]*' "$log" | head -n1 | sed 's/listening on //')
        if [[ -n "$url" ]] && grep -q 'serve: ready' "$log"; then break; fi
        kill -0 "$server" 2>/dev/null || break
        sleep 1
    done
    if [[ -z "$url" ]] || ! grep -q 'serve: ready' "$log"; then
        add 9 "serve: 16 streams vs 1" FAIL "the server did not come up: $(tail -n1 "$log")"
    else
        timeout 180 python3 scripts/serve-scaling.py --url "$url" --streams 16 \
            --output-len "${GPU_CHECK_SERVE_TOKENS:-64}" >"$outdir/serve.json" 2>>"$log"; rc=$?
        if [[ $rc -ne 0 ]]; then
            add 9 "serve: 16 streams vs 1" FAIL "exit $rc: $(tail -n1 "$log")"
        else
            r=$(json "$outdir/serve.json" "j['ratio']")
            d="tok/s 1 stream $(json "$outdir/serve.json" "j['tok_s_1']"), 16 $(json "$outdir/serve.json" "j['tok_s_16']"): ${r}x (goal >= 8)"
            if python3 -c "import sys; sys.exit(0 if $r >= 8 else 1)"; then
                add 9 "serve: 16 streams vs 1" ok "$d"
            else
                add 9 "serve: 16 streams vs 1" MISS "$d"
            fi
        fi
    fi
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
fi
if want 10 && [[ "$device" == cuda ]]; then
    if command -v compute-sanitizer >/dev/null; then
        for tool in memcheck racecheck; do
            timeout --kill-after=5 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$bin" kernels >"$outdir/sanitizer-$tool.log" 2>&1; rc=$?
            if [[ $rc -eq 0 ]]; then
                add 10 "compute-sanitizer $tool, step 1" ok "$(grep -c ' ok' "$outdir/sanitizer-$tool.log") checks, no errors"
            else
                add 10 "compute-sanitizer $tool, step 1" FAIL "exit $rc: $(grep -m1 -E 'ERROR|Invalid|hazard' "$outdir/sanitizer-$tool.log")"
            fi
        done
    else
        add 10 "compute-sanitizer" SKIP "not on PATH"
    fi
    if command -v nsys >/dev/null; then
        timeout --kill-after=5 120 nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi \
            -o "$outdir/profile" --force-overwrite true "$cli/strata" generate --device cuda \
            --model "$model" --prompt "Hello" --max-tokens 8 --profile-steps 2:4 \
            >"$outdir/nsys.log" 2>&1 \
            && nsys stats --report nvtx_sum "$outdir/profile.nsys-rep" >>"$outdir/nsys.log" 2>&1; rc=$?
        if [[ $rc -eq 0 ]] && grep -q 'layer' "$outdir/nsys.log"; then
            add 10 "NVTX ranges under nsys" ok "layer ranges in the capture"
        else
            add 10 "NVTX ranges under nsys" FAIL "exit $rc, or no layer range (see $outdir/nsys.log)"
        fi
    else
        add 10 "NVTX ranges under nsys" SKIP "nsys not on PATH"
    fi
fi

echo
printf '%-5s %-32s %-6s %s\n' step check result detail
for r in "${rows[@]}"; do
    IFS='|' read -r s c res d <<<"$r"
    printf '%-5s %-32s %-6s %s\n' "$s" "$c" "$res" "$d"
done
exit $failed
