"""GPUs on paper: engine costs of a model on an accelerator from published figures.

Primitives:
  ModelSpec                  a served model's geometry: parameters (active per token for a
                             MoE), layers, hidden size, KV bytes per token, weight bytes; source
  MODELS                     llama-3.1-8b, llama-3.1-70b (GQA), deepseek-v2-lite (MLA)
  get_model(name)            lookup (ConfigError naming the known ones)
  PREFILL_MFU, ATTENTION_EFFICIENCY   achieved fractions of the dense BF16 peak (docs/simulate.md)
  HOST_LINK_DMA_FRACTION   achieved fraction of the host link's datasheet rate
  gpu_costs(gpu, model, tp)  EngineCosts of one replica: ``tp`` GPUs of the preset serving the
                             model (vLLM's GPU defaults: 16-token blocks, 8,192-token step
                             budget, 1,024 sequences; NVMe disk tier; roofline steps)
  gpu_num_blocks(gpu, model, tp, utilization)  device KV blocks left after the weights

The step model on a GPU is a roofline: a step streams the weights once (the step's floor,
``step_overhead_s`` = weight bytes / HBM bandwidth) and overlaps that with its compute (every
token's 2P FLOPs at PREFILL_MFU of the peak, causal attention at ATTENTION_EFFICIENCY) and its
KV reads (context bytes / HBM bandwidth): step = max(weights, compute + KV reads). The host
link runs at HOST_LINK_DMA_FRACTION of its datasheet rate. The achieved fractions are measured
figures (each constant names its source). Framework overhead per step (scheduling, kernel
launches) and the connector's CPU work per block are not in any datasheet and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.errors import ConfigError
from agentkv.hardware import NVME_GEN4, GpuPreset, get_preset
from agentkv.simulate.costs import EngineCosts, Provenance

PREFILL_MFU = 0.71
"""Achieved fraction of the dense peak on prefill GEMMs: vLLM prefilled 43,900 tokens/s of
Llama-3.1-8B on one H100 (the vLLM blog's KV offloading post, 2026-01-08, Figure 2, the run
without CPU offloading: 10,000 prompts of 512 tokens, where attention is under 2% of the work):
2 x 8.03e9 x 43,900 = 705 TFLOPS of 989. Was 0.5 (the reference's 45-60%) until that
comparison (docs/simulate.md, "A measured published result")."""
ATTENTION_EFFICIENCY = 0.6
"""Achieved fraction of the peak in causal attention: FlashAttention-3's forward pass, BF16,
head dim 128, causal, on an H100 SXM5 reaches 579-616 TFLOPS from 4k to 16k tokens (Shah et al.
2024, arXiv:2407.08608, Figure 5), 59-62% of 989. Counted with ``causal_attention``."""
HOST_LINK_DMA_FRACTION = 0.8
"""Share of the PCIe Gen5 x16 figure (64 GB/s each way) a host-to-device copy achieves:
cudaMemcpyAsync of 2 MiB blocks (Llama-3.1-8B's 16-token block in vLLM >= 0.12) ran at 47.7
GiB/s = 51.2 GB/s on an H100 (the same vLLM blog post, Figure 4; its Figure 2 reads the same
rate off a run with every prompt loaded from CPU: 391k tokens/s x 128 KiB)."""
GPU_BLOCK_TOKENS = 16
GPU_MAX_BATCHED_TOKENS = 8192
GPU_MAX_NUM_SEQS = 1024


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    """Parameters a token passes through (all of them for a dense model; the active ones for a
    mixture of experts): the 2P FLOPs per token."""
    weight_bytes: float
    num_layers: int
    hidden_size: int
    kv_bytes_per_token: int
    source: str


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "llama-3.1-8b",
            8.03e9,
            2 * 8.03e9,
            32,
            4096,
            2 * 32 * 8 * 128 * 2,
            "meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 8 KV heads of 128 "
            "(GQA), bf16: 128 KiB of KV per token; 8.03B parameters",
        ),
        ModelSpec(
            "llama-3.1-70b",
            70.6e9,
            2 * 70.6e9,
            80,
            8192,
            2 * 80 * 8 * 128 * 2,
            "meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 8 KV heads of 128 "
            "(GQA), bf16: 320 KiB of KV per token; 70.6B parameters",
        ),
        ModelSpec(
            "deepseek-v2-lite",
            2.4e9,
            2 * 15.7e9,
            27,
            2048,
            27 * (512 + 64) * 2,
            "deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, hidden 2048, MLA with "
            "kv_lora_rank 512 + rope dim 64 cached per layer (bf16: 31,104 B per token); 15.7B "
            "parameters, 2.4B active per token (MoE)",
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def _rates(gpu: GpuPreset) -> tuple[float, float, float]:
    if not (gpu.hbm_bytes_per_s and gpu.bf16_dense_flops_per_s and gpu.host_link_bytes_per_s):
        raise ConfigError(f"GPU preset {gpu.name} has no bandwidth and compute figures yet")
    return gpu.hbm_bytes_per_s, gpu.bf16_dense_flops_per_s, gpu.host_link_bytes_per_s


def gpu_num_blocks(gpu: GpuPreset, model: ModelSpec, tp: int = 1, utilization: float = 0.9) -> int:
    """KV blocks of ``tp`` GPUs at vLLM's ``gpu_memory_utilization`` after the weights
    (activation workspace ignored); ConfigError when the weights do not fit."""
    free = tp * gpu.memory_bytes * utilization - model.weight_bytes
    blocks = int(free // (model.kv_bytes_per_token * GPU_BLOCK_TOKENS))
    if blocks < 1:
        raise ConfigError(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
            f"{tp} x {gpu.name}; use more GPUs (--tp)"
        )
    return blocks


def gpu_costs(gpu_name: str, model_name: str, tp: int = 1) -> EngineCosts:
    """One replica of ``tp`` GPUs serving the model (see the module docstring)."""
    if tp < 1:
        raise ConfigError("--tp must be >= 1")
    gpu, model = get_preset(gpu_name), get_model(model_name)
    hbm, peak, link = _rates(gpu)
    gpu_num_blocks(gpu, model, tp)  # fails early when the weights do not fit
    return EngineCosts(
        prefill_flops_per_s=PREFILL_MFU * peak * tp,
        attention_flops_per_s=ATTENTION_EFFICIENCY * peak * tp,
        model_params=model.params,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        step_overhead_s=model.weight_bytes / (hbm * tp),
        kv_bytes_per_token=model.kv_bytes_per_token,
        block_tokens=GPU_BLOCK_TOKENS,
        max_batched_tokens=GPU_MAX_BATCHED_TOKENS,
        max_num_seqs=GPU_MAX_NUM_SEQS,
        host_link_bytes_per_s=link * HOST_LINK_DMA_FRACTION * tp,
        disk_read_bytes_per_s=NVME_GEN4.read_bytes_per_s,
        disk_write_bytes_per_s=NVME_GEN4.write_bytes_per_s,
        decode_seq_s=2.0 * model.params / (PREFILL_MFU * peak * tp),
        decode_context_s_per_token=model.kv_bytes_per_token / (hbm * tp),
        roofline=True,
        layerwise_overlap=True,
        causal_attention=True,
        name=f"{model.name} on {tp} x {gpu.name}",
        source=f"{gpu.source}; {model.source}; {NVME_GEN4.source}",
        provenance=Provenance.PRESET,
    )
