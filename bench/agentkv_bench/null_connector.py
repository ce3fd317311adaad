"""A vLLM KV connector that does nothing: the baseline of ``agentkv bench overhead --baseline
null-connector``.

A server with any KV connector runs vLLM's connector plumbing every step (the scheduler builds
and the executor ships connector metadata, each attention layer checks for it, the worker
returns a connector output), whatever the connector does. Against this baseline the overhead
bench measures agentkv's own cost; against vanilla, agentkv's plus that plumbing. Loaded by vLLM
from ``--kv-transfer-config``'s ``kv_connector_module_path``; imports vllm.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

NAME = "NullConnector"


class NullMetadata(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullMetadata()
