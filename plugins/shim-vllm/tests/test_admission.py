"""Admission through vLLM's real InputProcessor: every checkable artefact fault is refused in
``validate_params`` (HTTP 400) with a message naming the problem, for both runners' validators.

The engine side is the shipped LM's directory, or a copy of it with one thing changed: another
tokenizer (one added token), wider logits (``vocab_size`` in config.json), other weights (one
value moved). The artefact side is a controller fitted on the shipped LM, or a damaged copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.worker.gpu.sample.logits_processor import loader as v2_loader

from shim_adapters.lm.loading import default_lm_path
from shim_vllm.binding import ControllerBindings
from shim_vllm.lm_identity import weights_revision

RUNNERS = {"v1": "shim_vllm:VllmShimLogitsProcessor",
           "v2": "shim_vllm:VllmShimLogitsProcessorV2"}


def served_copy(root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(default_lm_path(), target)
    return target


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Model directories the engine may serve: the shipped LM and three changed copies."""
    root = tmp_path_factory.mktemp("served")
    other_tokenizer = served_copy(root, "other-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(other_tokenizer, local_files_only=True)
    tokenizer.add_tokens(["<shim-extra-token>"])
    tokenizer.save_pretrained(other_tokenizer)
    wider = served_copy(root, "wider")
    config = json.loads((wider / "config.json").read_text())
    config["vocab_size"] += 64
    (wider / "config.json").write_text(json.dumps(config))
    other_lm = served_copy(root, "other-lm")
    weights = next(other_lm.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return {"shipped": default_lm_path(), "other-tokenizer": other_tokenizer, "wider": wider,
            "other-lm": other_lm}


def input_processor(model_dir: Path, runner: str, monkeypatch) -> InputProcessor:
    """vLLM's own admission for an engine serving ``model_dir`` with the runner's class.

    ``VllmConfig`` refuses the V2 runner where Triton has no backend (this CPU machine), so the
    config is built for V1 and, for "v2", the InputProcessor is built while the config reports
    the V2 runner: it then loads the V2 validator, as on a GPU."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                               seed=0, logits_processors=[RUNNERS[runner]])
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with monkeypatch.context() as patch:
        if runner == "v2":
            patch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
        processor = InputProcessor(config)
    validator = processor.validate_logits_processors_params
    from_v2_loader = getattr(validator, "__module__", None) == v2_loader.__name__
    assert from_v2_loader is (runner == "v2")
    return processor


def admit(processor: InputProcessor, extra_args: dict) -> None:
    processor._validate_params(SamplingParams(max_tokens=8, extra_args=extra_args),
                               ("generate",))


def damaged_copy(source: Path, root: Path, name: str, damage) -> Path:
    target = root / name
    shutil.copytree(source, target)
    damage(target)
    return target


def truncate(directory: Path) -> None:
    weights = directory / "controller.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def flip_byte(directory: Path) -> None:
    weights = directory / "controller.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def edit_manifest(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["controller"]["beta"] = 0.0
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_every_artefact_fault_is_refused_at_admission(runner, served, binary5_dir, tmp_path,
                                                      monkeypatch):
    shipped = input_processor(served["shipped"], runner, monkeypatch)
    admit(shipped, {"shim_controller": str(binary5_dir)})  # intact: admitted
    admit(shipped, {})  # a plain request: admitted
    other_grammar = tmp_path / "other.lark"
    other_grammar.write_text('start: "0" | "1"\n')
    artefact_faults = {
        "no manifest.json": {"shim_controller": str(tmp_path / "missing")},
        r"truncated\?": {"shim_controller": str(damaged_copy(binary5_dir, tmp_path, "trunc",
                                                              truncate))},
        "weights file sha256 does not match": {
            "shim_controller": str(damaged_copy(binary5_dir, tmp_path, "flip", flip_byte))},
        "manifest_sha256": {"shim_controller": str(damaged_copy(binary5_dir, tmp_path, "edit",
                                                                edit_manifest))},
        "grammar_sha256": {"shim_controller": str(binary5_dir),
                           "shim_grammar": str(other_grammar)},
        "unknown SHIM argument": {"shim_controller": str(binary5_dir), "shim_bta": 1},
    }
    for message, extra_args in artefact_faults.items():
        with pytest.raises(VLLMValidationError, match=message):
            admit(shipped, extra_args)
    engine_faults = {"other-tokenizer": "tokenizer_sha256", "wider": "vocab_size",
                     "other-lm": "lm_revision"}
    for served_name, message in engine_faults.items():
        processor = input_processor(served[served_name], runner, monkeypatch)
        with pytest.raises(VLLMValidationError, match=f"SHIM request refused: .*{message}"):
            admit(processor, {"shim_controller": str(binary5_dir)})


def test_admission_binds_once_per_artefact_content(served, binary5_dir, tmp_path,
                                                   monkeypatch):
    loads = []
    original = ControllerBindings._load

    def counting(self, args):
        loads.append(args.controller)
        return original(self, args)

    monkeypatch.setattr(ControllerBindings, "_load", counting)
    artefact = tmp_path / "artefact"
    shutil.copytree(binary5_dir, artefact)
    processor = input_processor(served["shipped"], "v2", monkeypatch)
    for _ in range(5):
        admit(processor, {"shim_controller": str(artefact)})
    assert len(loads) == 1
    flip_byte(artefact)  # edited in place: checked again, and refused
    with pytest.raises(VLLMValidationError, match="sha256"):
        admit(processor, {"shim_controller": str(artefact)})
    assert len(loads) == 2
    shutil.rmtree(artefact)
    shutil.copytree(binary5_dir, artefact)  # restored to the content already checked: cached
    admit(processor, {"shim_controller": str(artefact)})
    assert len(loads) == 2


def test_the_served_weights_digest_is_load_lms_revision(served, lm):
    assert weights_revision(served["shipped"]) == lm.revision
    assert weights_revision(served["other-lm"]) != lm.revision
