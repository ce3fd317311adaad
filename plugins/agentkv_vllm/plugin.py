"""``vllm.general_plugins`` entry point: registers AgentKVConnector with vLLM's factory.

vLLM runs general plugins in the API server, the engine core and every worker process, so
``register`` must be idempotent and cheap; it records that it ran (the status route shows the
count, which proves the plugin loaded inside the engine) and installs the weight-update hooks
(``weight_sync``) and hands the ``agentkv`` loggers vLLM's log handler (``share_vllm_logging``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("agentkv.plugin")
CONNECTOR_NAME = "AgentKVConnector"
_registrations = 0


def registration_count() -> int:
    return _registrations


class _VllmHandlers(logging.Handler):
    """Emits through the ``vllm`` logger's handlers as they are at the time of the record:
    vLLM may configure its logging again (``dictConfig`` replaces the handler objects)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def share_vllm_logging() -> bool:
    """The ``agentkv.*`` loggers log as vLLM's own do: through its handler, at its level
    (VLLM_LOGGING_LEVEL, INFO by default), in the server log. A logger outside the ``vllm``
    namespace has no handler (vLLM's does not propagate), and Python's last resort drops INFO,
    so a pause decision never showed. Leaves alone a deployment that configured logging itself
    (a handler on ``agentkv`` or the root logger, or VLLM_CONFIGURE_LOGGING=0). Idempotent."""
    pkg = logging.getLogger("agentkv")
    vllm_log = logging.getLogger("vllm")
    if pkg.handlers or logging.getLogger().handlers or not vllm_log.handlers:
        return False
    pkg.addHandler(_VllmHandlers())
    if pkg.level == logging.NOTSET:
        pkg.setLevel(vllm_log.getEffectiveLevel())
    pkg.propagate = False  # never twice (a root handler added later)
    return True


def register() -> None:
    global _registrations
    share_vllm_logging()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "agentkv_vllm.connector", "AgentKVConnector"
        )
    from agentkv_vllm import weight_sync

    weight_sync.install()  # weight updates invalidate the tiers (a no-op outside the engine core)
    _registrations += 1
