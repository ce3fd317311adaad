"""Model geometry from a Hugging Face ``config.json``: how many KV bytes each token costs.

Primitives:
    KV_DTYPE_BYTES    element width of each KV / weight dtype name ('bf16', 'fp8', 'int8', ...)
    LayerKind         what one decoder layer keeps per sequence: full, sliding, state or nothing
    ModelGeometry     the sizing-relevant shape of a model, built by ``from_hf_config``
      .kv_bytes_per_token(tp)       bytes one token adds while it is inside every window
      .kv_bytes(tokens, tp)         bytes a sequence of ``tokens`` holds (windows capped)
      .state_bytes_per_sequence(tp) fixed per-sequence state of SSM / linear-attention layers
      .kv_heads_per_device(tp)      KV heads each tensor-parallel rank keeps

Equation 1 of the reference: ``m_token = 2 * L * H_kv * d_head * b`` for MHA/GQA/MQA. MLA
(DeepSeek-V2/V3) keeps one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` elements per
layer and no separate K and V, replicated on every TP rank. A sliding-window layer keeps at most
its window; an SSM or linear-attention layer keeps a fixed state per sequence, not per token.

An architecture this module cannot size raises ``UnsupportedModelError`` naming the missing
field; it never guesses a number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError, UnsupportedModelError

KV_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

# Keys under which multimodal configs nest their language model.
_NESTED_TEXT_KEYS = ("text_config", "llm_config", "language_config")


class LayerKind(str, Enum):
    """What one decoder layer keeps for a sequence."""

    FULL = "full"
    """Full attention: K and V (or the MLA latent) for every token."""
    SLIDING = "sliding"
    """Sliding-window / chunked attention: at most ``window`` tokens."""
    STATE = "state"
    """SSM or linear attention: a fixed-size state per sequence, nothing per token."""
    NONE = "none"
    """An MLP-only layer: nothing per sequence."""


@dataclass(frozen=True)
class ModelGeometry:
    """The sizing-relevant shape of a decoder model. Build it with ``from_hf_config``."""

    model_type: str
    attention: str
    """'mha', 'gqa', 'mqa' or 'mla'."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    kv_dtype: str
    kv_dtype_bytes: float
    weight_dtype_bytes: float
    num_parameters: int | None
    layer_kinds: tuple[LayerKind, ...]
    layer_windows: tuple[int | None, ...]
    """Per layer: the window of a SLIDING layer, else None."""
    mla_latent_dim: int | None = None
    """kv_lora_rank + qk_rope_head_dim for MLA models, else None."""
    state_elems_per_layer: int | None = None
    """Elements of per-sequence state in each STATE layer (None: the config doesn't say)."""
    warnings: tuple[str, ...] = field(default=())

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        src: str | Path | Mapping[str, Any],
        *,
        kv_dtype: str | None = None,
        num_parameters: int | None = None,
    ) -> ModelGeometry:
        """Build the geometry from a model folder, a ``config.json`` path or a config mapping.

        Contract: ``kv_dtype`` ('bf16', 'fp16', 'fp8', 'int8', 'fp32' or 'auto'/None for the
        config's dtype) sets the KV element width. ``num_parameters`` overrides the estimate made
        from the config. Raises ConfigError for an unreadable or malformed file or an unknown
        dtype, and UnsupportedModelError (naming the field) for a geometry it cannot size.
        """
        raw = _load_config(src)
        cfg = _language_config(raw)
        warnings: list[str] = []

        model_type = str(cfg.get("model_type") or raw.get("model_type") or "unknown")
        num_layers = _req_int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
        hidden, heads, kv_heads, head_dim = _heads(cfg)
        attention, mla_latent = _attention(cfg, heads, kv_heads)
        kv_name, kv_bytes, weight_bytes = _dtypes(cfg, raw, kv_dtype, warnings)

        kinds, windows = _layer_pattern(cfg, model_type, num_layers)
        state_elems = None
        if LayerKind.STATE in kinds:
            state_elems = _state_elems_per_layer(cfg, hidden)
            if state_elems is None:
                warnings.append(
                    "SSM / linear-attention state per sequence unknown (config lacks its sizes); "
                    "only attention KV is counted"
                )

        max_pos = _opt_int(cfg, "max_position_embeddings", "n_positions", "max_seq_len")
        if num_parameters is None:
            num_parameters = _estimate_parameters(
                cfg, model_type, kinds, hidden, heads, kv_heads, head_dim, num_layers
            )
            if num_parameters is None:
                warnings.append("parameter count could not be estimated from the config")
        elif num_parameters <= 0:
            raise ConfigError(f"num_parameters must be positive, got {num_parameters}")

        return cls(
            model_type=model_type,
            attention=attention,
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            kv_dtype=_canonical_dtype(kv_name),
            kv_dtype_bytes=kv_bytes,
            weight_dtype_bytes=weight_bytes,
            num_parameters=num_parameters,
            layer_kinds=tuple(kinds),
            layer_windows=tuple(windows),
            mla_latent_dim=mla_latent,
            state_elems_per_layer=state_elems,
            warnings=tuple(warnings),
        )

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep per-token KV (full or sliding)."""
        return sum(k in (LayerKind.FULL, LayerKind.SLIDING) for k in self.layer_kinds)

    @property
    def num_state_layers(self) -> int:
        """Layers that keep a fixed per-sequence state (SSM, linear attention)."""
        return sum(k is LayerKind.STATE for k in self.layer_kinds)

    def kv_heads_per_device(self, tp: int = 1) -> int:
        """KV heads each of ``tp`` ranks holds: ``max(1, H_kv // tp)`` (replicated when tp > H_kv).

        Contract: raises ConfigError when tp is not positive, does not divide the attention
        heads, or neither divides nor is a multiple of the KV heads (vLLM refuses those too).
        """
        self._check_tp(tp)
        return max(1, self.num_kv_heads // tp)

    def kv_elems_per_token_per_layer(self, tp: int = 1) -> int:
        """KV elements one token adds to one attention layer on one rank."""
        if self.mla_latent_dim is not None:
            self._check_tp(tp)
            return self.mla_latent_dim  # the latent is replicated on every rank
        return 2 * self.kv_heads_per_device(tp) * self.head_dim

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """Bytes one token costs across all attention layers, per rank when ``tp > 1``.

        Contract: tp=1 gives the whole model's equation-1 figure. Every attention layer is
        counted, so this is exact while the sequence fits every sliding window; use
        ``kv_bytes(tokens)`` for long sequences on sliding-window models.
        """
        per_layer = self.kv_elems_per_token_per_layer(tp) * self.kv_dtype_bytes
        return math.ceil(per_layer * self.num_attention_layers)

    def kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """Bytes of KV a sequence of ``tokens`` holds (per rank when tp > 1), windows capped.

        Contract: exact for full-attention models (``tokens * kv_bytes_per_token``); a sliding
        layer contributes ``min(tokens, window)`` tokens. Excludes per-sequence SSM state (see
        ``state_bytes_per_sequence``). Raises ConfigError for negative ``tokens``.
        """
        if tokens < 0:
            raise ConfigError(f"token count must not be negative, got {tokens}")
        per_layer = self.kv_elems_per_token_per_layer(tp) * self.kv_dtype_bytes
        held = sum(
            min(tokens, window) if window is not None else tokens
            for kind, window in zip(self.layer_kinds, self.layer_windows, strict=True)
            if kind in (LayerKind.FULL, LayerKind.SLIDING)
        )
        return math.ceil(per_layer * held)

    def state_bytes_per_sequence(self, tp: int = 1) -> int:
        """Fixed bytes per sequence of SSM / linear-attention layers (per rank), in model dtype.

        Contract: 0 for pure attention models and when the config doesn't give the state sizes
        (then ``warnings`` says so). The state is sharded over TP like the heads it belongs to.
        """
        self._check_tp(tp)
        if not self.num_state_layers or self.state_elems_per_layer is None:
            return 0
        per_rank = math.ceil(self.state_elems_per_layer / tp)
        return math.ceil(per_rank * self.num_state_layers * self.weight_dtype_bytes)

    def _check_tp(self, tp: int) -> None:
        if tp < 1:
            raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
        if self.num_attention_heads % tp:
            raise ConfigError(
                f"--tp {tp} does not divide num_attention_heads {self.num_attention_heads}"
            )
        if self.mla_latent_dim is None and self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ConfigError(
                f"--tp {tp} neither divides nor is a multiple of num_key_value_heads "
                f"{self.num_kv_heads}"
            )


# ---- config reading ---------------------------------------------------------------------


def _load_config(src: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(src, Mapping):
        return dict(src)
    path = Path(src)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"model config not found: {path}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read model config {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON in {path}: {exc.msg} (line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _language_config(raw: dict[str, Any]) -> dict[str, Any]:
    for key in _NESTED_TEXT_KEYS:
        nested = raw.get(key)
        if isinstance(nested, Mapping):
            return dict(nested)
    return raw


def _pick(cfg: Mapping[str, Any], names: Sequence[str]) -> tuple[str, Any] | None:
    for name in names:
        if cfg.get(name) is not None:
            return name, cfg[name]
    return None


def _opt_int(cfg: Mapping[str, Any], *names: str) -> int | None:
    found = _pick(cfg, names)
    if found is None:
        return None
    name, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(
            f"config field {name} must be a positive integer, got {value!r}"
        )
    return value


def _req_int(cfg: Mapping[str, Any], *names: str) -> int:
    value = _opt_int(cfg, *names)
    if value is None:
        raise UnsupportedModelError(f"config has no {names[0]}; cannot size this model")
    return value


def _config_dtype(cfg: Mapping[str, Any], raw: Mapping[str, Any]) -> str | None:
    for source in (cfg, raw):
        found = _pick(source, ("torch_dtype", "dtype"))
        if found is not None and isinstance(found[1], str):
            return found[1].lower().removeprefix("torch.")
    return None


def _dtype_bytes(name: str) -> float:
    width = KV_DTYPE_BYTES.get(name.lower())
    if width is None:
        raise ConfigError(
            f"unknown dtype {name!r}; use one of bf16, fp16, fp8, int8, fp32 (or auto)"
        )
    return width


def _canonical_dtype(name: str) -> str:
    return {
        "bfloat16": "bf16",
        "float16": "fp16",
        "half": "fp16",
        "float32": "fp32",
        "float": "fp32",
        "float8_e4m3fn": "fp8_e4m3",
        "float8_e5m2": "fp8_e5m2",
    }.get(name.lower(), name.lower())


def _quantized_weight_bytes(
    cfg: Mapping[str, Any], raw: Mapping[str, Any], default: float
) -> float:
    quant = cfg.get("quantization_config") or raw.get("quantization_config")
    if not isinstance(quant, Mapping):
        return default
    bits = quant.get("bits") or quant.get("w_bit")
    if isinstance(bits, int) and bits > 0:
        return bits / 8
    if str(quant.get("quant_method", "")).lower() in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return 1.0
    return default


# ---- layer pattern ----------------------------------------------------------------------

_LAYER_TYPE_NAMES: dict[str, LayerKind] = {
    "full_attention": LayerKind.FULL,
    "attention": LayerKind.FULL,
    "global": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "sliding_window": LayerKind.SLIDING,
    "local": LayerKind.SLIDING,
    "chunked_attention": LayerKind.SLIDING,
    "linear_attention": LayerKind.STATE,
    "mamba": LayerKind.STATE,
    "mamba2": LayerKind.STATE,
    "ssm": LayerKind.STATE,
}


def _layer_pattern(
    cfg: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[list[LayerKind], list[int | None]]:
    kinds = _layer_kinds(cfg, model_type, num_layers)
    window: int | None = None
    if LayerKind.SLIDING in kinds:
        window = _opt_int(cfg, "sliding_window", "attention_chunk_size")
        if window is None:
            raise UnsupportedModelError(
                "config marks sliding-window layers but has no sliding_window size"
            )
    windows = [window if k is LayerKind.SLIDING else None for k in kinds]
    return kinds, windows


def _layer_kinds(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> list[LayerKind]:
    layer_types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types must list one entry per layer ({num_layers}), got {layer_types!r:.80}"
            )
        kinds = []
        for entry in layer_types:
            kind = _LAYER_TYPE_NAMES.get(str(entry).lower())
            if kind is None:
                raise UnsupportedModelError(f"unknown layer type {entry!r} in layer_types")
            kinds.append(kind)
        return kinds
    pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H: M mamba, * attention, - / E MLP
    if isinstance(pattern, str) and pattern:
        table = {
            "M": LayerKind.STATE,
            "*": LayerKind.FULL,
            "-": LayerKind.NONE,
            "E": LayerKind.NONE,
        }
        if len(pattern) != num_layers or set(pattern) - set(table):
            raise UnsupportedModelError(f"cannot read hybrid_override_pattern {pattern!r}")
        return [table[c] for c in pattern]
    period = _opt_int(cfg, "attn_layer_period")  # Jamba
    if period is not None:
        offset = cfg.get("attn_layer_offset", 0)
        return [
            LayerKind.FULL if i % period == offset else LayerKind.STATE for i in range(num_layers)
        ]
    interval = _opt_int(cfg, "full_attention_interval")  # Qwen3-Next
    if interval is not None:
        return [
            LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.STATE
            for i in range(num_layers)
        ]
    if cfg.get("sliding_window") is None:
        return [LayerKind.FULL] * num_layers
    if "use_sliding_window" in cfg:  # Qwen2 family: off unless asked, then only upper layers
        if not cfg["use_sliding_window"]:
            return [LayerKind.FULL] * num_layers
        first = cfg.get("max_window_layers", 0)
        return [LayerKind.SLIDING if i >= first else LayerKind.FULL for i in range(num_layers)]
    every = _opt_int(cfg, "sliding_window_pattern")  # Gemma 3: every Nth layer is global
    if every is not None:
        return [
            LayerKind.FULL if (i + 1) % every == 0 else LayerKind.SLIDING for i in range(num_layers)
        ]
    if model_type in ("gemma2", "cohere2"):  # alternate local / global, local first
        return [LayerKind.SLIDING if i % 2 == 0 else LayerKind.FULL for i in range(num_layers)]
    return [LayerKind.SLIDING] * num_layers  # e.g. Mistral 7B v0.1: every layer windowed


def _state_elems_per_layer(cfg: Mapping[str, Any], hidden: int) -> int | None:
    """Per-sequence state elements of one SSM / linear-attention layer, or None if unknown."""
    if cfg.get("linear_num_value_heads") is not None:  # gated DeltaNet (Qwen3-Next)
        kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv_dim = 2 * kh * kd + vh * vd
        return int(vh * kd * vd + conv_dim * (cfg.get("linear_conv_kernel_dim", 4) - 1))
    d_state = cfg.get("mamba_d_state") or cfg.get("ssm_state_size") or cfg.get("state_size")
    d_conv = cfg.get("mamba_d_conv") or cfg.get("conv_kernel")
    if not d_state or not d_conv:
        return None
    n_heads = cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads")
    head = cfg.get("mamba_d_head") or cfg.get("mamba_head_dim")
    if n_heads and head:  # Mamba-2: per-head state, grouped B/C in the conv
        d_inner = n_heads * head
        groups = cfg.get("mamba_n_groups") or cfg.get("n_groups") or 1
        conv_dim = d_inner + 2 * groups * d_state
        return int(d_inner * d_state + conv_dim * (d_conv - 1))
    expand = cfg.get("mamba_expand") or cfg.get("expand")
    if not expand:
        return None
    d_inner = int(expand * hidden)  # Mamba-1: conv state + SSM state
    return int(d_inner * (d_conv - 1) + d_inner * d_state)


# ---- parameter estimate -----------------------------------------------------------------


def _estimate_parameters(
    cfg: Mapping[str, Any],
    model_type: str,
    kinds: Sequence[LayerKind],
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_layers: int,
) -> int | None:
    """Decoder parameter count from the config; None when a needed size is missing."""
    vocab = cfg.get("vocab_size")
    intermediate = cfg.get("intermediate_size") or cfg.get("ffn_dim")
    if not vocab or cfg.get("hybrid_override_pattern"):
        return None  # Nemotron-H style MLP-only layers are not modelled here
    tied = cfg.get("tie_word_embeddings", model_type.startswith("gemma"))
    total = vocab * hidden * (1 if tied else 2) + hidden  # embeddings, head, final norm

    if cfg.get("kv_lora_rank") is not None:
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        v_dim, kv_rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
        q_rank = cfg.get("q_lora_rank")
        q = (
            (hidden * q_rank + q_rank + q_rank * heads * (nope + rope))
            if q_rank
            else (hidden * heads * (nope + rope))
        )
        attn = q + hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        attn += heads * v_dim * hidden
    else:
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        if cfg.get("attention_bias") or model_type.startswith("qwen2"):
            attn += (heads + 2 * kv_heads) * head_dim

    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    moe_inter = cfg.get("moe_intermediate_size") or intermediate
    for i, kind in enumerate(kinds):
        total += 2 * hidden  # the two norms around attention and MLP
        if kind in (LayerKind.FULL, LayerKind.SLIDING):
            total += attn
        elif kind is LayerKind.STATE:
            mamba = _mamba_parameters(cfg, hidden)
            if mamba is None:
                return None
            total += mamba
        if experts and _is_moe_layer(cfg, i):
            if not moe_inter:
                return None
            total += experts * 3 * hidden * moe_inter + hidden * experts
            shared = cfg.get("n_shared_experts") or 0
            total += shared * 3 * hidden * moe_inter
            shared_inter = cfg.get("shared_expert_intermediate_size")
            if shared_inter:
                total += 3 * hidden * shared_inter + hidden
        else:
            if not intermediate:
                return None
            total += 3 * hidden * intermediate  # gated MLP: gate, up, down
    return int(total)


def _is_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    if "first_k_dense_replace" in cfg:  # DeepSeek
        return i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0
    if "expert_layer_period" in cfg:  # Jamba
        return i % cfg["expert_layer_period"] == cfg.get("expert_layer_offset", 0)
    if "decoder_sparse_step" in cfg:  # Qwen MoE
        return i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg["decoder_sparse_step"] == 0
    return True


def _mamba_parameters(cfg: Mapping[str, Any], hidden: int) -> int | None:
    d_state, d_conv = cfg.get("mamba_d_state"), cfg.get("mamba_d_conv")
    expand = cfg.get("mamba_expand")
    if not (d_state and d_conv and expand):
        return None
    d_inner = int(expand * hidden)
    dt_rank = cfg.get("mamba_dt_rank", "auto")
    if dt_rank == "auto":
        dt_rank = math.ceil(hidden / 16)
    return int(
        hidden * 2 * d_inner  # in_proj
        + d_inner * d_conv
        + d_inner  # depthwise conv and its bias
        + d_inner * (dt_rank + 2 * d_state)  # x_proj
        + dt_rank * d_inner
        + d_inner  # dt_proj
        + d_inner * d_state
        + d_inner  # A_log, D
        + d_inner * hidden  # out_proj
    )


def _heads(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """hidden size, attention heads, KV heads (MQA: 1) and head dim; UnsupportedModelError for
    heads that do not divide."""
    hidden = _req_int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _req_int(cfg, "num_attention_heads", "n_head", "num_heads")
    kv_heads = _opt_int(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = _opt_int(cfg, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UnsupportedModelError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                "the config has no head_dim"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    return hidden, heads, kv_heads, head_dim


def _attention(cfg: Mapping[str, Any], heads: int, kv_heads: int) -> tuple[str, int | None]:
    """The attention kind (mla, mqa, mha, gqa) and MLA's latent width per token."""
    if cfg.get("kv_lora_rank") is not None:
        return "mla", _req_int(cfg, "kv_lora_rank") + _req_int(cfg, "qk_rope_head_dim")
    if kv_heads == 1 and heads > 1:
        return "mqa", None
    if kv_heads == heads:
        return "mha", None
    return "gqa", None


def _dtypes(
    cfg: Mapping[str, Any], raw: Mapping[str, Any], kv_dtype: str | None, warnings: list[str]
) -> tuple[str, float, float]:
    """The KV dtype's name and width (``kv_dtype``, else the config's) and the weights' bytes per
    parameter (quantization included; 16-bit with a warning when the config names no dtype)."""
    config_dtype = _config_dtype(cfg, raw)
    if kv_dtype is None or kv_dtype == "auto":
        if config_dtype is None:
            raise UnsupportedModelError(
                "config has no torch_dtype (or dtype); pass the KV dtype explicitly "
                "(--kv-dtype bf16|fp16|fp8|int8)"
            )
        kv_name = config_dtype
    else:
        kv_name = kv_dtype.lower()
    kv_bytes = _dtype_bytes(kv_name)
    if config_dtype is None:
        weight_bytes = 2.0
        warnings.append("config has no torch_dtype: weights assumed 16-bit")
    else:
        weight_bytes = _dtype_bytes(config_dtype)
    return kv_name, kv_bytes, _quantized_weight_bytes(cfg, raw, weight_bytes)
