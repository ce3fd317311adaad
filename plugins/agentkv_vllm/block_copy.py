"""Byte views of whole engine blocks: the one device-specific piece of the plugin.

Primitives:
  BlockViews(kv_caches, num_blocks)  finds each layer tensor's block dimension once
  .segments(block_id) -> list[np.ndarray]   uint8 views (CPU) of one block, one per layer (or
                                            per K/V half), in a fixed order; writable
  .block_bytes                              bytes of one block across all layers
  .layout                                   a string naming shapes/dtype: part of the key
                                            fingerprint, so another layout never matches
  .layer_slices()                           per layer, in forward order: its name and the
                                            (segment index, byte offset in the block, bytes) of
                                            its segments, for layer-by-layer loads

Only whole-block copies are layout-safe (the CPU kernel stores K transposed inside a block), so
segments never split a block. On CUDA the views are device tensors; ``DeviceStaging`` copies
them through a pinned host buffer.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch


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
        shapes = ";".join(
            f"{tuple(t.shape)}@{d}" for t, d in zip(self._tensors, self._block_dims, strict=True)
        )
        self.layout = f"{self.device.type}:{self.dtype}:{shapes}"
        self.block_bytes = sum(self._segment_nbytes(i) for i in range(len(self._tensors)))
        # Segments per layer tensor: 1 when a block is contiguous in it, else one per K/V half.
        self._segment_counts = [
            1 if t.select(d, 0).is_contiguous() else int(t.select(d, 0).shape[0])
            for t, d in zip(self._tensors, self._block_dims, strict=True)
        ]

    def layer_slices(self) -> list[tuple[str, list[tuple[int, int, int]]]]:
        """Each layer's segments as (segment index, byte offset in the block, bytes), layers in
        forward order (``layers.2`` before ``layers.10``, unlike the sorted segment order)."""
        out: list[tuple[str, list[tuple[int, int, int]]]] = []
        index = offset = 0
        for i, name in enumerate(self.layer_names):
            n = self._segment_counts[i]
            size = self._segment_nbytes(i) // n
            out.append((name, [(index + j, offset + j * size, size) for j in range(n)]))
            index += n
            offset += n * size

        def forward_order(item: tuple[str, Any]) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", item[0]))

        return sorted(out, key=forward_order)

    def _segment_nbytes(self, i: int) -> int:
        t, d = self._tensors[i], self._block_dims[i]
        return t.element_size() * t.numel() // t.shape[d]

    def _block_tensors(self, block_id: int) -> list[torch.Tensor]:
        out = []
        for t, d in zip(self._tensors, self._block_dims, strict=True):
            view = t.select(d, block_id)
            if view.is_contiguous():
                out.append(view)
            else:
                # e.g. CUDA [2, num_blocks, ...]: K and V halves are each contiguous
                out.extend(view.unbind(0))
        return out

    def segments(self, block_id: int) -> list[Any]:
        """uint8 views of the block (CPU: numpy views sharing the KV memory, writable)."""
        tensors = self._block_tensors(block_id)
        if self.device.type == "cpu":
            return [x.contiguous().view(torch.uint8).reshape(-1).numpy() for x in tensors]
        return [x.view(torch.uint8).reshape(-1) for x in tensors]

    @property
    def is_host(self) -> bool:
        return self.device.type == "cpu"


def to_host(segments: list[Any]) -> np.ndarray:
    """Concatenate device segments into one host buffer (CUDA path)."""
    flat = torch.cat([s for s in segments]).to("cpu", non_blocking=False)
    return flat.numpy()


def from_host(segments: list[Any], data: np.ndarray) -> None:
    """Scatter one host buffer back into device segments (CUDA path)."""
    src = torch.from_numpy(data)
    offset = 0
    for s in segments:
        n = s.numel()
        s.copy_(src[offset : offset + n].to(s.device, non_blocking=False))
        offset += n
