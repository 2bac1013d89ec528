"""Which scheduler a request goes to, in a job with one scheduler per device
(``runtime.devices``; :mod:`opentinker.control.placement` decides where each policy lives)."""

from __future__ import annotations

from opentinker.config import adapter_owner


class Routes:
    """Where a request naming an adapter goes: the endpoint of the scheduler holding the
    adapter's policy (a league snapshot's: the policy it was frozen from); requests for the
    bare base model, or for an adapter of no policy of the job, go to ``default``."""

    def __init__(self, default: str, by_policy: dict[str, str] | None = None) -> None:
        self.default = default
        self.by_policy = dict(by_policy or {})

    def endpoints(self) -> list[str]:
        """Every scheduler endpoint, ``default`` first, each once."""
        return list(dict.fromkeys([self.default, *self.by_policy.values()]))

    def __call__(self, adapter: str | None) -> str:
        if adapter is None:
            return self.default
        return self.by_policy.get(adapter_owner(adapter), self.default)
