"""A real vLLM server with the SHIM processor, over HTTP: SHIM outputs parse, plain requests
are untouched (token for token what a server without the plugin returns, same seeds), and a
concurrent batch mixing both kinds and two controllers comes out right."""

from __future__ import annotations

import time

import pytest

from engine_server import completion, post_many

pytestmark = pytest.mark.engine

PLAIN_PROMPTS = ("Write a short sentence:\n", "Generate a JSON object:\n", "Write a SQL query:\n",
                 "Generate a binary string of length 5:\n", "Say hello:\n",
                 "Write a 4-bit bit-vector invariant:\n")


def _grammar(name):
    from shim_adapters.grammars.grammar import builtin_grammar

    return builtin_grammar(name)


def _acceptor(name):
    from shim_adapters.grammars.reference import reference_acceptor

    return reference_acceptor(_grammar(name))


def _shim_payloads(server, artefacts, name, n, seed0):
    prompt = _grammar(name).default_prompt
    return [completion(server, prompt, seed=seed0 + i, max_tokens=200,
                       shim={"shim_controller": str(artefacts[name])}) for i in range(n)]


def _plain_payloads(server, n, seed0, max_tokens=48):
    return [completion(server, PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)], seed=seed0 + i,
                       max_tokens=max_tokens) for i in range(n)]


def _choices(replies):
    """Every sequence of the replies (a request with n > 1 has n), in request and index order."""
    bad = [(r.status, r.body) for r in replies if r.status != 200]
    assert not bad, bad[:3]
    return [c for r in replies for c in sorted(r.body["choices"], key=lambda c: c["index"])]


def _assert_parse(replies, name):
    acceptor = _acceptor(name)
    choices = _choices(replies)
    unfinished = [c["text"] for c in choices if c["finish_reason"] != "stop"]
    assert not unfinished, f"{name}: {len(unfinished)} outputs hit max_tokens: {unfinished[:3]}"
    rejected = [c["text"] for c in choices if not acceptor.accepts(c["text"])]
    assert not rejected, f"{name}: {len(rejected)}/{len(choices)} do not parse: {rejected[:5]}"


@pytest.mark.parametrize("name", ["binary5", "bv4"])
def test_every_shim_output_parses(shim_server, engine_artefacts, name):
    replies = post_many(shim_server, _shim_payloads(shim_server, engine_artefacts, name, 96, 0),
                        concurrency=32)
    _assert_parse(replies, name)
    assert len({r.text for r in replies}) > 3, "SHIM samples, it does not pick one string"


def test_plain_requests_identical_to_a_server_without_the_plugin(shim_server, plain_server,
                                                                 engine_artefacts):
    """One at a time, then all at once: same seeds, same token ids."""
    payloads = _plain_payloads(shim_server, 24, 1000)
    for concurrency in (1, 24):
        with_plugin = post_many(shim_server, payloads, concurrency)
        without = post_many(plain_server, payloads, concurrency)
        assert all(r.status == 200 for r in with_plugin + without)
        diff = [(p["prompt"], p["seed"], a.text, b.text)
                for p, a, b in zip(payloads, with_plugin, without) if a.token_ids != b.token_ids]
        assert not diff, f"concurrency {concurrency}: {len(diff)} differ: {diff[:3]}"
        # the same seed gives the same tokens again: the comparison is not vacuous
        assert len({tuple(r.token_ids) for r in with_plugin}) > len(payloads) // 2


def test_mixed_concurrent_batch(shim_server, plain_server, engine_artefacts):
    """48 sequences in one batch: two requests each of plain, binary5 SHIM and bv4 SHIM, each
    with n = 8 (vLLM fans a request out into n sequences at once, seeds seed + i), sent
    together. SHIM outputs parse; the plain ones equal the plain server's (the same requests
    sent to it together); the engine's own per-step log shows at least 32 sequences in
    one step."""
    kinds = {"plain": [completion(shim_server, PLAIN_PROMPTS[i], seed=4000 + 100 * i,
                                  max_tokens=96, n=8) for i in range(2)]}
    for name, seed0 in (("binary5", 2000), ("bv4", 3000)):
        kinds[name] = [{**p, "n": 8} for p in _shim_payloads(shim_server, engine_artefacts,
                                                              name, 2, seed0)]
        for i, p in enumerate(kinds[name]):
            p["seed"] = seed0 + 100 * i
    batch = [p for trio in zip(kinds["plain"], kinds["binary5"], kinds["bv4"]) for p in trio]

    log_offset = shim_server.log_size()
    replies = post_many(shim_server, batch, concurrency=len(batch))
    _assert_parse(replies[1::3], "binary5")
    _assert_parse(replies[2::3], "bv4")
    plain = _choices(replies[0::3])
    reference = _choices(post_many(plain_server, kinds["plain"], concurrency=2))
    assert len(plain) == len(reference) == 16
    diff = [(a["text"], b["text"]) for a, b in zip(plain, reference)
            if a["token_ids"] != b["token_ids"]]
    assert not diff, f"{len(diff)} plain sequences differ in the mixed batch: {diff[:3]}"
    time.sleep(1)  # the API server logs an engine step after handing out its tokens
    running = shim_server.running_per_step(log_offset)
    assert max(running, default=0) >= 32, f"sequences per engine step: {running}"
