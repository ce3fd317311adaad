"""KV identity: what decides whether two engines' KV bytes for the same tokens are identical, and
the generation that fences every older tier copy after a cache reset or a weight update.

Primitives:
    KVIdentity           model id and revision, a weights identity, quantization, dtype, the KV
                         cache dtype with its exact fp8 format, block size, layer count, attention
                         layout, TP rank/size. Frozen; ``digest()`` is 16 bytes, stable across
                         processes and versions (every field length-prefixed, BLAKE2b).
    weights_identity(model, revision, commit)
                         -> WeightsIdentity. A local folder: a digest of its path, its config
                         files and every weight file's name, size and mtime (cheap: no weight
                         byte is read; a hub-cache snapshot folder ``.../snapshots/<hash>`` is
                         covered by its path). A hub id: the id and the commit of the snapshot
                         loaded (``commit``, or ``revision`` when it is a commit hash). A hub id
                         whose snapshot is unknown (a branch or tag name only, ``main`` by
                         default, moves with every push) is not shared: its name carries a
                         per-process nonce, so no other process, replica or restart derives
                         its keys (no remote copy, disk file or manifest matches).
    BASE_GENERATION      the generation of a freshly loaded engine (16 zero bytes): the weights
                         are the files', so copies written before a restart are valid again.
    new_generation()     16 random bytes: after a reset or a weight update, no copy written before
                         can ever be named again (neither here nor by another replica).
    key_secret(identity_digest, generation)
                         the 64-byte BLAKE2b key logical tier keys are derived under.
    LogicalKeys          the one derivation of a block's logical tier key from the engine's block
                         hash (``agentkv-key-v3``: keyed BLAKE2b-128 under ``key_secret``), and
                         the current generation; ``new_generation()`` switches both at once.
                         Every tier key of a block (host, disk and remote names are derived from
                         the logical key per rank) depends on the full identity and generation.

Pure standard library: the plugin fills a KVIdentity from vLLM's config
(``agentkv_vllm.kv_identity``); the core never imports vLLM.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

IDENTITY_BYTES = 16
BASE_GENERATION = bytes(IDENTITY_BYTES)
# Files whose bytes or presence change what a local model folder computes. Weights are
# identified by name, size and mtime (reading gigabytes at start is not an option); configs are
# small, so their content is hashed.
_CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "quantize_config.json",
    "hf_quant_config.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Names the weights of a hub model whose snapshot is unknown: this process only.
_PROCESS_NONCE = secrets.token_hex(IDENTITY_BYTES)


def _field(h: hashlib.blake2b, data: str | bytes) -> None:
    raw = data.encode() if isinstance(data, str) else data
    h.update(len(raw).to_bytes(4, "little") + raw)


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """Everything that makes two engines' KV blocks interchangeable (see the module docstring)."""

    model: str
    revision: str = ""
    weights: str = ""
    quantization: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    def digest(self) -> bytes:
        """Return the 16-byte digest of every field."""
        h = hashlib.blake2b(digest_size=IDENTITY_BYTES, person=b"agentkv-id-v1")
        for text in (
            self.model,
            self.revision,
            self.weights,
            self.quantization,
            self.dtype,
            self.kv_cache_dtype,
            self.layout,
        ):
            _field(h, text)
        for number in (self.block_size, self.num_layers, self.tp_rank, self.tp_size):
            h.update(number.to_bytes(8, "little", signed=True))
        return h.digest()


def new_generation() -> bytes:
    """Return a fresh generation (random: never equal to any earlier one, on any replica)."""
    return secrets.token_bytes(IDENTITY_BYTES)


def key_secret(identity_digest: bytes, generation: bytes) -> bytes:
    """Return the 64-byte BLAKE2b key logical tier keys are derived under."""
    h = hashlib.blake2b(digest_size=64, person=b"agentkv-gen-v1")
    _field(h, identity_digest)
    _field(h, generation)
    return h.digest()


@dataclass(frozen=True, slots=True)
class WeightsIdentity:
    """What names the weights an engine loads: ``name`` goes into the KVIdentity; ``shared``
    False when the weights could not be identified (``name`` then holds a per-process nonce and
    ``why`` says what is missing)."""

    name: str
    shared: bool = True
    why: str = ""


def weights_identity(
    model: str, revision: str | None = None, commit: str | None = None
) -> WeightsIdentity:
    """Return what names the weights ``model`` loads (see the module docstring).

    A folder that cannot be read still gets an identity (its path), never an exception: the
    engine loads it or fails on its own.
    """
    path = Path(model)
    if not path.is_dir():
        for candidate in (commit, revision):
            if candidate and _COMMIT.fullmatch(candidate):
                return WeightsIdentity(f"hub:{model}@{candidate}")
        return WeightsIdentity(
            f"hub:{model}@{revision or 'main'}?unresolved:{_PROCESS_NONCE}",
            shared=False,
            why=(
                f"the snapshot (commit) of hub model {model} at revision {revision or 'main'} "
                "is unknown; pin --revision to a commit hash or serve a local folder"
            ),
        )
    h = hashlib.blake2b(digest_size=IDENTITY_BYTES, person=b"agentkv-wts-v1")
    _field(h, str(path.resolve()))
    try:
        for name in _CONFIG_FILES:
            config = path / name
            if config.is_file():
                _field(h, name)
                _field(h, config.read_bytes())
        for file in sorted(path.rglob("*")):
            if file.is_file() and file.name.endswith(_WEIGHT_SUFFIXES):
                stat = file.stat()
                _field(h, str(file.relative_to(path)))
                h.update(stat.st_size.to_bytes(8, "little"))
                h.update(stat.st_mtime_ns.to_bytes(8, "little", signed=True))
    except OSError as exc:
        _field(h, f"unreadable:{exc.errno}")
    return WeightsIdentity(f"dir:{h.hexdigest()}")


KEY_BYTES = 16


class LogicalKeys:
    """Logical tier keys of one engine: identity + generation + the engine's block hash.

    Not thread-safe by itself: the caller switches generations under the lock its lookups hold.
    """

    def __init__(self, identity: KVIdentity, generation: bytes = BASE_GENERATION) -> None:
        self.identity = identity
        self.identity_digest = identity.digest()
        self.generation = generation
        self._secret = key_secret(self.identity_digest, generation)

    def key_of(self, block_hash: bytes) -> bytes:
        """The logical key of one engine block hash (which already chains the whole prefix and
        carries cache_salt, LoRA and multimodal extras)."""
        return hashlib.blake2b(
            bytes(block_hash), digest_size=KEY_BYTES, key=self._secret, person=b"agentkv-key-v3"
        ).digest()

    def new_generation(self) -> bytes:
        """Switch to a fresh generation: no key derived before is ever derived again."""
        self.generation = new_generation()
        self._secret = key_secret(self.identity_digest, self.generation)
        return self.generation
