"""Reload phases from the workers to /metrics: the ranks' reports merge to the slowest rank per
phase, and the manager records each phase in ``agentkv_reload_phase_seconds``."""

from __future__ import annotations

import pytest

from agentkv.manager.jobs import ReloadPhase, WorkerReport
from tests.unit.sim_engine import make_rig


def test_a_report_with_only_phases_is_sent_and_ranks_merge_to_the_slowest() -> None:
    a = WorkerReport(reload_phases={ReloadPhase.COPY: 3e-4, ReloadPhase.PREPARE: 1e-4})
    b = WorkerReport(reload_phases={ReloadPhase.COPY: 2e-4, ReloadPhase.RELEASE: 1e-5})
    assert a and not WorkerReport()
    merged = a.merge(b)
    assert merged.reload_phases == {
        ReloadPhase.COPY: 3e-4,
        ReloadPhase.PREPARE: 1e-4,
        ReloadPhase.RELEASE: 1e-5,
    }
    assert a.reload_phases[ReloadPhase.COPY] == 3e-4 and len(b.reload_phases) == 2  # unchanged


def test_the_manager_records_each_phase_under_its_label() -> None:
    rig = make_rig()
    rig.mgr.on_report(
        WorkerReport(reload_phases={ReloadPhase.COPY: 2e-4, ReloadPhase.FORWARD: 0.01})
    )
    rig.mgr.on_report(WorkerReport(reload_phases={ReloadPhase.COPY: 4e-4}))
    rows = {
        row[0]: row
        for row in rig.mgr.metrics.snapshot()["histogram"]["agentkv_reload_phase_seconds"]
    }
    assert set(rows) == {"copy", "forward"}
    _, _, total, count = rows["copy"]
    assert count == 2 and total == pytest.approx(6e-4)
    assert rows["forward"][3] == 1
