"""``vllm.general_plugins`` entry point: registers AgentKVConnector with vLLM's factory.

vLLM runs general plugins in the API server, the engine core and every worker process, so
``register`` must be idempotent and cheap; it records that it ran (the status route shows the
count, which proves the plugin loaded inside the engine) and installs the weight-update hooks
(``weight_sync``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("agentkv.plugin")
CONNECTOR_NAME = "AgentKVConnector"
_registrations = 0


def registration_count() -> int:
    return _registrations


def register() -> None:
    global _registrations
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "agentkv_vllm.connector", "AgentKVConnector"
        )
    from agentkv_vllm import weight_sync

    weight_sync.install()  # weight updates invalidate the tiers (a no-op outside the engine core)
    _registrations += 1
