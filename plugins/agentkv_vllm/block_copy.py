"""Byte views of whole engine blocks: the one layout-specific piece of the plugin.

Primitives:
  BlockViews(kv_caches, num_blocks)  finds each layer tensor's block dimension and the memory
                                     runs one block occupies in it, once
  .table                             the cache as an agentkv.tiers.batched.BlockTable: per run
                                     (per layer, sorted by name, its runs in order) a
                                     ``[num_blocks, bytes]`` uint8 view sharing the cache's
                                     memory; batched gathers/scatters of many blocks go through it
  .block(block_id) -> BlockRef       one block as a buffer for the store (no copy, O(1))
  .block_bytes                       bytes of one block across all layers
  .layout                            a string naming device, dtype and, per layer, what one
                                     block's byte image depends on (shape with the block dim as
                                     ``*``, dimension order in memory, run sizes): part of the key
                                     fingerprint, so another layout never matches, while the pool
                                     size (num_blocks) is not in it: another pool size of the
                                     same deployment derives the same keys
  .layer_slices()                    per layer, in forward order: its name and the (segment
                                     index, byte offset in the block, bytes) of its segments,
                                     for layer-by-layer loads

A run is a stretch of memory holding only this block's bytes. One block of a layer is one run
when its elements are dense in memory whatever their logical order (vLLM CPU
``[num_blocks, heads, block_size, 2*head]``-style layouts, FlashInfer ``[num_blocks, 2, ...]``,
MLA ``[num_blocks, block_size, dim]``, and permuted HND strides), and one run per K/V half for
FlashAttention's ``[2, num_blocks, block_size, heads, dim]``; in general the block is split along
its outermost dimension until every piece is dense. Bytes are copied raw, whole blocks only (the
CPU kernel stores K transposed inside a block), so any layout round-trips exactly back into the
same layout, which the fingerprint enforces. How the bytes move (numpy per block on CPU, batched
index kernels and DMA on CUDA) is agentkv.tiers.batched's business.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from agentkv.tiers.batched import BlockRef, BlockTable, Run


def _dense(view: torch.Tensor) -> bool:
    """True when ``view``'s elements fill one gap-free stretch of memory (any dimension order)."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(view.stride(), view.shape, strict=True) if sz > 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """(element offset in storage, elements) of the dense stretches holding ``view``, in the
    order of its outermost dimensions, adjacent stretches merged."""
    if any(
        st < 0 or (st == 0 and sz > 1) for st, sz in zip(view.stride(), view.shape, strict=True)
    ):
        raise ValueError("KV cache tensors with negative or zero strides are not supported")
    if _dense(view):
        runs = [(int(view.storage_offset()), int(view.numel()))]
    else:
        outer = max(
            (d for d in range(view.dim()) if view.shape[d] > 1), key=lambda d: view.stride(d)
        )
        runs = [run for i in range(view.shape[outer]) for run in _runs(view.select(outer, i))]
    merged: list[tuple[int, int]] = []
    for offset, count in runs:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + count)
        else:
            merged.append((offset, count))
    return merged


class _Layer:
    """One layer tensor: a flat uint8 view of all its memory and block 0's runs in it."""

    def __init__(self, tensor: torch.Tensor, block_dim: int) -> None:
        element = tensor.element_size()
        span = 1 + sum((sz - 1) * st for sz, st in zip(tensor.shape, tensor.stride(), strict=True))
        base = tensor.storage_offset()
        flat = tensor.detach().as_strided((span,), (1,), base)
        self.flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        self.block_stride = tensor.stride(block_dim) * element
        block = tensor.select(block_dim, 0)
        self.runs = [((offset - base) * element, count * element) for offset, count in _runs(block)]
        if sum(n for _, n in self.runs) != block.numel() * element:
            raise ValueError("a block's memory runs do not add up to its size")  # a bug if seen

    def rows(self, num_blocks: int) -> list[torch.Tensor]:
        """Per run, a ``[num_blocks, bytes]`` view: row ``b`` is block ``b``'s bytes of the run."""
        base = self.flat.storage_offset()
        return [
            self.flat.as_strided((num_blocks, size), (self.block_stride, 1), base + offset)
            for offset, size in self.runs
        ]


def _block_layout(tensor: torch.Tensor, block_dim: int, layer: _Layer) -> str:
    """What decides one block's byte image in ``tensor``, and nothing else: the shape with the
    block dimension as ``*``, the order of the other dimensions in memory (outermost first; size-1
    dimensions hold no order) and the block's run sizes (how it splits, e.g. K/V halves). The pool
    size and absolute strides stay out, so two pool sizes of one deployment share keys, while
    another dimension order, dtype or split still differs."""
    shape = ",".join("*" if d == block_dim else str(n) for d, n in enumerate(tensor.shape))
    order = sorted(
        (d for d, n in enumerate(tensor.shape) if n > 1 or d == block_dim),
        key=lambda d: -tensor.stride()[d],
    )
    runs = ",".join(str(size) for _, size in layer.runs)
    return f"({shape})/order{''.join(map(str, order))}/runs{runs}"


class BlockViews:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.layer_names = sorted(kv_caches)
        self._tensors: list[torch.Tensor] = []
        self._block_dims: list[int] = []
        for name in self.layer_names:
            t = kv_caches[name]
            dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
            if not dims:
                raise ValueError(
                    f"layer {name}: no dimension of size num_blocks={num_blocks} in {tuple(t.shape)}"
                )
            self._tensors.append(t)
            self._block_dims.append(dims[0])
        self.device = self._tensors[0].device if self._tensors else torch.device("cpu")
        self.dtype = str(self._tensors[0].dtype).removeprefix("torch.") if self._tensors else "none"
        self._layers = [_Layer(t, d) for t, d in zip(self._tensors, self._block_dims, strict=True)]
        shapes = ";".join(
            _block_layout(t, d, layer)
            for t, d, layer in zip(self._tensors, self._block_dims, self._layers, strict=True)
        )
        self.layout = f"block-v2:{self.device.type}:{self.dtype}:{shapes}"
        self.block_bytes = sum(size for layer in self._layers for _, size in layer.runs)
        runs: list[Run] = []
        offset = 0
        for layer in self._layers:
            for rows in layer.rows(num_blocks):
                runs.append(Run(rows, offset))
                offset += int(rows.shape[1])
        self.table = BlockTable(runs)

    def layer_slices(self) -> list[tuple[str, list[tuple[int, int, int]]]]:
        """Each layer's segments as (segment index, byte offset in the block, bytes), layers in
        forward order (``layers.2`` before ``layers.10``, unlike the sorted segment order)."""
        out: list[tuple[str, list[tuple[int, int, int]]]] = []
        index = offset = 0
        for name, layer in zip(self.layer_names, self._layers, strict=True):
            segs = []
            for _, size in layer.runs:
                segs.append((index, offset, size))
                index += 1
                offset += size
            out.append((name, segs))

        def forward_order(item: tuple[str, Any]) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", item[0]))

        return sorted(out, key=forward_order)

    def block(self, block_id: int) -> BlockRef:
        """The block as a store buffer (no copy): its image is the runs back to back."""
        return self.table.block(block_id)
