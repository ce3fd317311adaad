"""The embedded random-weight model: a Llama-geometry checkpoint and a byte-level BPE tokenizer,
built offline and deterministically (no model hub).

Primitives:
  PRESETS                 name -> ModelPreset (geometry of each embedded model)
  default_model_dir(p)    where a preset is cached (``$AGENTKV_CACHE_DIR`` or the XDG cache)
  ensure_model(p, out)    build the model folder unless a complete one is already there
  build_model(p, out)     build it now (weights seeded, tokenizer trained on the stdlib sources)
  weights_digest(dir)     xxh3-128 over the safetensors files: same seed -> same digest

torch and transformers are imported inside ``build_model`` only, so the core stays importable
without them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from agentkv.errors import ConfigError

MARKER_FILE = "agentkv-model.json"
# Bump when the build recipe changes so cached folders built by an older recipe are rebuilt.
RECIPE_VERSION = 1

SPECIAL_TOKENS = [
    "<|begin|>",
    "<|end|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|tools|>",
]

# Tool definitions are rendered right after the system message so that a tool-list change
# breaks the prefix exactly where a production chat template would.
CHAT_TEMPLATE = (
    "{{ '<|begin|>' }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] is none %}{% set content = '' %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + content + '<|end|>\n' }}"
    "{% if loop.first and tools %}{{ '<|tools|>\n' + (tools | tojson) + '<|end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Geometry of one embedded model (Llama architecture, bf16)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int = 1234


PRESETS: dict[str, ModelPreset] = {
    # ~20M parameters: fast engine start, used by tests and the demo.
    "tiny": ModelPreset("tiny", 4, 512, 8, 2, 64, 1536, 8192, 32768),
    # ~150M parameters: an 8k-token prefill takes seconds on 2 CPU cores, so recompute is
    # expensive enough for benchmarks to show what a tier saves.
    "small": ModelPreset("small", 12, 1024, 16, 4, 64, 2816, 8192, 32768),
}


def default_cache_root() -> Path:
    """``$AGENTKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/agentkv``, else ``~/.cache/agentkv``."""
    if env := os.environ.get("AGENTKV_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentkv"


def default_model_dir(preset: str) -> Path:
    return default_cache_root() / "models" / f"{preset}-r{RECIPE_VERSION}"


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def is_complete(model_dir: Path, preset: ModelPreset) -> bool:
    """True when ``model_dir`` holds a finished build of ``preset`` by this recipe."""
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(meta.get("recipe") == RECIPE_VERSION and meta.get("preset") == asdict(preset))


def ensure_model(preset: str = "tiny", out: Path | None = None) -> Path:
    """Return a complete model folder for ``preset``, building it only when missing."""
    spec = get_preset(preset)
    target = Path(out) if out is not None else default_model_dir(preset)
    if is_complete(target, spec):
        return target
    return build_model(preset, target)


def _training_files() -> Iterator[Path]:
    """The Python standard library's own sources: local text on every machine, in a fixed order."""
    stdlib = Path(os.__file__).parent
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise ConfigError(f"no training text found under {stdlib}")
    yield from files[:200]


def _train_tokenizer(spec: ModelPreset, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in _training_files())
    tokenizer.train_from_iterator(texts, trainer=trainer)

    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_weights(spec: ModelPreset, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta/torch_dtype go through **kwargs
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index("<|begin|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(out), safe_serialization=True)


def weights_digest(model_dir: Path) -> str:
    """xxh3-128 of every ``*.safetensors`` file in name order: the reproducibility fingerprint."""
    digest = xxhash.xxh3_128()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def build_model(preset: str = "tiny", out: Path | None = None) -> Path:
    """Build ``preset`` into ``out`` (atomically: a temp folder renamed into place).

    Raises ConfigError for an unknown preset or when torch/transformers are missing.
    """
    spec = get_preset(preset)
    target = Path(out) if out is not None else default_model_dir(preset)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"building the model needs torch and transformers ({exc.name} is missing); "
            "install agentkv with the 'cpu' or 'gpu' extra"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_weights(spec, tmp)
        _train_tokenizer(spec, tmp)
        meta = {
            "recipe": RECIPE_VERSION,
            "preset": asdict(spec),
            "weights_xxh3_128": weights_digest(tmp),
            "python": sys.version.split()[0],
        }
        (tmp / MARKER_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        # Concurrent builders (parallel test workers, two servers started at once): the first
        # to finish wins; never remove a complete folder another process may be loading.
        if is_complete(target, spec):
            return target
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not is_complete(target, spec):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_marker(model_dir: Path) -> dict[str, object]:
    """The build record of an embedded model folder (empty for a foreign model)."""
    try:
        return dict(json.loads((Path(model_dir) / MARKER_FILE).read_text()))
    except (OSError, ValueError):
        return {}
