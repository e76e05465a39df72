"""γ behaviour: SHIM's correction keeps the masker's guarantee and refuses foreign controllers.

HOOK for the controller (``shim_adapters.shim.correction`` / ``controller`` / ``artefact``): this
check needs a fitted controller for the cell's masker. It uses, in order: one passed in
(``controller=``), an artefact directory (``controller_dir=``, loaded through the artefact
manifest check), or, when the cell's tokenizer is the shipped LM's, a small one fitted here on
the shipped LM. Otherwise the check reports *n/a* with the reason, never silently passes.

Per visited state, with random logits: the corrected distribution puts exactly zero mass on
every masked token, sums to one, is finite, and is bit-identical when recomputed; and the
artefact manifest check refuses a controller whose manifest names another backend, backend
version, grammar, tokenizer or logits width.
"""

from __future__ import annotations

import copy
import time

import numpy as np

from shim_adapters.conformance.report import CheckResult
from shim_adapters.errors import ManifestMismatchError
from shim_adapters.lm.generation import MaskedLogitsProcessor
from shim_adapters.shim import artefact
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.fitting import fit_controller

#: Manifest fields that, changed one at a time, must make ``check_manifest`` refuse.
FOREIGN_FIELDS = ("backend", "backend_version", "grammar_sha256", "tokenizer_sha256",
                  "vocab_size")


def gamma_check(ctx, *, controller=None, controller_dir=None, lm=None,
                steps: int = 24) -> CheckResult:
    res = CheckResult("gamma")
    t0 = time.perf_counter()
    try:
        import torch

    except ImportError as exc:
        res.not_run = f"controller modules not available ({exc})"
        return res
    masker = ctx.masker
    source = "given"
    try:
        if controller is None and controller_dir is not None:
            controller, _ = artefact.load_controller(controller_dir, masker, lm)
            source = f"artefact {controller_dir}"
        elif controller is None and lm is not None:
            p = ctx.profile
            if masker.grammar.default_prompt is None:
                res.not_run = "no controller given and the grammar has no default prompt to fit one"
                return res
            controller, _ = fit_controller(lm, masker, kind="LR_NT", n_samples=p.gamma_samples,
                                           max_new_tokens=p.gamma_max_new_tokens,
                                           seed=p.seed, progress=False)
            source = (f"fitted here on the shipped LM ({p.gamma_samples} samples, "
                      f"{p.gamma_max_new_tokens} tokens, LR_NT)")
        elif controller is None:
            res.not_run = ("no controller for this tokenizer: pass controller_dir= (an artefact "
                           "fitted for this backend, grammar and tokenizer)")
            return res
    except ManifestMismatchError as exc:
        res.failed += 1
        res.notes.append(f"the controller artefact does not match this masker: {exc}")
        return res
    res.info["controller"] = source
    adjuster = ShimAdjuster(controller)
    gen = torch.Generator().manual_seed(ctx.profile.seed)
    state = masker.new_state()
    for step in range(steps):
        mask = state.allowed_mask()
        if not mask.any():
            break
        logits = torch.randn((1, masker.vocab_size), generator=gen)
        outs = []
        for _ in range(2):
            proc = MaskedLogitsProcessor([state.fork()], adjuster=adjuster)
            outs.append(proc(torch.zeros((1, 1), dtype=torch.long), logits.clone()))
        q = torch.softmax(outs[0][0].double(), dim=-1).numpy()
        checks = {
            "no_mass_on_masked": float(q[~mask].sum()) == 0.0,
            "sums_to_one": abs(float(q.sum()) - 1.0) < 1e-9,
            "finite": bool(np.isfinite(q).all()),
            "deterministic": bool(torch.equal(outs[0], outs[1])),
        }
        for name, ok in checks.items():
            if not res.count(ok):
                ctx.fail(res, ctx.repro("gamma", name, list(state.token_ids), None,
                                        f"corrected distribution violates {name} at step {step}"))
        if state.eos_allowed() and (ctx.rng.random() < 0.2 or not (mask & ctx.is_text).any()):
            break
        allowed = np.flatnonzero(mask & ctx.is_text)
        state.advance(int(allowed[ctx.rng.randrange(len(allowed))]))
    manifest = artefact.build_manifest(controller, masker, lm)
    try:
        artefact.check_manifest(manifest, masker, lm)
        res.count(True)
    except ManifestMismatchError as exc:
        ctx.fail(res, ctx.repro("gamma", "own_manifest_refused", [], None, str(exc)))
    for field in FOREIGN_FIELDS:
        foreign = copy.deepcopy(manifest)
        foreign[field] = f"other-{foreign.get(field)}"
        try:
            artefact.check_manifest(foreign, masker, lm)
            ctx.fail(res, ctx.repro("gamma", "foreign_manifest_accepted", [], None,
                                    f"a manifest with another {field} was accepted"))
        except ManifestMismatchError as exc:
            if not res.count(exc.field == field):
                ctx.fail(res, ctx.repro("gamma", "foreign_manifest_wrong_field", [], None,
                                        f"changed {field} but the refusal names {exc.field}"))
    res.seconds = round(time.perf_counter() - t0, 3)
    return res
