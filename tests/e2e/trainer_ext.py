"""A worker extension (``--worker-extension-cls``, ``AsyncEngineArgs(worker_extension_cls=)``)
with each RL framework's own weight-sync method names and call shapes, none of which vLLM or
agentkv knows by name. The weights really change: each sync loads a checkpoint in place through
the worker's own reload path (``reload_weights``).

The real payloads are CUDA IPC handles, NCCL broadcasts and serialized tensor buckets, which a
CPU test cannot produce; here the payload names a checkpoint directory instead, in the argument
the framework fills (positional where the framework passes ``args``, keyword where it passes
``kwargs``). The method names, the RPC shape (``collective_rpc`` in process or
``POST /collective_rpc``) and the order of the calls are the framework's; versions and call sites
are quoted in the tests that use them (``test_weights_e2e.py``, ``test_inprocess_e2e.py``).

``perturbed_checkpoint`` is the trainer's side: a copy of the tiny model whose every weight moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TrainerWeightSync:
    # verl 0.8/0.9 (verl/workers/rollout/vllm_rollout/utils.py:158, called as
    # collective_rpc("update_weights_from_ipc", kwargs=...)): the real one receives buckets
    # over a ZMQ socket of CUDA IPC handles.
    def update_weights_from_ipc(
        self: Any, weights_path: str, peft_config: Any = None, base_sync_done: bool = False
    ) -> None:
        self.reload_weights(weights_path=weights_path)

    # SkyRL 0.3 (NewInferenceWorkerWrap): start -> one or more update_weights_ipc/_nccl chunks
    # -> finish, each a POST /collective_rpc. The real start initializes vLLM's layerwise
    # reload and finish finalizes it; here a chunk is a whole checkpoint.
    def skyrl_start_weight_update(self: Any, is_checkpoint_format: bool = True) -> None:
        self._agentkv_test_skyrl_open = True

    def update_weights_ipc(self: Any, update_info: dict[str, Any]) -> None:
        assert getattr(self, "_agentkv_test_skyrl_open", False), "no skyrl_start_weight_update"
        self.reload_weights(weights_path=update_info["weights_path"])

    def skyrl_finish_weight_update(self: Any) -> None:
        assert getattr(self, "_agentkv_test_skyrl_open", False), "no skyrl_start_weight_update"
        self._agentkv_test_skyrl_open = False

    # OpenRLHF 0.11 (openrlhf/trainer/ray/vllm_worker_wrap.py:32, called as
    # collective_rpc("update_weight", args=(name, dtype, shape, empty_cache))): the real one
    # receives one named parameter over NCCL; here ``name`` is a checkpoint.
    def update_weight(
        self: Any,
        weights_path: str,
        dtype: Any = None,
        shape: Any = None,
        empty_cache: bool = False,
    ) -> None:
        self.reload_weights(weights_path=weights_path)

    # ROLL (roll/third_party/vllm/async_llm.py:22,28: collective_rpc_async(
    # method="update_parameter_in_bucket", args=(serialized_named_tensors, is_lora)), then
    # method="process_weights_after_loading"): the real bucket is serialized tensors.
    def update_parameter_in_bucket(
        self: Any, serialized_named_tensors: str, is_lora: bool = False
    ) -> None:
        self.reload_weights(weights_path=serialized_named_tensors)
        self._agentkv_test_roll_loaded = True

    def process_weights_after_loading(self: Any) -> None:
        # vLLM's reload already post-processed; the real one requantizes and repacks.
        assert getattr(self, "_agentkv_test_roll_loaded", False), "no update_parameter_in_bucket"
        self._agentkv_test_roll_loaded = False

    # AReaL 1.0 (areal/engine/vllm_ext/vllm_worker_extension.py:39, called from its own route
    # as collective_rpc("areal_update_weights", args=(model_path,))): this one really reads a
    # checkpoint path.
    def areal_update_weights(self: Any, model_path: str) -> tuple[bool, str]:
        self.reload_weights(weights_path=model_path)
        return True, "Success"


def perturbed_checkpoint(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of the tiny model in ``out`` whose every weight moved by 0.05 * N(0, 1) drawn from
    ``seed``: other weights, same architecture (each sync needs its own seed to change them)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    generator = torch.Generator().manual_seed(seed)
    moved = {
        name: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in tensors.items()
    }
    save_file(moved, str(weights), metadata={"format": "pt"})
    return out
