"""Render docs/settings.md from ``ConnectorSettings``: one definition, the code's.

Regenerate with ``python -m agentkv_vllm.settings_doc > docs/settings.md``;
``tests/unit/test_settings_doc.py`` fails when the committed file differs.
"""

from __future__ import annotations

import enum
import sys
import typing
from typing import Any

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from agentkv_vllm.settings import ConnectorSettings

REGENERATE = "python -m agentkv_vllm.settings_doc > docs/settings.md"

_HEADER = f"""# Connector settings

<!-- Generated from plugins/agentkv_vllm/settings.py (ConnectorSettings); do not edit by hand.
     Regenerate: {REGENERATE} -->

The keys of `kv_connector_extra_config` in vLLM's `--kv-transfer-config` (or
`agentkv serve --connector-config JSON`). Unknown keys fail the engine's start, naming the key.
How the main ones work together: [reference.md](reference.md#connector-settings).

| setting | type | default | description |
|---|---|---|---|
"""


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)
    if text is None:
        text = str(annotation)
    return text.replace("typing.", "")


def _choices(annotation: Any) -> str:
    """``a, b, c`` for an enum-typed field (or an optional one), else empty."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return ", ".join(f"`{member.value}`" for member in candidate)
    return ""


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return "(computed at start)"
    value = field.default
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole docs/settings.md, one row per field in definition order."""
    rows = []
    annotations: dict[str, Any] = {}
    for klass in reversed(ConnectorSettings.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    for name, field in ConnectorSettings.model_fields.items():
        type_name = _type_name(annotations.get(name, field.annotation))
        default = _default(field)
        description = field.description or ""
        choices = _choices(field.annotation)
        if choices:
            description = f"{description} One of {choices}.".strip()
        rows.append(
            f"| `{name}` | `{_cell(type_name)}` | `{_cell(default)}` | {_cell(description)} |"
        )
    return _HEADER + "\n".join(rows) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
