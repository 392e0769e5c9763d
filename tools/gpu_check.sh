#!/usr/bin/env bash
# Issue #34 on a lent GPU machine (no network there), in one call: what changed since the last GPU figures
# (the memory budget, skipped tokens, the kept set / full KL / invariant mode in Triton, the verl backend),
# each against its target in the same run. Run from the repository root with the wheels below in .whl/
# (carried: the device tool's `carry=[".whl"]`), OUT set to a folder that comes back:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     liger-kernel==0.8.5 cut-cross-entropy==25.1.1 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 \
#     huggingface_hub==2.4.0 hf-xet httpx2 httpcore2 fsspec typer annotated-doc shellingham click rich \
#     markdown-it-py mdurl pygments regex pyyaml packaging filelock tqdm anyio h11 idna certifi sniffio \
#     verl==0.9.1 tensordict==0.10.0 pyvers omegaconf==2.4.0 codetiming==1.4.0 accelerate==1.15.0 pydantic \
#     pydantic-core annotated-types typing-inspection cloudpickle orjson psutil truststore dill pillow numpy
# Steps, most wanted first, each in a time box (a failed step is logged and the next one runs):
#   1. `lmloss bench --budget default,1536,768`: the fused head 8192 x 4096 x 128256 bf16 at the default budget
#      and below its 2004 MiB fp32 accumulator (the weight pass), beside Liger, Cut Cross-Entropy and the
#      three-matmul floor: time / floor, peak, dW error against float64 (OUT/budget/);
#   2. tools/gpu_lean.py: half the tokens ignored against none (OUT/lean31.json);
#   3. tools/gpu_kernels.py: token_logprobs plain / entropy / in place / top-k / top-p / invariant, the policy
#      loss vanilla / gspo / full KL / invariant, each new kernel alone (OUT/kernels33.json);
#   4. tools/gpu_step.py: a Hugging Face Llama-shaped step unpatched / lmloss / Liger, and verl's PPO forward
#      through its torch backend and lmloss's (OUT/step.json);
#   5. tools/gpu_parity.py: every op x option on CUDA against float64 (OUT/parity.json);
#   6. the Triton kernel tests on the GPU (interpreter off; OUT/tests.txt).
# STEPS (default "budget lean kernels step parity tests") picks steps for a rerun; BUDGETS the bench's budgets.
set -u
STEPS=${STEPS:-budget lean kernels step parity tests}
want() { [[ " $STEPS " == *" $1 "* ]]; }
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s)
say() { echo "=== [$(($(date +%s) - t0))s] $*"; }
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false

say "versions, wheels"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
have_numpy=$(python3 -c "import numpy; print(1)" 2>/dev/null || echo 0)
wheels=$(ls .whl/*.whl | grep -v -E '/numpy-' )
[ "$have_numpy" = 1 ] || wheels="$wheels $(ls .whl/numpy-*.whl)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels \
  || say "wheels: install failed"
export PYTHONPATH=/tmp/site:$PWD/src
python3 -c "import torch, triton, transformers, liger_kernel, cut_cross_entropy; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" || say "imports failed"

say "1. the fused head at the default budget and below its accumulator, beside Liger and CCE"
! want budget || timeout "${BUDGET_S:-110}" python3 -m lmloss.cli bench --device cuda --workload fused --tokens 8192 --hidden 4096 \
  --vocab 128256 --dtype bfloat16 --kernel triton --impl fused,liger,cce,matmul-floor --budget "${BUDGETS:-default,1536,768,320}" \
  --repeats 6 --warmup 1 --no-progress --no-plots --out "$OUT/budget" || say "bench --budget: exit $?"

say "2. tokens that do not count (tools/gpu_lean.py)"
! want lean || timeout "${LEAN_S:-70}" python3 tools/gpu_lean.py --device cuda --out "$OUT" --rounds 5 || say "gpu_lean: exit $?"

say "3. the kept set, the full KL, invariant mode (tools/gpu_kernels.py)"
! want kernels || timeout "${KERNELS_S:-110}" python3 tools/gpu_kernels.py --device cuda --out "$OUT" --rounds 5 \
  || say "gpu_kernels: exit $?"

say "4. a Hugging Face step and verl's PPO forward (tools/gpu_step.py)"
! want step || timeout "${STEP_S:-100}" python3 tools/gpu_step.py --device cuda --out "$OUT" || say "gpu_step: exit $?"

say "5. every op x option on CUDA against float64 (tools/gpu_parity.py)"
! want parity || timeout "${PARITY_S:-60}" python3 tools/gpu_parity.py --device cuda --out "$OUT" --budget-s 50 || say "gpu_parity: exit $?"

say "6. Triton kernel tests on the GPU"
! want tests || TRITON_INTERPRET=0 timeout "${TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py \
  tests/test_kernels_triton_loss.py tests/test_kernels_triton_distill.py tests/test_kernels_triton_sampling.py \
  > "$OUT/tests.txt" 2>&1
echo "kernel tests exit $?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
say "done"
