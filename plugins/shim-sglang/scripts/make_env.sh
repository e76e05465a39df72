#!/usr/bin/env bash
# Build the environment in which shim-sglang's tests run: SGLang 0.5.23 beside the shim core.
#
#   plugins/shim-sglang/scripts/make_env.sh [VENV]   (default: plugins/shim-sglang/.venv, git-ignored)
#   VENV/bin/python -m pytest plugins/shim-sglang/tests -q
#
# SGLang 0.5.23 pins torch==2.14.1 (the build on this machine's disk), transformers==5.19.0,
# tokenizers==0.23.2 and xgrammar==0.2.7; the core declares transformers<5 and shim-xgrammar
# xgrammar==0.2.9. So, as for shim-vllm, the pieces are installed with --no-deps and SGLang's
# versions win where they clash. Only SGLang's Python layers are exercised (CPU, no kernels).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$HERE/.venv}"
PY="${PYTHON:-python3.11}"

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
PINS="$(mktemp)"; echo "torch==2.14.1" > "$PINS"
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" -c "$PINS" -r "$HERE/requirements-sglang.txt"
"${PIP[@]}" -c "$PINS" transformers==5.19.0 tokenizers==0.23.2 xgrammar==0.2.7 dill orjson \
    "safetensors>=0.4" "scikit-learn>=1.3" "pluggy>=1.3" "click>=8.1" "matplotlib>=3.7" \
    "jsonschema>=4.21" "lark>=1.1.9" "pytest>=8"
"${PIP[@]}" --no-deps -e "$ROOT" -e "$ROOT/plugins/shim-xgrammar" -e "$ROOT/plugins/shim-vllm" \
    -e "$HERE"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("sglang", "torch", "transformers", "tokenizers", "xgrammar", "shim-adapters",
             "shim-xgrammar", "shim-vllm", "shim-sglang"):
    print(f"{name}=={md.version(name)}")
import sglang.srt.managers.schedule_batch, shim_sglang.processor
print("sglang.srt.managers.schedule_batch and shim_sglang.processor import")
PY
