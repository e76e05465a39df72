"""A real vLLM server with the SHIM processor, over HTTP: SHIM outputs parse, plain requests
are untouched (token for token what a server without the plugin returns, same seeds), and a
concurrent batch mixing both kinds and two controllers comes out right."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

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


def _assert_parse(replies, name):
    acceptor = _acceptor(name)
    bad = [(r.status, r.body) for r in replies if r.status != 200]
    assert not bad, bad[:3]
    unfinished = [r.text for r in replies if r.choice["finish_reason"] != "stop"]
    assert not unfinished, f"{name}: {len(unfinished)} outputs hit max_tokens: {unfinished[:3]}"
    rejected = [r.text for r in replies if not acceptor.accepts(r.text)]
    assert not rejected, f"{name}: {len(rejected)}/{len(replies)} do not parse: {rejected[:5]}"


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


def _running_requests(server) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return max(map(float, found)) if found else 0.0


def test_mixed_concurrent_batch(shim_server, plain_server, engine_artefacts):
    """48 requests in flight together: 16 binary5 SHIM, 16 bv4 SHIM, 16 plain. SHIM outputs
    parse; the plain ones equal the plain server's (the same 16 sent to it together)."""
    shim5 = _shim_payloads(shim_server, engine_artefacts, "binary5", 16, 2000)
    shim4 = _shim_payloads(shim_server, engine_artefacts, "bv4", 16, 3000)
    plain = _plain_payloads(shim_server, 16, 4000, max_tokens=96)
    batch = [p for trio in zip(plain, shim5, shim4) for p in trio]  # interleaved arrivals

    peak = [0.0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], _running_requests(shim_server))
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        replies = post_many(shim_server, batch, concurrency=len(batch))
    finally:
        done.set()
        watcher.join()
    by_kind = {"plain": replies[0::3], "binary5": replies[1::3], "bv4": replies[2::3]}
    _assert_parse(by_kind["binary5"], "binary5")
    _assert_parse(by_kind["bv4"], "bv4")
    reference = post_many(plain_server, plain, concurrency=len(plain))
    diff = [(p["prompt"], a.text, b.text) for p, a, b in zip(plain, by_kind["plain"], reference)
            if a.status != 200 or a.token_ids != b.token_ids]
    assert not diff, f"{len(diff)} plain requests differ in the mixed batch: {diff[:3]}"
    assert peak[0] >= 32, f"at most {peak[0]:.0f} requests ran together"
