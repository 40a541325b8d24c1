#!/usr/bin/env bash
# Dynamo's frontend and KV router in front of N strata workers, on this machine, from a
# fresh clone: a virtual environment with Dynamo pinned, strata built if needed, every
# process started with its logs in one state directory, a wait until the frontend lists
# the model and sees every worker, one request through it, and, when you stop it (Ctrl-C,
# or at once with --once), every process stopped and everything it wrote removed.
#
#   integrations/dynamo/run-local.sh [--workers N] [--port P] [--model PATH]
#                                    [--router kv|round-robin] [--once] [--keep-logs]
#
# The virtual environment is .venv-dynamo in the checkout (STRATA_DYNAMO_VENV to move it);
# it is kept between runs (delete it to reinstall). STRATA_DYNAMO_PYTHON=/path/to/python
# uses an environment that has Dynamo already instead. Nothing else outlives the script.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
workers=2
port=8080
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
router=kv
once=0
keep_logs=0
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --model) model="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --router) router="$2"; shift 2 ;;
    --once) once=1; shift ;;
    --keep-logs) keep_logs=1; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run-local.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$workers" in ''|*[!0-9]*|0) echo "run-local.sh: --workers must be a positive number" >&2; exit 2 ;; esac
case "$router" in kv|round-robin) ;; *) echo "run-local.sh: --router is kv or round-robin" >&2; exit 2 ;; esac

say() { printf 'run-local.sh: %s\n' "$*"; }

# ---- the model and strata
if [ ! -s "$model" ]; then
  if [ "$model" = "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    "$root/models/fetch.sh"
  else
    echo "run-local.sh: no model at $model" >&2; exit 1
  fi
fi
strata="$root/target/release/strata"
if [ ! -x "$strata" ]; then
  say "building strata (cargo build --release, a few minutes the first time)"
  (cd "$root" && cargo build --release --bin strata)
fi

# ---- Dynamo, pinned, in its own virtual environment
venv="${STRATA_DYNAMO_VENV:-$root/.venv-dynamo}"
py="${STRATA_DYNAMO_PYTHON:-$venv/bin/python}"
if [ -n "${STRATA_DYNAMO_PYTHON:-}" ]; then
  "$py" -c "import dynamo.frontend, dynamo.common.backend, aiohttp" \
    || { echo "run-local.sh: $py has no Dynamo (unset STRATA_DYNAMO_PYTHON to install it)" >&2; exit 1; }
elif ! "$py" -c "import dynamo.frontend, dynamo.common.backend, aiohttp" 2>/dev/null; then
  say "installing Dynamo 1.6.1 into $venv"
  python3 -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet --no-deps -r "$root/integrations/dynamo/requirements-nodeps.txt"
  # pip may print a resolver ERROR about aisimulate (requirements-nodeps.txt says why):
  # harmless here, so it is filtered from the output.
  "$py" -m pip install --quiet -r "$root/integrations/dynamo/requirements.txt" 2>&1 \
    | grep -v -i "aisimulate\|dependency resolver does not currently" || true
  "$py" -c "import dynamo.frontend, dynamo.common.backend, aiohttp" \
    || { echo "run-local.sh: Dynamo did not install into $venv" >&2; exit 1; }
fi

# ---- everything this run writes lives here, and goes when it ends
state="$(mktemp -d "${TMPDIR:-/tmp}/strata-dynamo-run.XXXXXX")"
had_cache=0; [ -e "$HOME/.cache/dynamo" ] && had_cache=1
pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  if [ $keep_logs = 1 ]; then
    say "logs kept in $state"
  else
    rm -rf "$state"
  fi
  # Dynamo's runtime creates ~/.cache/dynamo; remove it only if this run did.
  [ $had_cache = 0 ] && rm -rf "$HOME/.cache/dynamo"
  say "stopped; nothing left running"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export DYN_FILE_KV="$state/discovery" DYN_EVENT_PLANE=zmq DYN_TCP_RPC_HOST=127.0.0.1 \
  DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 \
  PYTHONPATH="$root/integrations/dynamo${PYTHONPATH:+:$PYTHONPATH}"

start() {  # name, command...: in its own process group, output to $state/name.log
  local name="$1"; shift
  setsid "$@" >"$state/$name.log" 2>&1 &
  pids+=("$!")
}

start frontend "$py" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$port" \
  --discovery-backend file --request-plane tcp --router-mode "$router" \
  --migration-limit 3  # requests on a dying worker move to another (docs/distributed.md)
for i in $(seq 1 "$workers"); do
  start "worker$i" "$py" -m strata_dynamo --strata-bin "$strata" \
    --strata-args "--model $(printf '%q' "$model")" --model-card-dir "$state/card" \
    --discovery-backend file --request-plane tcp --event-plane zmq
done

# ---- ready: the frontend lists the model and sees every worker
say "waiting for the frontend on 127.0.0.1:$port and $workers worker(s) (logs: $state)"
base="http://127.0.0.1:$port"
name=""
for _ in $(seq 1 600); do
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "run-local.sh: a process exited while starting; its log:" >&2
      for f in "$state"/*.log; do echo "---- $f" >&2; tail -n 20 "$f" >&2; done
      keep_logs=1
      exit 1
    fi
  done
  name="$("$py" - "$base" "$workers" <<'PY' 2>/dev/null || true
import json, sys, urllib.request
base, want = sys.argv[1], int(sys.argv[2])
health = json.load(urllib.request.urlopen(base + "/health", timeout=2))
ready = [i for i in health.get("instances", []) if i.get("endpoint") == "generate"]
models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=2))["data"]
if len(ready) >= want and models:
    print(models[0]["id"])
PY
)"
  [ -n "$name" ] && break
  sleep 0.5
done
if [ -z "$name" ]; then
  echo "run-local.sh: not ready after 300 s (logs kept in $state)" >&2
  keep_logs=1
  exit 1
fi
say "ready: model \"$name\" at $base/v1 ($workers workers, router $router)"

# ---- one request through the router
curl -sS "$base/v1/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$name\", \"prompt\": \"The capital of France is\",
  \"max_tokens\": 16, \"temperature\": 0}"
echo

if [ $once = 1 ]; then
  exit 0
fi
say "serving until Ctrl-C (try: curl $base/v1/models)"
while true; do
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { say "a process exited; stopping (logs kept)"; keep_logs=1; exit 1; }
  done
  sleep 1
done
