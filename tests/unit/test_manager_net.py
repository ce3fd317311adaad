"""The net of issue 24 on the simulated engine: waiting for a remote fetch, cache_salt, a silent
rank, a damaged disk copy, what status/metrics/spans say, remote copies in the index. The rig: manager_helpers.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.manager_helpers import (
    P1,
    assert_answers,
    branch,
    counted,
    keys_of,
    offloaded,
)
from tests.unit.sim_engine import key_of, make_rig

# ============================================================================ remote fetch wait


def test_a_trajectory_never_seen_waits_pending_for_its_remote_fetch_then_loads_from_host() -> None:
    """The wait for a remote fetch is the manager's: the lookup of a trajectory this replica
    does not know answers PENDING until the fetch completes, then HIT from host."""
    from agentkv.manager import LookupStatus

    rig = make_rig(remote_enabled=True)
    offloaded(rig)  # its first lookup asked the (empty) remote tier too
    fetches = rig.mgr.counters["remote_fetches"]
    rig.settle()  # the upload of the confirmed host copies
    assert rig.mgr.counters["remote_uploaded_blocks"] == 4
    rig.mgr.delete("t1")  # its local copies go; the shared remote tier keeps them
    rig.eng.step()
    rig.flush()
    assert not rig.host_keys()
    req = rig.eng.new_request("elsewhere", "main", P1)
    hashes = rig.eng.hashes(P1)
    params = req.params
    first = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert first.status is LookupStatus.PENDING
    assert rig.mgr.counters["remote_fetches"] == fetches + 1
    again = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert again.status is LookupStatus.PENDING  # the fetch is still in flight
    rig.settle()  # the fetch completes: 4 blocks into host
    assert rig.mgr.counters["remote_fetched_blocks"] == 4
    assert len(rig.host_keys()) == 4
    hit = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert hit.status is LookupStatus.HIT and hit.tokens == 16
    assert rig.mgr.counters["remote_fetches"] == fetches + 1  # asked once per request
    assert counted(rig) == {
        "grace_expired": 1,
        "remote_fetched_blocks": 4,
        "remote_fetches": 2,
        "remote_missed_blocks": 4,
        "remote_uploaded_blocks": 4,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


# ============================================================================ net (issue 24)


def test_two_salts_with_the_same_tokens_share_no_key_and_no_block() -> None:
    """vLLM's cache_salt isolates tenants: the same tokens under another salt hit neither the
    device prefix cache nor a tier copy, and their blocks and keys are their own."""
    rig = make_rig()
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.settle()  # t1's context on host, its device blocks still cached
    salted = rig.eng.new_request("t2", "main", [*P1, 4], salt="tenant-b")
    rig.run(salted)
    assert salted.device_hit == 0 and salted.load_n == 0
    plain = rig.eng.new_request("t3", "main", [*P1, 4])  # the control: no salt hits both
    rig.eng.schedule(plain)
    assert plain.device_hit + plain.load_n * 4 >= 16
    rig.run(plain)
    salted_keys = {key_of(h) for h in rig.eng.hashes(salted.tokens, "tenant-b")}
    assert not salted_keys & set(keys_of(rig, plain.tokens))
    assert set(branch(rig, "t2", tenant="tenant-b").keys) == salted_keys
    assert not set(branch(rig, "t2", tenant="tenant-b").pinned) & set(branch(rig, "t3").pinned)
    assert not rig.eng.violations
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_trajectory_that_changes_salt_reuses_nothing_of_its_old_context() -> None:
    rig = make_rig()
    offloaded(rig)
    req = rig.eng.new_request("t1", "main", [*P1, 4], salt="tenant-b")
    rig.run(req)
    assert req.device_hit == 0 and req.load_n == 0 and req.status == "FINISHED"
    assert not rig.eng.violations
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_load_a_silent_rank_never_reports_waits_for_the_workers_deadline() -> None:
    """The manager timing out its load job tells vLLM nothing (no adapter code fails it): the
    request waits until the stuck rank's worker cancels the load at its own deadline, then
    vLLM recomputes the blocks and the turn finishes with true KV."""
    rig = make_rig(tp=2)
    offloaded(rig)
    rig.flush()
    rig.workers.silent.add(1)
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.eng.schedule(req)
    assert req.status == "WAITING_FOR_REMOTE_KVS" and req.load_n == 4
    rig.clock.advance(1.0)  # the workers start the load a second after the manager's job
    rig.eng.step()
    for p in rig.workers.completable():
        rig.workers.complete(p)
    rig.eng.deliver_reports()
    rig.clock.advance(9.5)
    rig.eng.step()  # the manager's job timed out
    assert rig.mgr.counters["job_timeouts"] == 1 and not rig.mgr.jobs
    rig.eng.deliver_reports()
    assert req.status == "WAITING_FOR_REMOTE_KVS"  # rank 1 has not answered: vLLM waits
    rig.clock.advance(1.0)
    rig.eng.step()  # rank 1's worker cancels the load at its own deadline
    rig.eng.deliver_reports()
    assert req.status == "RUNNING" and req.num_computed == 0  # everything is recomputed
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert not rig.mgr.jobs
    assert counted(rig) == {
        "grace_expired": 1,
        "job_timeouts": 1,
        "load_blocks": 4,
        "load_failures": 1,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_damaged_disk_copy_is_reported_corrupt_and_recomputed() -> None:
    rig = make_rig(disk=32)
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "human", 400.0)[1]["decision"]["action"] == "offload_disk"
    rig.settle()
    rig.flush()
    key = keys_of(rig, P1)[1]
    assert rig.workers.damage(0, key)
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.run(req, steps=16)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert rig.mgr.counters["tier_corrupt_blocks"] == 1
    assert rig.mgr.index.usable(key) is None and key not in rig.disk_keys()
    assert counted(rig) == {
        "load_blocks": 4,
        "load_failures": 1,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
        "tier_corrupt_blocks": 1,
    }
    assert_answers(rig, "t1")


class _Spans:
    """The manager's OTel port: pause spans started and ended, with their attributes."""

    def __init__(self) -> None:
        self.started: dict[tuple[str, str], dict[str, Any]] = {}
        self.ended: dict[tuple[str, str], dict[str, Any]] = {}

    def start_pause(self, key: tuple[str, str], attrs: dict[str, Any]) -> None:
        self.started[key] = attrs

    def end_pause(self, key: tuple[str, str], attrs: dict[str, Any]) -> None:
        self.ended[key] = attrs


def test_get_status_metrics_and_spans_say_what_happened_to_a_turn() -> None:
    """What operators read (GET, /status, the metrics, the pause span) matches one scripted
    turn exactly: a 4-block host hit, a pause, a resume (every field: ``assert_answers``)."""
    from agentkv import metrics as m
    from agentkv.metrics import counter_value

    rig = make_rig()
    spans = _Spans()
    rig.mgr.otel = spans
    offloaded(rig)  # t1: 4 blocks on host
    rig.flush()
    req = rig.turn("t1", [*P1, 4])  # 18 prompt tokens: 16 from host, nothing from the device
    assert req.status == "FINISHED"
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.CACHED_TOKENS.name, source="host") == 16
    assert counter_value(snap, m.CACHED_TOKENS.name, source="device") == 0
    assert counter_value(snap, m.PROMPT_TOKENS.name) == 17 + 18
    (ratio,) = [r for r in snap["histogram"][m.PREFIX_HIT_RATIO.name]]
    assert ratio[-1] == 2 and ratio[-2] == pytest.approx(0 / 17 + 16 / 18)

    code, body = rig.mgr.pause("t1", "main", "grep", 30.0)
    assert code == 200
    action = body["decision"]["action"]
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.DECISIONS.name, action=action) == 1
    (pred,) = snap["histogram"][m.TOOL_WAIT_PREDICTED.name]
    assert pred[0] == "grep" and pred[-1] == 1
    assert spans.started == {
        ("t1", "main"): {
            "agentkv.trajectory_id": "t1",
            "agentkv.branch": "main",
            "agentkv.tool": "grep",
            "agentkv.expected_wait_s": 30.0,
            "agentkv.predicted_wait_s": 30.0,
            "agentkv.action": "offload_host",
            "agentkv.kv_tokens": 18,  # P1 and its one new token
            "agentkv.kv_bytes": 4 << 20,
            "agentkv.rationale": body["decision"]["rationale"],
        }
    }

    rig.settle()
    code, view = rig.mgr.get("t1")
    assert code == 200 and view["trajectory_id"] == "t1"
    t1 = rig.mgr.table["t1"]
    assert view["prefix_hit_ratio"] == round(t1.prefix_hit_ratio, 6) > 0
    assert [t["tier_hit_tokens"] for t in view["turns"]] == [0, 16]
    on_host = {k for k in rig.mgr.index if rig.mgr.index.usable(k) == "host"}
    assert on_host and t1.owned <= on_host
    assert view["bytes_held"]["host"] == len(t1.owned) * (1 << 20)
    assert view["bytes_held"]["device_pinned"] == len(branch(rig).pinned) * (1 << 20)
    res = view["branches"]["main"]["residency_blocks"]
    assert res.get("host", 0) == len(set(branch(rig).keys) & on_host) > 0

    status = rig.mgr.status()
    assert status["pool"]["usage"] == round(rig.pool.usage(), 6)
    assert status["pool"]["pinned_blocks"] == sum(rig.pool.pins)
    assert status["tiers"]["host"]["blocks"] == rig.mgr.index.count("host") > 0
    assert status["trajectories"] == 1 and status["trajectory_ids"] == ["t1"]

    rig.clock.advance(5.0)
    resumed = rig.mgr.resume("t1", "main")
    assert spans.ended == {
        ("t1", "main"): {
            "agentkv.outcome": "resumed",
            "agentkv.observed_wait_s": 5.0,
            "agentkv.resumed_state": "offloaded",
            "agentkv.resumed_tier": "host",
            "agentkv.prefetch_outcome": None,
        }
    }
    assert counted(rig) == {
        "grace_expired": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }
    assert_answers(rig, "t1", pause=body, resume=resumed)


def test_the_index_knows_its_remote_copies_until_their_ttl_and_does_not_upload_them_again() -> None:
    """Remote copies are in the residency index (external, with a TTL): an upload this replica
    made is not sent again while the remote tier keeps it, and is once the TTL has passed."""
    from agentkv.tier import Tier

    rig = make_rig(remote_enabled=True, remote_ttl_s=100.0)
    offloaded(rig)
    rig.settle()
    keys = branch(rig).keys
    assert rig.mgr.counters["remote_uploaded_blocks"] == 4
    now = rig.clock.now()
    assert all(rig.mgr.index.external(k, now) for k in keys)
    assert all(rig.mgr.index.get(k).has(Tier.REMOTE) for k in keys)  # type: ignore[union-attr]
    assert not any(rig.mgr.index.get(k).has(Tier.DISK) for k in keys)  # type: ignore[union-attr]
    rig.mgr.transitions.upload(keys)
    assert not rig.mgr.jobs  # known to be there: nothing sent
    rig.clock.advance(101.0)
    assert not any(rig.mgr.index.external(k, rig.clock.now()) for k in keys)
    rig.mgr.transitions.upload(keys)
    assert [job.kind for job in rig.mgr.jobs.values()] == ["upload"]
    assert counted(rig) == {
        "grace_expired": 1,
        "remote_fetches": 1,
        "remote_missed_blocks": 4,
        "remote_uploaded_blocks": 4,
        "store_blocks": 4,
        "stores": 1,
    }


def test_the_pause_span_keeps_the_observed_wait_and_says_how_the_pause_ended() -> None:
    """Mutants pauses.Pauses.note_resume__mutmut_51 (the observed wait rounded to whole seconds)
    and ownership.Namespace.release__mutmut_25 (a DELETE ends the span without its outcome)."""
    rig = make_rig()
    spans = _Spans()
    rig.mgr.otel = spans
    offloaded(rig)
    assert rig.mgr.pause("t1", "main", "grep", 30.0)[0] == 200
    rig.clock.advance(2.25)
    rig.mgr.resume("t1", "main")
    ended = spans.ended.pop(("t1", "main"))
    assert ended["agentkv.outcome"] == "resumed"
    assert ended["agentkv.observed_wait_s"] == pytest.approx(2.25)
    assert rig.mgr.pause("t1", "main", "grep", 30.0)[0] == 200
    assert rig.mgr.delete("t1")[0] == 200
    assert spans.ended[("t1", "main")] == {"agentkv.outcome": "deleted"}
    assert counted(rig) == {
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }
