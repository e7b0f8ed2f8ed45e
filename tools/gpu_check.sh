#!/usr/bin/env bash
# tools/gpu_check.sh DIR -- the checks that need a GPU, as one prepared run of under 8 minutes on a bare machine.
#
# Runs from the repository root (nothing is installed from it: `python -m` imports ./oasr). Everything goes
# into the folder DIR/gpu-check/ and, at the end (whatever happened, also on an interrupt), that folder is
# packed into ONE archive, DIR/gpu-check.tar.gz (a lent device machine returns at most 8 files), and removed
# (GPU_CHECK_KEEP=1 keeps it). DIR/summary.txt (a copy of the one inside) is left beside the archive.
# Steps, in priority order, each under its own timeout and all under one deadline (GPU_CHECK_BUDGET_S,
# default 470 s from the start; a step that no longer fits is recorded as "not run: budget"):
#   0. env.txt (nvidia-smi, python, torch, triton, cuda-python, flashinfer), install.log (the carried wheels);
#      `python -m oasr kernels --warm` compiles every kernel instantiation for the device, in parallel processes
#      (a cold NVRTC cache otherwise costs each test process its own compiles) -> warm-kernels.log
#   1. every `cuda`-marked test file in its own process (one failure cannot cascade into another file),
#      GPU_CHECK_JOBS (4) files side by side, per-file timeout GPU_CHECK_FILE_TIMEOUT_S (120 s)
#                                                   -> tests/<file>.log, tests/<file>.xml, files.tsv
#   2. `python -m oasr bench --quick --device cuda --sections attention[,launcher]` (v1, v2, v3, SDPA,
#      FlexAttention at 128 streams x {256, 1024, 4096} frames, bf16 and fp8; kernel-only by graph replay,
#      per call with the launcher, host time)                    -> bench.json, bench.log, kernels-md-append.md
#      then the launcher rows again on the driver path (OASR_CUDA_LAUNCH=driver) -> bench-launcher-driver.json
#   3. all `cuda` tests in ONE process (the acceptance needs both)  -> pytest-cuda-all.log, junit-cuda-all.xml
#   4. the real model on the GPU: `python -m oasr eval --device cuda` (timeout 60 s)   -> eval.json, eval.log
#   5. the capacity row, when `python -m oasr bench` has a `capacity` section (timeout 150 s, --quick)
#                                                                  -> capacity.json, capacity.log
#   6. the Nemotron capacity rows: the full-size configuration with random weights, lookaheads
#      GPU_CHECK_NEMOTRON_LOOKAHEADS (13,0), --quick (64 to 2,048 streams, 2 s lanes); GPU_CHECK_NEMOTRON_S (150 s)
#      at most, and steps 4 and 5 leave it GPU_CHECK_NEMOTRON_RESERVE_S (100 s) of the deadline; the bench's own
#      --time-budget-s (the step's limit less 40 s) starts no run it cannot finish, so its JSON is always written.
#      Needs no audio wheels (synthetic audio)     -> capacity-nemotron.json, capacity-nemotron.log
#   summary.txt: one line per step (exit code, seconds), the per-file table, the verdict.
# Steps 4 and 5 need soundfile, kaldi-native-fbank and soxr, which the GPU machine lacks: carry them as wheels
# in ./wheels (python 3.12, manylinux x86_64), e.g. on a machine with network:
#   pip download -d wheels --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       soundfile cffi pycparser kaldi-native-fbank soxr
# i.e. exactly: soundfile-*-py2.py3-none-manylinux_2_28_x86_64.whl (bundles libsndfile),
# cffi-*-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl, pycparser-*-py3-none-any.whl,
# kaldi_native_fbank-*-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl and
# soxr-*-cp312-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl (numpy is already there). Without them
# those two rows say "skipped: missing imports" and nothing else changes.
# GPU_CHECK_EXTRA=1 adds the graphs bench and the NVRTC kernel report when the budget allows.
# Python is $PYTHON, else python3. Exit status: 2 when torch sees no CUDA device (nothing ran on a GPU;
# the archive is still written), 1 if a cuda test failed (per file or in the one process), else 0.
set -u -o pipefail

OUTDIR=${1:?usage: tools/gpu_check.sh DIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
DIR="$OUTDIR/gpu-check"
rm -rf "$DIR"
mkdir -p "$DIR/tests"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-470}
FILE_TIMEOUT=${GPU_CHECK_FILE_TIMEOUT_S:-120}
NEMOTRON_S=${GPU_CHECK_NEMOTRON_S:-150}
NEMOTRON_RESERVE=${GPU_CHECK_NEMOTRON_RESERVE_S:-100}
SUMMARY="$DIR/summary.txt"
: >"$SUMMARY"
verdict=0

note() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }
# fit WANT RESERVE: seconds a step may take (its own limit, or what the deadline leaves after RESERVE
# seconds kept for the steps after it); 0 when fewer than 15 s are left.
fit() {
    local left=$((BUDGET - $(elapsed) - $2))
    if [ "$left" -lt 15 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# step NAME WANT RESERVE LOG CMD...: run CMD under the fitted timeout, log to LOG, one summary line.
step() {
    local name=$1 want=$2 reserve=$3 log=$4
    shift 4
    local limit t0 rc
    limit=$(fit "$want" "$reserve")
    if [ "$limit" -eq 0 ]; then
        note "$name: not run: budget (at $(elapsed) s of $BUDGET)"
        return 124
    fi
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    note "$name: rc=$rc in $(($(date +%s) - t0)) s (limit $limit s)"
    return "$rc"
}

finish() {
    local rc=$?
    trap - EXIT INT TERM
    note "total $(elapsed) s; exit status $verdict"
    cp "$SUMMARY" "$OUTDIR/summary.txt" 2>/dev/null
    local archive="$OUTDIR/gpu-check.tar.gz"
    if tar -czf "$archive.tmp" -C "$OUTDIR" gpu-check && mv "$archive.tmp" "$archive"; then
        echo "packed $archive ($(du -h "$archive" | cut -f1))"
        [ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$DIR"
    else
        echo "could not pack $archive; the results stay in $DIR"
    fi
    [ "$rc" -eq 130 ] && verdict=130
    exit "$verdict"
}
trap finish EXIT
trap 'verdict=130; exit 130' INT TERM

# ---- 0. wheels and environment -----------------------------------------------------------------------------
{
    echo "== carried wheels"
    if [ -d wheels ] && ls wheels/*.whl >/dev/null 2>&1; then
        for whl in wheels/*.whl; do  # one at a time: a wheel that cannot install does not stop the others
            timeout 60 $PY -m pip install -q --no-index --find-links wheels "$whl" || echo "could not install $whl"
        done
    else
        echo "no ./wheels: using what is installed"
    fi
} >"$DIR/install.log" 2>&1

{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    $PY --version
    $PY - <<'PYEOF'
import importlib
for name, attr in (("torch", "__version__"), ("cuda.core", "__version__"), ("cuda.bindings", "__version__"),
                   ("triton", "__version__"), ("flashinfer", "__version__"), ("pytest", "__version__"),
                   ("hypothesis", "__version__"), ("numpy", "__version__"), ("soundfile", "__version__"),
                   ("kaldi_native_fbank", "__version__"), ("soxr", "__version__")):
    try:
        print(name, getattr(importlib.import_module(name), attr, "?"))
    except Exception as exc:  # noqa: BLE001 -- a version line, whatever went wrong
        print(name, "not available:", type(exc).__name__, exc)
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
PYEOF
    if [ -n "${GPU_CHECK_COMMIT:-}" ]; then echo "commit $GPU_CHECK_COMMIT (as the caller named it)"; else git log -1 --format='commit %H %s' 2>/dev/null || true; fi
} >"$DIR/env.txt" 2>&1
cat "$DIR/env.txt"
note "setup: $(elapsed) s"

if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    note "no CUDA device: nothing ran on a GPU"
    if [ "${GPU_CHECK_FORCE:-0}" != 1 ]; then
        verdict=2
        exit 2
    fi
    note "GPU_CHECK_FORCE=1: running the steps anyway (the cuda tests skip)"
fi

# ---- 0b. the kernel cache, warmed in parallel: every instantiation on its own, what a launch reads -----------------
DEV_ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')" 2>/dev/null)
if [ -n "$DEV_ARCH" ]; then
    step "kernel cache ($DEV_ARCH)" 90 380 "$DIR/warm-kernels.log" $PY -m oasr kernels --arch "$DEV_ARCH" --warm
    tail -1 "$DIR/warm-kernels.log" | tee -a "$SUMMARY"
fi

# ---- 1. each cuda test file in its own process ----------------------------------------------------------------
FILES=${GPU_CHECK_TEST_FILES:-$(grep -l "pytest.mark.cuda" tests/test_*.py | sort)}
JOBS=${GPU_CHECK_JOBS:-4}  # files run side by side (separate processes, one GPU: the tests are small)
# run_file FILE: one pytest process for FILE's cuda tests; its row in tests/NAME.row
run_file() {
    local f=$1 name t0 limit rc result
    name=$(basename "$f" .py)
    t0=$(date +%s)
    limit=$(fit "$FILE_TIMEOUT" 280)  # keep 280 s for the bench, the one-process run and eval
    if [ "$limit" -eq 0 ]; then
        printf "%s\t-\t-\tnot run: budget\n" "$name" >"$DIR/tests/$name.row"
        return
    fi
    timeout -k 10 "$limit" $PY -m pytest -m cuda "$f" -q -rs -p no:cacheprovider \
        --junitxml="$DIR/tests/$name.xml" >"$DIR/tests/$name.log" 2>&1
    rc=$?
    result=$(tail -1 "$DIR/tests/$name.log")
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then result="timed out after $limit s"; fi
    printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$(($(date +%s) - t0))" "$result" >"$DIR/tests/$name.row"
}
for f in $FILES; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.5; done
    run_file "$f" &
done
wait
printf "file\trc\tseconds\tresult\n" >"$DIR/files.tsv"
files_failed=0
for f in $FILES; do
    row="$DIR/tests/$(basename "$f" .py).row"
    if [ -s "$row" ]; then cat "$row" >>"$DIR/files.tsv"; else printf "%s\t-\t-\tno result\n" "$f" >>"$DIR/files.tsv"; fi
    rc=$(cut -f2 "$row" 2>/dev/null)
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then files_failed=1; fi  # 5: no test selected; "-": not run
done
cat "$DIR/files.tsv" | tee -a "$SUMMARY"
note "cuda tests file by file: $([ "$files_failed" -eq 0 ] && echo passed || echo FAILED) at $(elapsed) s"
[ "$files_failed" -eq 0 ] || verdict=1

# ---- 2. attention bench (and the launcher rows when the bench has them) -------------------------------------------
SECTIONS=attention
if $PY -c "import sys; from oasr.commands.bench import SECTIONS; sys.exit(0 if 'launcher' in SECTIONS else 1)" \
        >/dev/null 2>&1; then
    SECTIONS=attention,launcher
fi
step "bench ($SECTIONS)" 120 150 "$DIR/bench.log" \
    $PY -m oasr bench --quick --device cuda --sections "$SECTIONS" --json "$DIR/bench.json"
# the launcher on the driver path too (the bench above ran the default, OASR_CUDA_LAUNCH=cuda_core; driver: parameters
# packed once per plan, cuLaunchKernel), so both per-call host times come back from one visit
if [ "$SECTIONS" = "attention,launcher" ]; then
    step "launcher (OASR_CUDA_LAUNCH=driver)" 40 120 "$DIR/bench-launcher-driver.log" \
        env OASR_CUDA_LAUNCH=driver $PY -m oasr bench --quick --device cuda --sections launcher \
        --json "$DIR/bench-launcher-driver.json"
fi
DEVICE_NAME=$($PY -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo "a CUDA device")
if [ -s "$DIR/bench.json" ] && $PY tools/gpu_report.py "$DIR/bench.json" --device "$DEVICE_NAME" \
        >"$DIR/kernels-md-append.md" 2>&1; then
    cp "$DIR/kernels-md-append.md" "$OUTDIR/kernels-md-append.md"
else
    note "report: no GPU attention rows (see bench.log)"
fi

# ---- 3. all cuda tests in one process ---------------------------------------------------------------------------
if step "cuda tests in one process" 180 30 "$DIR/pytest-cuda-all.log" \
        $PY -m pytest -m cuda tests -q -rs -p no:cacheprovider --junitxml="$DIR/junit-cuda-all.xml"; then
    :
else
    verdict=1
fi
tail -3 "$DIR/pytest-cuda-all.log" 2>/dev/null | tee -a "$SUMMARY"

# ---- 4, 5. the real model and the capacity row (need the audio wheels) ------------------------------------------------
if $PY -c "import soundfile, kaldi_native_fbank, soxr" >/dev/null 2>&1; then
    step "eval --device cuda" 60 "$NEMOTRON_RESERVE" "$DIR/eval.log" $PY -m oasr eval --device cuda --json "$DIR/eval.json"
    tail -2 "$DIR/eval.log" | tee -a "$SUMMARY"
    if $PY -c "import sys; from oasr.commands.bench import SECTIONS; sys.exit(0 if 'capacity' in SECTIONS else 1)" \
            >/dev/null 2>&1; then
        step "capacity" 150 "$NEMOTRON_RESERVE" "$DIR/capacity.log" \
            $PY -m oasr bench --quick --device cuda --sections capacity --json "$DIR/capacity.json"
        tail -5 "$DIR/capacity.log" | tee -a "$SUMMARY"
    else
        note "capacity: skipped: python -m oasr bench has no capacity section"
    fi
else
    note "eval, capacity: skipped: missing imports (soundfile, kaldi-native-fbank, soxr: carry their wheels)"
fi

# ---- 6. the Nemotron capacity rows (full-size configuration, random weights) ---------------------------------------
if $PY -c "import oasr.bench.capacity_nemotron, tokenizers, safetensors" >/dev/null 2>&1; then
    limit=$(fit "$NEMOTRON_S" 0)
    if [ "$limit" -ge 60 ]; then
        step "capacity nemotron-0.6b" "$limit" 0 "$DIR/capacity-nemotron.log" \
            $PY -m oasr bench --quick --device cuda --sections capacity --capacity-model nemotron-0.6b \
            --lookaheads "${GPU_CHECK_NEMOTRON_LOOKAHEADS:-13,0}" --time-budget-s $((limit - 40)) \
            --json "$DIR/capacity-nemotron.json"
        tail -4 "$DIR/capacity-nemotron.log" | tee -a "$SUMMARY"
    else
        note "capacity nemotron-0.6b: not run: budget ($limit s left at $(elapsed) s of $BUDGET)"
    fi
else
    note "capacity nemotron-0.6b: skipped: oasr.bench.capacity_nemotron, tokenizers or safetensors does not import"
fi

if [ "${GPU_CHECK_EXTRA:-0}" = 1 ]; then
    step "graphs bench" 120 0 "$DIR/bench-graphs.log" \
        $PY -m oasr bench --quick --device cuda --sections graphs --json "$DIR/bench-graphs.json"
    DEV_ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')" 2>/dev/null)
    step "kernel report" 120 0 "$DIR/kernels.log" \
        $PY -m oasr kernels --arch "sm_80,sm_90${DEV_ARCH:+,$DEV_ARCH}" --json "$DIR/kernels.json"
fi
