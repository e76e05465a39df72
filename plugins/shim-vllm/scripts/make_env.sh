#!/usr/bin/env bash
# Build the environment in which shim-vllm's tests run: vLLM 0.33.0 beside the shim core.
#
#   plugins/shim-vllm/scripts/make_env.sh [VENV]     (default: plugins/shim-vllm/.venv, git-ignored)
#   VENV/bin/python -m pytest plugins/shim-vllm/tests -m vllm -q
#
# Why not `pip install plugins/shim-vllm`: vLLM 0.33.0 pins torch==2.14.0 and needs
# transformers>=5.16.1 and xgrammar==0.2.8, while the core declares transformers<5 and the
# shim-xgrammar plugin xgrammar==0.2.9 (SynCode's pins). No resolver can satisfy both, so this
# script installs the pieces itself: vLLM and the shim distributions with --no-deps, their
# requirements from the files named below, with vLLM's versions winning where they clash.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$HERE/.venv}"
PY="${PYTHON:-python3.11}"

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
# torch 2.14.1: the build that lies on this machine's disk (pip picks it up; vLLM pins 2.14.0,
# which PyPI only has as a multi-GB CUDA download). Its API is the one vLLM 0.33 was built for.
"${PIP[@]}" torch==2.14.1
"${PIP[@]}" --no-deps vllm==0.33.0
"${PIP[@]}" -r "$HERE/requirements-vllm.txt"
# The shim core and the XGrammar plugin, without their declared pins (transformers<5,
# xgrammar==0.2.9): the core's own runtime needs, then vLLM's xgrammar.
"${PIP[@]}" "numpy>=1.24" "safetensors>=0.4" "scikit-learn>=1.3" "pluggy>=1.3" "click>=8.1" \
    "tqdm>=4.60" "matplotlib>=3.7" "jsonschema>=4.21" "pytest>=8" "xgrammar==0.2.8"
"${PIP[@]}" --no-deps -e "$ROOT" -e "$ROOT/plugins/shim-xgrammar" -e "$HERE"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("vllm", "torch", "transformers", "tokenizers", "xgrammar", "shim-adapters",
             "shim-xgrammar", "shim-vllm"):
    print(f"{name}=={md.version(name)}")
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
import shim_adapters.shim.correction, shim_vllm.processor
print("vllm.v1.sample.logits_processor and shim_vllm.processor import")
PY
