"""The fault sweep: every damaged or mismatched artefact is refused at admission
(``validate_params``: HTTP 400, naming the problem) and the server keeps serving SHIM and plain
requests. A fault that got past admission and failed inside the engine would show as a 500
and a dead server (vLLM 0.32 has no per-request error path for logits processors)."""

from __future__ import annotations

import pytest

from engine_server import completion, post

pytestmark = pytest.mark.engine

#: fault -> words the 400's message must contain (case-insensitive; any of them)
FAULTS = {
    "missing": ("manifest", "no such", "not a controller", "does not exist"),
    "truncated": ("truncated", "bytes", "sha256"),
    "flipped_byte": ("sha256", "modified", "damaged", "checksum"),
    "edited_manifest": ("manifest_sha256", "edited"),
    "other_tokenizer": ("tokenizer",),
    "other_lm": ("lm_revision", "lm_identifier", "weights", "revision", "model"),
    "other_grammar": ("grammar",),
}


def _prompt():
    from shim_adapters.grammars.grammar import builtin_grammar

    return builtin_grammar("binary5").default_prompt


def _still_serving(server, artefacts):
    from shim_adapters.grammars.reference import reference_acceptor
    from shim_adapters.grammars.grammar import builtin_grammar

    assert server.alive() and server.healthy(), "the server is down"
    url = f"{server.url}/v1/completions"
    good = post(url, completion(server, _prompt(), seed=7, max_tokens=16,
                                shim={"shim_controller": str(artefacts["binary5"])}))
    assert good.status == 200, good.body
    assert reference_acceptor(builtin_grammar("binary5")).accepts(good.text), good.text
    plain = post(url, completion(server, "Say hello:\n", seed=7, max_tokens=16))
    assert plain.status == 200, plain.body


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_a_400_and_the_server_keeps_serving(shim_server, engine_artefacts,
                                                     fault_requests, fault):
    url = f"{shim_server.url}/v1/completions"
    reply = post(url, completion(shim_server, _prompt(), seed=0, max_tokens=16,
                                 shim=fault_requests[fault]))
    alive = shim_server.alive() and shim_server.healthy()
    assert reply.status == 400, (f"{fault}: HTTP {reply.status} (server "
                                 f"{'alive' if alive else 'DEAD'}): {reply.error[:500]}")
    message = reply.error.lower()
    assert any(word in message for word in FAULTS[fault]), (fault, reply.error)
    _still_serving(shim_server, engine_artefacts)
