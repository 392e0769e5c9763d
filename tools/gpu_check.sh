#!/usr/bin/env bash
# Issue #26 on a lent GPU machine (no network there), in one call: run from the repository root with the
# wheels named below downloaded into .whl/ (carried), OUT set to a folder that comes back (at most 8 files).
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     liger-kernel cut-cross-entropy megatron-core==0.16.1 trl==1.16.0 datasets dill multiprocess setuptools
#   1. versions; 2. tools/gpu_tune.py (the one-kernel loss's launch configurations, then `lmloss bench` on
#   the shapes and the kernel profile, JSON); 3. the Triton kernel tests on the GPU (interpreter
#   off); 4. why `make venv` cannot install offline there (pip's own words); 5. the test suite on the
#   machine's torch for whatever time is left (a smoke run: -x, stopped by its time box). Between 2 and 3:
#   tools/gpu_invariant.py (invariant=True's bits on the GPU and its cost, OUT/invariant.json), then
#   tools/gpu_kernels.py (issue #33: top-p / top-k with the Triton threshold search, the full KL folded in the
#   Triton softmax gradient, invariant=True, and each new kernel alone, against their targets, OUT/kernels33.json),
#   then tools/gpu_lean.py (issue #31: half the tokens ignored against none, OUT/lean31.json) and `lmloss bench
#   --budget default,1536` on the fused head beside Liger and Cut Cross-Entropy (OUT/budget31/).
# Each step has a time box; a failed step is logged and the next one runs.
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s)
say() { echo "=== [$(($(date +%s) - t0))s] $*"; }
export PYTHONUNBUFFERED=1
TUNE_S=${TUNE_S:-190} SUITE_S=${SUITE_S:-60}

say "versions"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl .whl/megatron_core-*.whl .whl/trl-*.whl .whl/datasets-*.whl \
  .whl/dill-*.whl .whl/multiprocess-*.whl \
  || say "wheels: install failed"
export PYTHONPATH=/tmp/site:$PWD/src
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"

say "tune, bench, profile"
timeout "$TUNE_S" python3 tools/gpu_tune.py "$OUT" || say "gpu_tune: exit $?"

say "invariant=True: bits and cost (tools/gpu_invariant.py)"
timeout "${INVARIANT_S:-120}" python3 tools/gpu_invariant.py --device cuda --out "$OUT" || say "gpu_invariant: exit $?"

say "issue 33: the kept set's search, the full KL and invariant mode against their targets (tools/gpu_kernels.py)"
timeout "${KERNELS33_S:-180}" python3 tools/gpu_kernels.py --device cuda --out "$OUT" || say "gpu_kernels: exit $?"

say "issue 31: tokens that do not count (tools/gpu_lean.py), the fused head within a budget below its accumulator"
timeout "${LEAN31_S:-120}" python3 tools/gpu_lean.py --device cuda --out "$OUT" || say "gpu_lean: exit $?"
# the default budget (4 GiB: the accumulator and one chunk) and 1536 MiB (below the 2004 MiB fp32 accumulator:
# the weight pass), beside Liger and Cut Cross-Entropy: time / floor, peak and dW error against float64
timeout "${BUDGET31_S:-150}" python3 -m lmloss.cli bench --device cuda --workload fused --tokens 8192 --hidden 4096 \
  --vocab 128256 --dtype bfloat16 --kernel triton --impl naive,fused,liger,cce,matmul-floor --budget default,1536 \
  --no-progress --no-plots --out "$OUT/budget31" || say "bench --budget: exit $?"

say "Triton kernel tests on the GPU"
{
  TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_kernels_triton_loss.py tests/test_kernels_triton_distill.py tests/test_kernels_triton_sampling.py
  echo "kernel tests exit $?"
  echo "--- make venv, offline from .whl/"
  python3 -m pip --version; python3 -m pip config list
  rm -rf .venv
  PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl timeout 60 make venv
  echo "make venv exit $?"
  [ -x .venv/bin/python ] && PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl timeout 60 .venv/bin/python -m pip install \
    --dry-run -c .venv/torch-constraint.txt -e ".[sft]" 2>&1 | tail -40
} > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"

say "test suite (smoke, ${SUITE_S}s)"
timeout "$SUITE_S" python3 -m pytest -q -x -p no:cacheprovider tests > "$OUT/suite.txt" 2>&1
echo "suite exit $?" >> "$OUT/suite.txt"
tail -3 "$OUT/suite.txt"
say "done"
