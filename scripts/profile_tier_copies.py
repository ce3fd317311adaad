"""Where the CPU data path's time goes (issue 27): drive it, then sort py-spy samples into buckets.

    # the device path at 1 MiB blocks of 64 runs, calls of BATCH shuffled blocks, REPS runs
    py-spy record -r 100 --native -f raw -o /tmp/copies.txt -- \
        python scripts/profile_tier_copies.py run BATCH REPS
    python scripts/profile_tier_copies.py summary /tmp/copies.txt

``AGENTKV_NATIVE_COPY=off`` profiles the numpy fallback (one numpy copy per run). The summary
counts only the store's worker threads and puts each sample in one bucket (docs/tiers.md).
"""

from __future__ import annotations

import collections
import os
import sys
import time

BUCKETS = (
    (
        "completing the handle (waking the caller)",
        lambda leaf, s: bool(s & {"TransferHandle._set", "TransferHandle._set_many"}),
    ),
    (
        "waiting for the GIL",
        lambda leaf, s: bool(s & {"pthread_cond_timedwait", "pthread_cond_wait", "take_gil"}),
    ),
    ("native kernel (memcpy)", lambda leaf, s: "copy_runs" in s and leaf.startswith("0x")),
    (
        "memcpy (numpy)",
        lambda leaf, s: (
            leaf.startswith("0x") and bool(s & {"_contig_to_contig", "PyArray_ConcatenateArrays"})
        ),
    ),
    (
        "numpy dispatch and views per run",
        lambda leaf, s: bool(
            s
            & {
                "PyArray_AssignArray",
                "array_assign_subscript",
                "PyArray_ConcatenateInto",
                "array_subscript",
                "prepare_index",
            }
        ),
    ),
    (
        "address arrays (per block)",
        lambda leaf, s: bool(s & {"BlockTable._copy_native", "BlockTable._use_native"}),
    ),
    (
        "address arrays, ids (per worker share)",
        lambda leaf, s: bool(s & {"BlockTable.copy_blocks", "HostArena.addresses"}),
    ),
    ("other native", lambda leaf, s: leaf.startswith("0x")),
    ("python bookkeeping (store index, locks, results)", lambda leaf, s: True),
)


def run(batch: int, reps: int) -> None:
    import torch

    from agentkv.tiers import native_copy
    from agentkv.tiers.bench import _measure_device, memory_copy_rates
    from agentkv.tiers.store import TieredStore

    native_copy.warm_up(background=False)
    block, total = 1 << 20, 128 << 20
    workers = int(os.environ.get("WORKERS", "4"))
    with TieredStore(total, None, 0, block, workers=workers) as store:
        wall, cpu = time.perf_counter(), time.process_time()
        rates = _measure_device(store, torch, "cpu", block, total, "host", reps, 32, "p", batch)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    copy, copy_cpu = memory_copy_rates(total, 3)
    print(
        f"native={native_copy.available()} store {rates[0]:.2f} load {rates[1]:.2f} GB/s "
        f"(memcpy {copy:.2f}); per CPU-s store {rates[2]:.2f} load {rates[3]:.2f} "
        f"(memcpy {copy_cpu:.2f}); wall {wall:.1f} s, cpu {cpu:.1f} s"
    )


def summary(path: str) -> None:
    counts: collections.Counter[str] = collections.Counter()
    with open(path) as lines:
        raw = list(lines)
    for line in raw:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = [frame.split(" (")[0] for frame in stack.split(";")]
        if not any(frame.endswith(("run_chunk", "_run_chunks.<locals>.run")) for frame in frames):
            continue  # not a store worker thread (per block: run_chunk; per share: run)
        seen = set(frames)
        bucket = next(name for name, match in BUCKETS if match(frames[-1], seen))
        counts[bucket] += int(count)
    total = sum(counts.values())
    print(f"{path}: {total} samples of the store's worker threads")
    for name, count in counts.most_common():
        print(f"  {count / total:6.1%}  {name}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]))
    else:
        for raw in sys.argv[2:]:
            summary(raw)
