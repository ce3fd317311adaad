"""A worker extension shaped like an RL trainer's (``--worker-extension-cls``): its own method
name for a weight sync, as OpenRLHF 0.11.2's ``update_weight`` (and verl's, SkyRL's, ROLL's and
AReaL's), none of which vLLM or agentkv knows by name. The weights really change: it loads a
checkpoint in place through the worker's own reload path."""

from __future__ import annotations

from typing import Any


class TrainerWeightSync:
    def update_weight(self: Any, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
