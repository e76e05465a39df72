"""SHIM itself: from masker state to γ, and from rollouts to a fitted controller.

Data flows one way: masker state -> :mod:`.features` -> a controller (:mod:`.controller`)
predicts γ = P(the LM's continuation stays grammatical) -> :mod:`.correction` adds log γ to the
masked logits (through the shared caches of :mod:`.gamma_cache` and :mod:`.masked_gamma`).
Fitting runs the other way once per grammar: masked rollouts (:mod:`.training_data`) ->
targets and importance weights (:mod:`.targets`) -> :mod:`.fitting` (the
recipe: target choice, trust decision, top-ups) -> an artefact (:mod:`.artefact`,
:mod:`.model_card`).

Layer: imports the LM layer, the backends, the mask layer and below.
"""
