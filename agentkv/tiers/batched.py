"""Batched block copies: many engine blocks per call, one operation per KV run, CPU and CUDA.

Primitives:
    Run                     one stretch of every block in one KV tensor: a 2-D uint8 torch view
                            ``[num_blocks, size]`` of the cache (rows contiguous, any row stride)
                            and where those bytes sit in a block's contiguous image (the host copy).
    BlockTable(runs)        the whole KV cache as runs, built once; ``block_bytes`` is the image
                            size. The image of a block is its runs back to back, in run order.
    BlockTable.block(b)     block ``b`` as a BlockRef: a BlockBuffer the store copies in one pass
                            (O(1) to make; no per-run tensor is created at submit time).
    BlockTable.gather(ids, out)
                            blocks ``ids`` into the rows of ``out`` (``[n, block_bytes]`` uint8, on
                            the cache's device): one ``index_select`` per run for the whole batch.
    BlockTable.scatter(ids, src)
                            rows of ``src`` into blocks ``ids``: one ``index_copy_`` per run.
    BlockTable.copy_blocks(ids, hosts, to_host)
                            CPU: every run of blocks ``ids`` to or from host images at raw
                            addresses ``hosts`` (host arena slots), one native call, streaming
                            stores (the store's batched host transfers, store_batched.py).
    BlockTable.copy_runs_from_host(ids, sources, runs)
                            layer-by-layer loads: runs ``runs`` of blocks ``ids`` from their host
                            images (pinned host arena views); CUDA: one batched pointer copy
                            (vLLM's ``swap_blocks_batch``) when the installed vLLM has it.
    BlockTable.host_batch(ids, hosts) -> HostBatch | None
                            CPU: blocks and the arena addresses of their host images as the
                            kernel's arrays, made once; ``.copy(runs)`` is then one native call
                            per layer (or one for all runs) and nothing else.
    BlockRef                one block of a table: ``gather_into(dest)`` / ``scatter_from(src)``
                            copy its image (CPU: every run in one native call, native_copy.py;
                            numpy per run until the kernel is compiled or without numba),
                            ``device_segments()`` (CUDA).
    StagedBlocks.gather(table, ids)
                            CUDA stores: blocks ``ids`` gathered (one ``index_select`` per run)
                            into a fresh device staging region ``[n, block_bytes]`` on a copy
                            stream, after the work queued on the caller's stream; ``rows`` are
                            one-segment DeviceSegments carrying that event, which the store copies
                            to the pinned host arena with one DMA each.
    StagedBlocks.for_load(table, ids), .scatter(ok)
                            CUDA loads: the store DMAs each block into its staging row; then, on
                            the caller's stream (the engine's: its next forward is ordered after
                            it), one ``index_copy_`` per run writes the rows that loaded.
    staging_budget(table, count)
                            how many of a step's blocks go through staging (0 off CUDA; the rest
                            as BlockRefs): bounded, the region is device memory vLLM did not
                            budget for.
    copy_stream(device, role)
                            the dedicated CUDA stream of one kind of copy on one device (made
                            once; the gathers here, the plugin's layer-by-layer loads).

Why two shapes of batching. On CUDA the cost of a copy is its launch: a step's stores are gathered
on the device with one ``index_select`` kernel per run into a contiguous device staging region,
which then crosses PCIe one DMA per block into the (pinned) host arena; loads go the other way
(one DMA per block into staging, one ``index_copy_`` per run). Submit cost is O(runs) kernels plus
O(blocks) large DMAs per step, never O(blocks x runs). On CPU there is no DMA and no launch: a
torch index op costs more per row than numpy's copy loop (measured, docs/tiers.md), and a
staging region would move every byte twice, so each block is copied once, directly between the
KV cache and its host slot, by the store's worker threads: a host-tier store or load is one
native call per worker share for all its blocks (``copy_blocks``, store_batched.py: run
addresses computed in the kernel, GIL released, streaming stores), a block to or from the disk
tier's staging buffer one call per block (``BlockRef``), a layer-by-layer batch one call per
layer for every block; numpy per run is the fallback.

Bytes are copied raw, whole runs only: any layout round-trips exactly into the same layout (the
key fingerprint names the layout, so a block never lands in another one). Importing this module
never imports torch; the torch objects come from the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from agentkv.tiers import native_copy
from agentkv.tiers.device import DeviceSegments, loaded_torch

Tensor = Any
ByteArray = npt.NDArray[np.uint8]
# Device memory one step's staging may take (stores and loads each); blocks beyond it take the
# per-block path. vLLM sized the KV cache to the GPU, so this must stay small next to it.
STAGING_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """Every block's bytes of one stretch of one KV tensor: ``rows[b]`` is block ``b``'s stretch
    (``size`` contiguous bytes) and ``offset`` its place in the block's image."""

    rows: Tensor
    offset: int

    @property
    def size(self) -> int:
        return int(self.rows.shape[1])


def _pointer_copy_op() -> Any:
    """vLLM's batched pointer copy (``swap_blocks_batch``: one driver call for many copies), or
    None where the installed vLLM build has none (CPU builds)."""
    torch = loaded_torch()
    try:
        return torch.ops._C_cache_ops.swap_blocks_batch
    except (AttributeError, RuntimeError):
        return None


class BlockTable:
    """A KV cache as runs (see module docstring). Thread-safe for reads of distinct blocks."""

    def __init__(self, runs: Sequence[Run]) -> None:
        """Raises ValueError for no runs, runs on several devices, or an image with gaps."""
        if not runs:
            raise ValueError("a block table needs at least one run")
        self.runs = list(runs)
        self.device = self.runs[0].rows.device
        if any(run.rows.device != self.device for run in self.runs):
            raise ValueError("every run of a block table must be on one device")
        self.num_blocks = int(self.runs[0].rows.shape[0])
        offset = 0
        for run in self.runs:
            if run.offset != offset or int(run.rows.shape[0]) != self.num_blocks:
                raise ValueError("runs must tile the block image in order, one row per block")
            offset += run.size
        self.block_bytes = offset
        self.is_cuda = self.device.type == "cuda"
        # CPU: numpy views of the same memory, made once (a numpy row view costs ~0.1 us, a torch
        # one ~2 us): the per-block copies below create no torch objects.
        self._arrays: list[ByteArray] = [] if self.is_cuda else [r.rows.numpy() for r in self.runs]
        self._bounds = [(run.offset, run.offset + run.size) for run in self.runs]
        # CPU: every run as (address of block 0's piece, bytes between blocks, offset in the
        # image, size), so one native call copies a block's pieces (native_copy.py).
        self._bases = np.array([r.rows.data_ptr() for r in self.runs], np.int64)
        self._strides = np.array([r.rows.stride(0) for r in self.runs], np.int64)
        self._offsets = np.array([start for start, _ in self._bounds], np.int64)
        self._sizes = np.array([run.size for run in self.runs], np.int64)
        self._geometry = (self._bases, self._strides, self._offsets, self._sizes)
        self._all_runs = np.arange(len(self.runs), dtype=np.int64)
        self._native = not self.is_cuda and all(
            run.rows.dtype == loaded_torch().uint8 and (run.size <= 1 or run.rows.stride(1) == 1)
            for run in self.runs
        )
        if self._native:
            native_copy.warm_up()  # compiles on a daemon thread; numpy copies until it is ready

    def block(self, block_id: int) -> BlockRef:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range (0..{self.num_blocks - 1})")
        return BlockRef(self, block_id)

    def _index(self, ids: Sequence[int] | Tensor) -> Tensor:
        torch = loaded_torch()
        if isinstance(ids, torch.Tensor):
            return ids.to(device=self.device, dtype=torch.int64)
        return torch.tensor(list(ids), dtype=torch.int64).to(self.device, non_blocking=True)

    def gather(self, ids: Sequence[int] | Tensor, out: Tensor) -> None:
        """Copy blocks ``ids`` into ``out[i]`` (``[len(ids), block_bytes]`` uint8, this device),
        one ``index_select`` per run, on the current stream."""
        torch = loaded_torch()
        index = self._index(ids)
        if tuple(out.shape) != (int(index.numel()), self.block_bytes):
            raise ValueError(
                f"out has shape {tuple(out.shape)}, expected ({index.numel()}, {self.block_bytes})"
            )
        for run, (start, stop) in zip(self.runs, self._bounds, strict=True):
            torch.index_select(run.rows, 0, index, out=out[:, start:stop])

    def scatter(self, ids: Sequence[int] | Tensor, src: Tensor) -> None:
        """Copy ``src[i]`` into block ``ids[i]``, one ``index_copy_`` per run, on the current
        stream. ``ids`` must not repeat."""
        if not self.is_cuda:  # index_copy_ on CPU runs per element: ~20x slower than numpy rows
            rows = src.numpy()
            if rows.shape != (len(ids), self.block_bytes):
                raise ValueError(
                    f"src has shape {rows.shape}, expected ({len(ids)}, {self.block_bytes})"
                )
            images, block_ids = list(rows), [int(b) for b in ids]
            if self._use_native(block_ids, images):
                self._copy_native(block_ids, images, None, to_host=False)
                return
            for row, block_id in zip(images, block_ids, strict=True):
                self._scatter_block(block_id, row)
            return
        index = self._index(ids)
        if tuple(src.shape) != (int(index.numel()), self.block_bytes):
            raise ValueError(
                f"src has shape {tuple(src.shape)}, expected ({index.numel()}, {self.block_bytes})"
            )
        for run, (start, stop) in zip(self.runs, self._bounds, strict=True):
            run.rows.index_copy_(0, index, src[:, start:stop])

    def copy_runs_from_host(
        self, ids: Sequence[int], sources: Sequence[ByteArray], runs: Sequence[int]
    ) -> None:
        """Copy runs ``runs`` of each block ``ids[i]`` from ``sources[i]`` (its host image).

        CPU: synchronous numpy copies. CUDA: queued on the current stream (the caller's copy
        stream) as one batched pointer copy when vLLM's op is present, else one ``copy_`` per
        run and block; the caller keeps ``sources`` alive (and pinned) until the stream is past.
        """
        if not self.is_cuda:
            if self._use_native(ids, sources):
                self._copy_native(ids, sources, runs, to_host=False)
                return
            for block_id, source in zip(ids, sources, strict=True):
                for r in runs:
                    start, stop = self._bounds[r]
                    self._arrays[r][block_id] = source[start:stop]
            return
        op = _pointer_copy_op()
        if op is not None:
            op(*self._pointers(ids, sources, runs), True)  # sources: host memory nobody writes
            return
        torch = loaded_torch()
        for block_id, source in zip(ids, sources, strict=True):
            host = _host_tensor(torch, source)
            for r in runs:
                start, stop = self._bounds[r]
                self.runs[r].rows[block_id].copy_(host[start:stop], non_blocking=True)

    def _pointers(
        self, ids: Sequence[int], sources: Sequence[ByteArray], runs: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(source, destination, size) int64 CPU tensors, one entry per (block, run)."""
        torch = loaded_torch()
        blocks = torch.tensor(list(ids), dtype=torch.int64)
        hosts = torch.tensor([int(s.ctypes.data) for s in sources], dtype=torch.int64)
        offsets = torch.tensor([self._bounds[r][0] for r in runs], dtype=torch.int64)
        bases = torch.tensor([self.runs[r].rows.data_ptr() for r in runs], dtype=torch.int64)
        strides = torch.tensor([self.runs[r].rows.stride(0) for r in runs], dtype=torch.int64)
        sizes = torch.tensor([self.runs[r].size for r in runs], dtype=torch.int64)
        src = (hosts[:, None] + offsets[None, :]).reshape(-1)
        dst = (bases[None, :] + blocks[:, None] * strides[None, :]).reshape(-1)
        return src, dst, sizes.repeat(len(ids))

    # --- CPU: native batched copies --------------------------------------------------------------

    def _use_native(self, ids: Sequence[int], images: Sequence[ByteArray]) -> bool:
        """True when the native kernel is ready and the raw copies are safe: every id in range
        and every host image a C-contiguous byte array of at least ``block_bytes``."""
        if not (self._native and native_copy.available()):
            return False
        if any(not 0 <= int(b) < self.num_blocks for b in ids):
            raise IndexError(f"block id out of range (0..{self.num_blocks - 1}): {list(ids)}")
        return all(
            isinstance(image, np.ndarray)
            and image.dtype == np.uint8
            and image.flags.c_contiguous
            and image.nbytes >= self.block_bytes
            for image in images
        )

    @property
    def copies_natively(self) -> bool:
        """True when ``copy_blocks`` may be used now (CPU table, native kernel compiled)."""
        return self._native and native_copy.available()

    def copy_blocks(
        self, ids: npt.NDArray[np.int64], hosts: npt.NDArray[np.int64], *, to_host: bool
    ) -> None:
        """Every run of blocks ``ids`` between the cache and the host images at addresses
        ``hosts`` (``block_bytes`` each, live memory the caller owns, e.g. host arena slots), one
        native call, streaming stores (the images are not read again soon, the store's host
        tier; see native_copy). Requires ``copies_natively``; IndexError for ids out of range."""
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range (0..{self.num_blocks - 1}): {ids.tolist()}")
        native_copy.copy_runs(hosts, ids, self._geometry, self._all_runs, to_host, True)

    def host_batch(self, ids: Sequence[int], hosts: Sequence[int]) -> HostBatch | None:
        """Blocks ``ids`` and the addresses ``hosts`` of their host images (``block_bytes`` of
        live memory each that nobody writes meanwhile, e.g. pinned host arena slots:
        ``HostRead.addresses``) as the kernel's arrays, made once for several ``HostBatch.copy``
        calls (a layer-by-layer load: one per layer, or one for every run); None where
        ``copy_runs_from_host`` must be used instead (CUDA, native kernel not compiled yet).
        IndexError for ids out of range."""
        if not self.copies_natively:
            return None
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):  # a few ids: no numpy calls
            raise IndexError(f"block id out of range (0..{self.num_blocks - 1}): {list(ids)}")
        return HostBatch(self, np.array(ids, np.int64), np.array(hosts, np.int64))

    def _copy_native(
        self,
        ids: Sequence[int],
        images: Sequence[ByteArray],
        runs: Sequence[int] | None,
        *,
        to_host: bool,
    ) -> None:
        """Runs ``runs`` (None: all) of blocks ``ids`` between the cache and their host images,
        one native call (the kernel computes each piece's addresses from the table's arrays).
        Writes into the cache use streaming stores, as ``copy_blocks``' do; writes into host
        images do not: one may be a disk staging buffer its checksum reads right after."""
        hosts = np.array([image.__array_interface__["data"][0] for image in images], np.int64)
        blocks = np.array(ids, np.int64)
        which = self._all_runs if runs is None else np.array(runs, np.int64)
        native_copy.copy_runs(hosts, blocks, self._geometry, which, to_host, not to_host)

    # --- one block (BlockRef) -------------------------------------------------------------------

    def _gather_block(self, block_id: int, dest: ByteArray) -> None:
        if self._use_native([block_id], [dest]) and dest.flags.writeable:
            self._copy_native([block_id], [dest], None, to_host=True)
            return
        np.concatenate([array[block_id] for array in self._arrays], out=dest)

    def _scatter_block(self, block_id: int, src: ByteArray) -> None:
        if self._use_native([block_id], [src]):
            self._copy_native([block_id], [src], None, to_host=False)
            return
        for array, (start, stop) in zip(self._arrays, self._bounds, strict=True):
            array[block_id] = src[start:stop]


@dataclass(frozen=True, slots=True)
class HostBatch:
    """Blocks of a CPU BlockTable and the addresses of their host images, checked once
    (``BlockTable.host_batch``): each ``copy`` is one native call and no other per-call work.

    Why: a layer-by-layer load copies the same blocks once per layer; checking the images and
    asking numpy for their addresses per call (``copy_runs_from_host``) cost ~12 us of Python
    per layer for 8 blocks (1.5 us per ``__array_interface__``; reload_phases bench,
    docs/tiers.md), a third of copying them. The caller keeps the images alive (pinned host
    arena slots) until its last ``copy``."""

    table: BlockTable
    blocks: npt.NDArray[np.int64]
    hosts: npt.NDArray[np.int64]

    def copy(self, runs: npt.NDArray[np.int64] | None = None) -> None:
        """Runs ``runs`` (None: every run) of each block from its host image into the cache,
        streaming stores, GIL released."""
        table = self.table
        which = table._all_runs if runs is None else runs
        native_copy.copy_runs(self.hosts, self.blocks, table._geometry, which, False, True)


def _host_tensor(torch: Any, array: ByteArray) -> Tensor:
    if not array.flags.writeable:  # torch warns on read-only arrays; it only reads this one
        array = array.view()
        array.flags.writeable = True
    return torch.from_numpy(array)


class BlockRef(Sequence[ByteArray]):
    """One block of a BlockTable, handed to the store as its buffer (see buffers.as_segments).

    CPU: ``gather_into`` / ``scatter_from`` copy the whole image with numpy, one pass; as a
    sequence it is the block's runs as numpy views (for consumers that walk segments, e.g. the
    remote tier). CUDA: ``device_segments()`` gives the per-run DeviceSegments path (device.py).
    """

    __slots__ = ("block_id", "table")

    def __init__(self, table: BlockTable, block_id: int) -> None:
        self.table = table
        self.block_id = block_id

    @property
    def nbytes(self) -> int:
        return self.table.block_bytes

    @property
    def on_host(self) -> bool:
        return not self.table.is_cuda and self.table.device.type == "cpu"

    def __len__(self) -> int:
        return len(self.table.runs)

    def __getitem__(self, index: Any) -> Any:
        if not self.on_host:
            raise TypeError("device blocks have no host views; use device_segments()")
        return [array[self.block_id] for array in self.table._arrays][index]

    def __iter__(self) -> Any:
        if not self.on_host:
            raise TypeError("device blocks have no host views; use device_segments()")
        return iter([array[self.block_id] for array in self.table._arrays])

    def gather_into(self, dest: ByteArray) -> None:
        """Copy the block's image into ``dest`` (exactly ``nbytes`` long, host)."""
        self.table._gather_block(self.block_id, dest)

    def scatter_from(self, src: ByteArray) -> None:
        """Copy ``src`` (at least ``nbytes``, host) into the block."""
        self.table._scatter_block(self.block_id, src)

    def device_segments(self) -> DeviceSegments:
        return DeviceSegments([run.rows[self.block_id] for run in self.table.runs])


_streams: dict[tuple[str, Any], Any] = {}
_streams_lock = threading.Lock()


def copy_stream(device: Any, role: str) -> Any:
    """One dedicated CUDA stream per (role, device), made on first use and shared by every step
    after: the store gathers (``"gather"``, here) and the layer-by-layer loads (``"layers"``,
    the plugin's LayerCopier) each get their own, so neither queues behind the other."""
    torch = loaded_torch()
    with _streams_lock:
        stream = _streams.get((role, device))
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _streams[(role, device)] = stream
        return stream


def staging_budget(table: BlockTable, count: int) -> int:
    """How many of ``count`` blocks one step stages on the device (0 off CUDA)."""
    if not table.is_cuda:
        return 0
    return min(count, max(1, STAGING_BYTES // table.block_bytes))


class StagedBlocks:
    """A batch of whole blocks in a device staging region (see module docstring)."""

    def __init__(
        self,
        table: BlockTable,
        ids: list[int],
        staging: Tensor,
        rows: list[DeviceSegments] | None = None,
    ) -> None:
        self.table = table
        self.ids = ids
        self.staging = staging  # kept alive here until the store's copies of it are done
        self.rows = rows if rows is not None else [DeviceSegments([r]) for r in staging.unbind(0)]

    def slice(self, start: int, stop: int) -> StagedBlocks:
        """Blocks ``start:stop`` of this batch (one job's share), same staging memory."""
        return StagedBlocks(
            self.table, self.ids[start:stop], self.staging[start:stop], self.rows[start:stop]
        )

    @classmethod
    def gather(cls, table: BlockTable, ids: list[int]) -> StagedBlocks:
        """Blocks ``ids`` gathered on the copy stream; each row's ready event orders the store's
        DMA after the gather, and the gather waits for the caller's queued work."""
        torch = loaded_torch()
        device = table.device
        caller = torch.cuda.current_stream(device)
        stream = copy_stream(device, "gather")
        staging = torch.empty((len(ids), table.block_bytes), dtype=torch.uint8, device=device)
        with torch.cuda.stream(stream):
            stream.wait_stream(caller)
            table.gather(ids, staging)
            ready = stream.record_event()
        staging.record_stream(stream)
        staged = cls(table, ids, staging)
        for row in staged.rows:
            row.ready = ready
        return staged

    @classmethod
    def for_load(cls, table: BlockTable, ids: list[int]) -> StagedBlocks:
        torch = loaded_torch()
        staging = torch.empty((len(ids), table.block_bytes), dtype=torch.uint8, device=table.device)
        return cls(table, ids, staging)

    def scatter(self, ok: list[bool]) -> None:
        """Write the rows whose load succeeded into their blocks, on the current stream (call
        it before anyone may read those blocks)."""
        rows = [i for i, good in enumerate(ok) if good]
        if not rows:
            return
        if len(rows) == len(self.ids):
            self.table.scatter(self.ids, self.staging)
            return
        torch = loaded_torch()
        index = torch.tensor(rows, dtype=torch.int64).to(self.staging.device)
        self.table.scatter([self.ids[i] for i in rows], self.staging.index_select(0, index))
