"""The trainer's side of ``agentkv bench rollout``: a weight sync that really changes the weights.

Primitives:
  RolloutWeightSync     a vLLM worker extension (``--worker-extension-cls``) with OpenRLHF
                        0.11's weight-sync method, ``update_weight(name, dtype, shape,
                        empty_cache)``, called through ``POST /collective_rpc``; the payload
                        names a checkpoint folder, which the worker reloads in place
                        (``reload_weights``), where OpenRLHF broadcasts one parameter over NCCL
  EXTENSION             its import path, for ``--worker-extension-cls``
  SYNC_METHOD           the RPC's method name (not one vLLM or agentkv knows by name: agentkv
                        must see the sync by what it may do, not by its name)
  sync_body(path)       the ``/collective_rpc`` body that loads ``path``
  perturbed_checkpoint(model_dir, out, seed)
                        a copy of a model folder whose every weight moved (the trainer's step)

torch and safetensors are imported inside ``perturbed_checkpoint`` (it runs in the bench's own
process, which otherwise needs neither); the extension runs inside vLLM's worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXTENSION = "agentkv_bench.rollout_weights.RolloutWeightSync"
SYNC_METHOD = "update_weight"


class RolloutWeightSync:
    """Mixed into vLLM's worker by ``--worker-extension-cls``: ``self`` is the worker."""

    # OpenRLHF 0.11 (openrlhf/trainer/ray/vllm_worker_wrap.py: collective_rpc("update_weight",
    # args=(name, dtype, shape, empty_cache))): here ``name`` is a whole checkpoint.
    def update_weight(
        self: Any,
        weights_path: str,
        dtype: Any = None,
        shape: Any = None,
        empty_cache: bool = False,
    ) -> None:
        self.reload_weights(weights_path=weights_path)


def sync_body(weights: Path) -> dict[str, Any]:
    """``POST /collective_rpc``'s body: OpenRLHF's argument shape, the checkpoint as the name."""
    return {"method": SYNC_METHOD, "args": [str(weights), "bfloat16", [], True]}


def perturbed_checkpoint(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of ``model_dir`` in ``out`` whose every weight moved by 0.05 * N(0, 1) drawn from
    ``seed`` (other weights, same architecture); kept when ``out`` already holds one."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = out / "model.safetensors"
    if weights.exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    tensors = load_file(str(tmp / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    moved = {
        name: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in tensors.items()
    }
    save_file(moved, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a crash mid-write never leaves a half checkpoint under the kept name
    return out
