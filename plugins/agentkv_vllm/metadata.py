"""What crosses between the scheduler-side and worker-side connectors each step.

Primitives:
  BlockTransfer          one block: its logical key and the engine block id
  StoreJob / LoadJob     a batch of blocks to copy device -> tier / tier -> device
  AgentKVStepMetadata    scheduler -> workers: the jobs and key drops of one step
  AgentKVWorkerReport    workers -> scheduler: finished stores (counted per rank, so a hold is
                         released only when every TP rank reported), and failed blocks

Plain dataclasses of builtins: the multiprocessing executor pickles them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class BlockTransfer:
    key: bytes
    block_id: int


@dataclass
class StoreJob:
    job_id: int
    tier: str  # "host" | "disk"
    blocks: list[BlockTransfer]
    owner: str
    lease_until_s: float | None = None  # seconds from now; monotonic clocks differ per process


@dataclass
class LoadJob:
    req_id: str
    blocks: list[BlockTransfer]
    # True: copy layer by layer during this step's forward (vLLM scheduled the request already);
    # False: the request waits in WAITING_FOR_REMOTE_KVS until the worker reports it loaded.
    layerwise: bool = False


@dataclass
class AgentKVStepMetadata(KVConnectorMetadata):
    stores: list[StoreJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    drop_keys: list[bytes] = field(default_factory=list)
    promote_keys: list[bytes] = field(default_factory=list)


@dataclass
class AgentKVWorkerReport(KVConnectorWorkerMetadata):
    # job_id -> number of ranks that finished it; ok=False if any rank failed
    stores_done: dict[int, int] = field(default_factory=dict)
    stores_failed: set[int] = field(default_factory=set)
    # keys a rank could not serve (evicted, corrupt): the scheduler forgets them
    missing_keys: set[bytes] = field(default_factory=set)
    # rank -> pid of the worker process, sent once (shows the plugin loaded in every worker)
    hello: dict[int, int] = field(default_factory=dict)
    # (kind "offload"|"reload", tier, job ref) -> (bytes, seconds) of each finished transfer job
    transfers: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AgentKVWorkerReport)
        out = AgentKVWorkerReport(
            stores_done=dict(self.stores_done),
            stores_failed=self.stores_failed | other.stores_failed,
            missing_keys=self.missing_keys | other.missing_keys,
            hello={**self.hello, **other.hello},
            transfers=dict(self.transfers),
        )
        for job, n in other.stores_done.items():
            out.stores_done[job] = out.stores_done.get(job, 0) + n
        # Ranks move their shards in parallel: bytes add up, the slowest rank sets the time.
        for ref, (nbytes, seconds) in other.transfers.items():
            b0, s0 = out.transfers.get(ref, (0, 0.0))
            out.transfers[ref] = (b0 + nbytes, max(s0, seconds))
        return out
