"""Weight changes reach agentkv's tiers whatever the trainer names its RPC (issue 41's stale KV).

``weight_sync.install`` wraps vLLM's real ``EngineCore.collective_rpc`` and
``Scheduler.reset_prefix_cache``; the wrapped methods are called here on stand-in instances that
have what the wrappers read (the executor's ``collective_rpc``, the scheduler's connector), so no
engine is started. On today's name list (``WEIGHT_RPCS``: vLLM's own names only) the trainers'
methods below passed through without invalidating anything: the next rollout could load KV that
the old weights computed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv_vllm import weight_sync
from agentkv_vllm.settings import ConnectorSettings


class _Connector:
    def __init__(self, **settings: Any) -> None:
        self.settings = ConnectorSettings(**settings)
        self.reasons: list[str] = []

    def agentkv_weights_changed(self, reason: str) -> None:
        self.reasons.append(reason)


class _Executor:
    def __init__(self, connector: _Connector) -> None:
        self.connector = connector
        self.seen: list[tuple[Any, int]] = []  # the method, and the invalidations before it ran

    def collective_rpc(self, method: Any, timeout: Any, args: Any, kwargs: Any) -> list[Any]:
        self.seen.append((method, len(self.connector.reasons)))
        if method == "boom":
            raise RuntimeError("the RPC failed")
        return ["ok"]


def _core(**settings: Any) -> tuple[Any, _Connector, _Executor]:
    connector = _Connector(**settings)
    executor = _Executor(connector)
    core = SimpleNamespace(model_executor=executor, scheduler=SimpleNamespace(connector=connector))
    return core, connector, executor


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    assert weight_sync.install()


def _rpc(core: Any, method: Any) -> Any:
    from vllm.v1.engine.core import EngineCore

    return EngineCore.collective_rpc(core, method)


# Each framework's own weight-sync method (issue 41's table, read from their released sources).
TRAINER_RPCS = [
    "update_weights_from_ipc",  # verl 0.9.1
    "update_weights_ipc",  # SkyRL 0.3
    "skyrl_start_weight_update",
    "update_weight",  # OpenRLHF 0.11.2
    "update_weight_cuda_ipc",
    "broadcast_parameter",  # ROLL
    "update_parameter_in_bucket",
    "process_weights_after_loading",
    "areal_update_weights_from_disk",  # AReaL
    "update_named_param",  # TRL
    "reload_weights",  # vLLM's own
    "update_weights",
]


@pytest.mark.parametrize("method", TRAINER_RPCS)
def test_a_trainers_weight_rpc_invalidates_before_and_after_it_runs(method: str) -> None:
    core, connector, executor = _core()
    assert _rpc(core, method) == ["ok"]
    assert executor.seen == [(method, 1)]  # invalidated before the weights changed
    assert connector.reasons == [f"weights_{method}"] * 2


def test_a_callable_rpc_is_taken_as_a_weight_change() -> None:
    def poke(worker: Any) -> None:  # arbitrary code on the workers
        pass

    core, connector, _ = _core()
    _rpc(core, poke)
    assert connector.reasons == ["weights_poke", "weights_poke"]


@pytest.mark.parametrize("method", ["check_health", "list_loras", "get_model_inspection"])
def test_read_only_rpcs_leave_the_tiers_alone(method: str) -> None:
    core, connector, executor = _core()
    _rpc(core, method)
    assert executor.seen == [(method, 0)] and connector.reasons == []


def test_the_operator_extends_the_read_only_list() -> None:
    core, connector, _ = _core(readonly_rpcs=["my_stats"])
    _rpc(core, "my_stats")
    assert connector.reasons == []
    _rpc(core, "my_other_rpc")
    assert len(connector.reasons) == 2


def test_a_failing_weight_rpc_still_invalidates_after_it() -> None:
    core, connector, _ = _core()
    with pytest.raises(RuntimeError, match="the RPC failed"):
        _rpc(core, "boom")
    assert connector.reasons == ["weights_boom", "weights_boom"]


def test_engines_without_agentkv_pass_through() -> None:
    executor = _Executor(_Connector())
    core = SimpleNamespace(model_executor=executor, scheduler=SimpleNamespace(connector=object()))
    assert _rpc(core, "update_weight") == ["ok"]


def _reset(scheduler: Any, **kwargs: Any) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    # The wrapped method calls vLLM's own reset after the hook; stop there.
    with pytest.raises(AttributeError):
        Scheduler.reset_prefix_cache(scheduler, **kwargs)


@pytest.mark.parametrize(
    ("settings", "kwargs", "invalidated"),
    [
        ({}, {}, False),  # a plain reset keeps tier copies by default
        ({}, {"reset_connector": True}, True),
        ({"reset_invalidates_tiers": True}, {}, True),  # the RL switch
        ({"rl": True}, {}, True),  # `agentkv serve --rl` turns it on
        ({"rl": True, "reset_invalidates_tiers": False}, {}, False),  # explicit wins
    ],
)
def test_which_prefix_cache_resets_invalidate_the_tiers(
    settings: dict[str, Any], kwargs: dict[str, Any], invalidated: bool
) -> None:
    connector = _Connector(**settings)
    _reset(SimpleNamespace(connector=connector), **kwargs)
    assert connector.reasons == (["reset"] if invalidated else [])


class _KeepingConnector(_Connector):
    """A connector with the plain-reset hook: it records the call, then runs vLLM's reset."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.plain_resets = 0

    def agentkv_prefix_cache_reset(self, reset: Any) -> Any:
        self.plain_resets += 1
        return reset()


@pytest.mark.parametrize(
    ("settings", "kwargs", "through_hook"),
    [
        ({}, {}, True),  # issue 42: deferred contexts are copied across a plain reset
        ({}, {"reset_connector": True}, False),  # everything is invalidated: nothing to keep
        ({"reset_invalidates_tiers": True}, {}, False),
    ],
)
def test_a_plain_reset_runs_vllms_reset_through_the_connector(
    settings: dict[str, Any], kwargs: dict[str, Any], through_hook: bool
) -> None:
    connector = _KeepingConnector(**settings)
    _reset(SimpleNamespace(connector=connector), **kwargs)  # vLLM's own reset still ran
    assert connector.plain_resets == int(through_hook)
    assert connector.reasons == ([] if through_hook else ["reset"])


def test_changes_weights() -> None:
    assert weight_sync.changes_weights("update_weight")
    assert not weight_sync.changes_weights("check_health")
    assert not weight_sync.changes_weights("mine", frozenset({"mine"}))
    assert weight_sync.changes_weights(len)
