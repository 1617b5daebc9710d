#!/usr/bin/env bash
# A GPU check of Tetri's vLLM workers (docs/vllm.md, "A GPU check"): one run on one H100 or H200, under 8
# minutes, nothing downloaded. Where there is no GPU it prints one line and exits 0.
#
#   1. a Llama-3-8B-shaped model (random bfloat16 weights, a tokenizer of its 128256 ids) written to a temporary
#      directory (bench/gpu_check_compare.py write-model);
#   2. plain vLLM's OpenAI server on it, alone on the GPU (first, then stopped): the reference tokens and latencies;
#   3. Tetri: a daemon, 1 prefill and 1 decode vLLM worker on the same GPU (each engine 0.42 of its memory),
#      the KV handed over by NixlConnector (NIXL missing: that part fails, saying so); the same requests;
#   4. `tetrictl profile` on the model, alone on the GPU: the fitted cost model's error;
#   5. a markdown table: the profile's fit error, the tokens identical (n of N), TTFT and TPOT of each side.
#
# Exit 0: every step ran, no request failed and the sequential answers are token for token vLLM's (an answer
# that parts from it at a near tie, bf16 rounding, is listed, not counted); 1 otherwise. PYTHON picks the
# interpreter (default: python), CUDA_VISIBLE_DEVICES the GPU (default 0).
# Every step has a hard time limit inside one budget (BUDGET_S) and runs in its own process group, which is
# killed when the step ends or the script exits. All state is in one mktemp directory (its path is printed;
# the 16 GB model is removed at the end, the logs kept).
set -euo pipefail

if ! gpus=$(nvidia-smi -L 2>/dev/null) || ! grep -q '^GPU ' <<<"$gpus"; then
    echo "gpu_check: no GPU here (nvidia-smi found none); nothing run"
    exit 0
fi

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
HELPER=bench/gpu_check_compare.py
BUDGET_S=420  # every step ends within this many seconds of the start; stopping the last one and the table follow
SHARE=0.42    # gpu_memory_utilization of each engine: Tetri's two run together (0.84); vLLM and the profile alone
NAME=llama3-8b-random
MODEL_ARGS=()  # write-model's sizes (none: Llama-3-8B's)
# the engine options of both sides (Tetri's workers pass the rest to vLLM themselves: eager, prefix caching on,
# chunked prefill; workers/engines/vllm/engine.py)
DTYPE=bfloat16
BLOCK=16
MAX_LEN=2048
BATCHED=2048
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*} # one GPU: the first visible one

T0=$SECONDS
PGIDS=()   # process groups started (each `timeout` leads its own); all are stopped on exit
FAILED=()  # "step: why", for the table
RUN=""

say() { echo "gpu_check: $*"; }
fail() {
    FAILED+=("$1")
    say "FAILED: $1"
}
tail_log() {
    [[ -f $1 ]] || return 0
    echo "---- last lines of $1" >&2
    tail -n 20 "$1" >&2
    echo "----" >&2
}
left() { echo $((BUDGET_S - (SECONDS - T0))); }
# budget CAP MIN: the seconds a step may take, min(CAP, what is left); fails where less than MIN is left
budget() {
    local l
    l=$(left)
    ((l >= $2)) || return 1
    echo $((l < $1 ? l : $1))
}
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
jget() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }

group_alive() { # a process of group $1 that is not a zombie
    local f line fields
    for f in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null <"$f" || continue
        read -r -a fields <<<"${line##*) }" # state ppid pgrp …
        [[ ${fields[2]} == "$1" && ${fields[0]} != Z ]] && return 0
    done
    return 1
}
stop_groups() { # SIGTERM to each group; SIGKILL to what is left after 15 s
    local g i
    for g in "$@"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    for g in "$@"; do
        for ((i = 0; i < 75; i++)); do
            group_alive "$g" || continue 2
            sleep 0.2
        done
        kill -KILL -- "-$g" 2>/dev/null || true
        for ((i = 0; i < 25; i++)); do
            group_alive "$g" || continue 2
            sleep 0.2
        done
    done
}
# shellcheck disable=SC2317,SC2329  # run by the EXIT trap
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    ((${#PGIDS[@]} == 0)) || stop_groups "${PGIDS[@]}"
    if [[ -n $RUN ]]; then
        rm -rf "$RUN/model"
        say "logs in $RUN"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_bg OUT LOG SECONDS CMD…: CMD in the background under a hard limit, its own process group; pid in BG
start_bg() {
    local out=$1 log=$2 secs=$3
    shift 3
    timeout -k 5 "$secs" "$@" </dev/null >>"$out" 2>>"$log" &
    BG=$!
    PGIDS+=("$BG")
}
# run_step OUT LOG SECONDS CMD…: CMD to its end under a hard limit, its own process group; its exit status
run_step() {
    start_bg "$@"
    wait "$BG"
}
# wait_ready OUT PID SECONDS: a Tetri process's JSON ready line (printed); why not: in $RUN/why
wait_ready() { "$PY" "$HELPER" wait-ready "$1" "$2" "$3" 2>"$RUN/why"; }
wait_http() { "$PY" "$HELPER" wait-http "$1" "$2" "$3" 2>"$RUN/why"; }
why() { tr '\n' ' ' <"$RUN/why"; }
# till LESS: the seconds left but LESS (at least 1), for a wait that must leave time to what follows it
till() {
    local l
    l=$(($(left) - $1))
    echo $((l > 1 ? l : 1))
}

gpu=$(nvidia-smi -i "$CUDA_VISIBLE_DEVICES" --query-gpu=name,memory.total,memory.used --format=csv,noheader \
    2>/dev/null | head -n 1) || true
[[ -n $gpu ]] || gpu=$(sed -n '1s/^GPU [0-9]*: //p' <<<"$gpus")
say "GPU $CUDA_VISIBLE_DEVICES: $gpu"

base=${TMPDIR:-/tmp}
shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}') || true
if ((${shm_kb:-0} > 20 * 1024 * 1024)); then base=/dev/shm; fi # a tmpfs: the 16 GB are written at memory speed
RUN=$(mktemp -d "$base/gpu_check.XXXXXX")
say "state in $RUN; budget ${BUDGET_S} s"

if ! "$PY" -c 'import torch, vllm; assert torch.cuda.is_available(), "torch sees no GPU"' >"$RUN/env.log" 2>&1; then
    fail "python: vLLM with CUDA is not usable here ($PY; pip install -e '.[vllm]')"
    tail_log "$RUN/env.log"
    exit 1
fi

# the KV connector: NIXL where vLLM can load it (vllm.distributed.nixl_utils imports nixl._api); the workers
# know no other GPU connector (vLLM 0.32 removed P2pNcclConnector)
if "$PY" -c 'from nixl._api import nixl_agent' >/dev/null 2>&1; then
    CONNECTOR=NixlConnector
    say "KV connector: NixlConnector (NIXL is installed)"
else
    CONNECTOR=""
    say "KV connector: none: NIXL is not installed (pip install nixl)"
fi
say "memory: plain vLLM alone, then Tetri's prefill and decode engines together, each gpu_memory_utilization $SHARE"

# 1. the model
avail_kb=$(df -Pk "$RUN" | awk 'NR == 2 {print $4}')
if ((avail_kb < 18 * 1024 * 1024)); then
    fail "model: $((avail_kb / 1024 / 1024)) GB free in $base; it needs 18 (set TMPDIR)"
elif secs=$(budget 120 30) && run_step "$RUN/model.log" "$RUN/model.log" "$secs" \
    "$PY" "$HELPER" write-model "$RUN/model" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}; then
    say "$(tail -n 1 "$RUN/model.log")"
else
    fail "model: not written"
    tail_log "$RUN/model.log"
fi

VLLM_ENGINE=(--dtype "$DTYPE" --block-size "$BLOCK" --max-model-len "$MAX_LEN" --max-num-batched-tokens "$BATCHED"
    --enable-chunked-prefill --enable-prefix-caching --enforce-eager --max-num-seqs 64)
TETRI_ENGINE=(--dtype "$DTYPE" --block-size "$BLOCK" --max-model-len "$MAX_LEN" --chunk-size "$BATCHED")

# 2. plain vLLM
if [[ -f $RUN/model/config.json ]]; then
    if budget 1 90 >/dev/null; then
        port=$(free_port)
        say "plain vLLM: starting its OpenAI server"
        start_bg "$RUN/vllm.log" "$RUN/vllm.log" "$(left)" "$PY" -m vllm.entrypoints.openai.api_server \
            --model "$RUN/model" --served-model-name "$NAME" --host 127.0.0.1 --port "$port" "${VLLM_ENGINE[@]}" \
            --gpu-memory-utilization "$SHARE" --disable-uvicorn-access-log --uvicorn-log-level warning
        vllm_pid=$BG
        if wait_http "http://127.0.0.1:$port" "$vllm_pid" "$(budget 150 1 || echo 1)"; then
            say "plain vLLM: ready after $((SECONDS - T0)) s; sending the requests"
            if secs=$(budget 90 10) && run_step "$RUN/vllm-client.log" "$RUN/vllm-client.log" "$secs" \
                "$PY" "$HELPER" run "http://127.0.0.1:$port" "$NAME" "$RUN/vllm.json"; then
                say "plain vLLM: $(tail -n 1 "$RUN/vllm-client.log")"
            else
                fail "plain vLLM: the client did not finish"
                tail_log "$RUN/vllm-client.log"
            fi
        else
            fail "plain vLLM: the server did not start: $(why)"
            tail_log "$RUN/vllm.log"
        fi
        stop_groups "$vllm_pid"
    else
        fail "plain vLLM: not run (out of time)"
    fi
fi

# 3. Tetri, 1 prefill + 1 decode
if [[ ! -f $RUN/model/config.json ]]; then
    :
elif [[ -z $CONNECTOR ]]; then
    fail "Tetri 1P+1D: not run: no KV connector for GPUs (NIXL is missing: pip install nixl)"
elif budget 1 120 >/dev/null; then
    token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    mkdir -p "$RUN/state"
    say "Tetri: starting the daemon"
    start_bg "$RUN/daemon.out" "$RUN/daemon.log" "$(left)" env TETRI_DAEMON_CLUSTER_TOKEN="$token" \
        "$PY" -m daemon.main --port 0 --grpc-port 0 --state-dir "$RUN/state" --mode disaggregated
    tetri_pids=("$BG")
    url=""
    if ready=$(wait_ready "$RUN/daemon.out" "$BG" 60); then
        url=$(jget "$ready" url)
        grpc=$(jget "$ready" grpc)
        # one engine after the other: vLLM sizes its KV cache from the memory free while it starts
        for role in prefill decode; do
            say "Tetri: starting the $role worker ($CONNECTOR)"
            start_bg "$RUN/$role.out" "$RUN/$role.log" "$(left)" env TETRI_WORKER_TOKEN="$token" \
                TETRI_WORKER_GPU_MEMORY_UTILIZATION="$SHARE" \
                VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$(free_port)" \
                "$PY" -m workers.main --role "$role" --engine vllm --model "$RUN/model" --served-model-name "$NAME" \
                --daemon "$grpc" --instance-id "$role-0" --kv-connector "$CONNECTOR" "${TETRI_ENGINE[@]}"
            tetri_pids+=("$BG")
            if ! wait_ready "$RUN/$role.out" "$BG" "$(till 40)" >/dev/null; then
                fail "Tetri: the $role worker did not start: $(why)"
                tail_log "$RUN/$role.log"
                url=""
                break
            fi
            say "Tetri: $role worker ready after $((SECONDS - T0)) s"
        done
    else
        fail "Tetri: the daemon did not start: $(why)"
        tail_log "$RUN/daemon.log"
    fi
    if [[ -n $url ]]; then
        say "Tetri: sending the requests"
        if secs=$(budget 90 10) && run_step "$RUN/tetri-client.log" "$RUN/tetri-client.log" "$secs" \
            "$PY" "$HELPER" run "$url" "$NAME" "$RUN/tetri.json" --tetri; then
            say "Tetri: $(tail -n 1 "$RUN/tetri-client.log")"
        else
            fail "Tetri: the client did not finish"
            tail_log "$RUN/tetri-client.log"
            tail_log "$RUN/decode.log"
        fi
    fi
    stop_groups "${tetri_pids[@]}"
else
    fail "Tetri 1P+1D: not run (out of time)"
fi

# 4. the profile
if [[ ! -f $RUN/model/config.json ]]; then
    :
elif secs=$(budget 170 100); then
    say "profile: tetrictl profile --engine vllm (minutes)"
    if run_step "$RUN/profile.json" "$RUN/profile.log" "$secs" \
        "$PY" -m tetrictl.app profile --engine vllm --model "$RUN/model" --json -o "$RUN/profile.toml"; then
        say "profile: done after $((SECONDS - T0)) s"
    else
        fail "profile: tetrictl profile failed or ran out of time"
        tail_log "$RUN/profile.log"
    fi
else
    fail "profile: not run (out of time)"
fi

# 5. the table
failed_args=()
for f in ${FAILED[@]+"${FAILED[@]}"}; do failed_args+=(--failed "$f"); done
rc=0
"$PY" "$HELPER" table --vllm "$RUN/vllm.json" --tetri "$RUN/tetri.json" --profile "$RUN/profile.json" \
    --connector "$CONNECTOR" --gpu "$gpu" ${failed_args[@]+"${failed_args[@]}"} || rc=$?
say "done in $((SECONDS - T0)) s"
exit "$rc"
