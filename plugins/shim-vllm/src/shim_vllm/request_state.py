"""What every SHIM request carries through the engine, whichever runner holds it.

:class:`ShimRequestState` is shared by the V1 runner's rows (:mod:`.rows`) and the V2 runner's
slots (:mod:`.slots`): the factor on log γ̂ that the temperature mode asks for, and stopping a
request that failed inside the engine (once, with one log line).
"""

from __future__ import annotations

from .faults import RequestFault, report

#: Temperatures at or below this are greedy: the engine does not divide the logits by them.
GREEDY_TEMPERATURE = 1e-5


class ShimRequestState:
    """Behaviour of a request's state; the subclass (a dataclass) holds ``temperature``,
    ``temperature_mode``, ``controller`` and ``fault``."""

    @property
    def gamma_scale(self) -> float:
        """Factor on log γ̂ so that the engine's later division by T leaves what the mode asks."""
        if self.temperature_mode == "lm_only" and self.temperature >= GREEDY_TEMPERATURE:
            return float(self.temperature)
        return 1.0

    def fail(self, exc: BaseException, where: str) -> None:
        """Stop this request from now on, and say so once in the log."""
        if self.fault is None:
            self.fault = RequestFault.of(exc, self.controller)
            report(self.fault, where)
