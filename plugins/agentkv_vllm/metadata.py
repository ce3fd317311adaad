"""What crosses between the scheduler-side and worker-side connectors each step.

Primitives:
  AgentKVStepMetadata    scheduler -> workers: the manager's StepPlan for one step
  AgentKVWorkerReport    workers -> scheduler: one rank's WorkerReport; ``aggregate`` merges ranks
                         (a job is complete when every TP rank counted it)

The payloads are the core's plain dataclasses (``agentkv.manager.jobs``); these wrappers only give
them the vLLM base classes. The multiprocessing executor pickles them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from agentkv.manager.jobs import StepPlan, WorkerReport


@dataclass
class AgentKVStepMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class AgentKVWorkerReport(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AgentKVWorkerReport)
        return AgentKVWorkerReport(self.report.merge(other.report))
