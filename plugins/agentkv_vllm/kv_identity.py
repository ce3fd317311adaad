"""The KV identity of this engine, read from vLLM's config (``agentkv.kv_identity.KVIdentity``).

Primitives:
    identity_from_config(vllm_config, **layout)   model, revision, weights identity, quantization,
                                                  dtype, exact KV cache format, block size; the
                                                  caller adds layers, layout and TP rank/size
    config_weights(model_config)                  the weights identity: a hub id by the commit
                                                  of the snapshot vLLM resolved (the revision's
                                                  ``ResolvedRevision.resolved``, vLLM >= 0.32,
                                                  or ``hf_config._commit_hash`` of older
                                                  transformers); unknown: not shared
    kv_cache_format(cache_config, model_dtype)    the exact KV cache format: fp8 names resolved
                                                  to the platform's float8 type (``fp8`` and
                                                  ``fp8_e4m3`` are one format, ``fp8_e5m2``
                                                  another, though vLLM stores all as uint8), and
                                                  whether KV scales are computed at run time

The scheduler builds one with ``tp_rank=-1`` (its logical keys are rank-agnostic); each worker
builds its own with its rank and the KV cache tensors' layout.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from agentkv.kv_identity import KVIdentity, WeightsIdentity, weights_identity

log = logging.getLogger("agentkv.kv_identity")


def _platform_fp8() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.fp8_dtype()).removeprefix("torch.")
    except Exception:  # no platform (unit tests): the OCP format CUDA and CPU use
        return "float8_e4m3fn"


def kv_cache_format(cache_config: Any, model_dtype: str) -> str:
    """Return the exact KV cache format (see the module docstring)."""
    name = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if name == "auto":
        fmt = f"auto:{model_dtype}"
    elif name in ("fp8", "fp8_e4m3"):
        fmt = f"fp8_e4m3:{_platform_fp8()}"
    elif name == "fp8_e5m2":
        fmt = "fp8_e5m2:float8_e5m2"
    else:
        fmt = name
    if getattr(cache_config, "calculate_kv_scales", False):
        fmt += ":dynamic-scales"
    return fmt


def _resolved_commit(model_config: Any, model: str) -> str | None:
    """The commit of the hub snapshot vLLM loads, when it knows it."""
    revision = getattr(model_config, "revision", None)
    resolved = getattr(revision, "resolved", None)  # huggingface_hub's ResolvedRevision
    repo = getattr(revision, "_repo_id", None)
    if isinstance(resolved, str) and resolved and repo in (None, model):
        return resolved
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    return commit if isinstance(commit, str) and commit else None


def config_weights(model_config: Any) -> WeightsIdentity:
    """The weights identity of ``model_config`` (see the module docstring), with its
    ``hf_overrides``."""
    model = str(model_config.model)
    revision = str(getattr(model_config, "revision", None) or "")
    weights = weights_identity(model, revision or None, _resolved_commit(model_config, model))
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        weights = replace(weights, name=f"{weights.name}+overrides:{overrides!r}")
    return weights


def identity_from_config(
    vllm_config: Any,
    *,
    num_layers: int,
    layout: str,
    tp_rank: int,
    block_size: int | None = None,
    weights: WeightsIdentity | None = None,
) -> KVIdentity:
    """This engine's KVIdentity; ``layout`` names the attention layout the caller sees;
    ``weights``: ``config_weights(vllm_config.model_config)`` when the caller has it."""
    model_config = vllm_config.model_config
    model = str(model_config.model)
    revision = str(getattr(model_config, "revision", None) or "")
    dtype = str(model_config.dtype).removeprefix("torch.")
    if weights is None:
        weights = config_weights(model_config)
    cache_config = vllm_config.cache_config
    return KVIdentity(
        model=model,
        revision=revision,
        weights=weights.name,
        quantization=str(getattr(model_config, "quantization", None) or ""),
        dtype=dtype,
        kv_cache_dtype=kv_cache_format(cache_config, dtype),
        block_size=int(block_size if block_size is not None else cache_config.block_size),
        num_layers=num_layers,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
    )
