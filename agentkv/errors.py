"""The agentkv exception tree: small and categorized, so callers catch what they can handle.

AgentKVError
├── ConfigError          a config file, CLI option or request parameter is invalid
│   ├── UnsupportedModelError   a model geometry that cannot be sized (names the missing field)
│   └── InvalidIdError          a trajectory id or branch outside the id grammar (agentkv.ids)
├── TierError            a block store failed; callers fall back (recompute), never crash
│   ├── TierFullError        no room even after eviction
│   └── CorruptBlockError    checksum, header or length mismatch: treated as a miss
└── EngineUnavailableError   vLLM is not installed or the server cannot be reached
"""

from __future__ import annotations


class AgentKVError(Exception):
    """Base of every error agentkv raises on purpose."""


class ConfigError(AgentKVError, ValueError):
    """An input (config file, CLI option, request parameter) is invalid."""


class UnsupportedModelError(ConfigError):
    """The model's geometry cannot be sized; the message names the missing or odd field."""


class TierError(AgentKVError):
    """A tier store or load failed. The caller falls back to recompute."""


class TierFullError(TierError):
    """The tier has no room for the block, even after evicting what it may evict."""


class CorruptBlockError(TierError):
    """A stored block failed its checksum, header or length check: treat as a miss."""


class EngineUnavailableError(AgentKVError):
    """vLLM is not installed, or the server cannot be reached."""
