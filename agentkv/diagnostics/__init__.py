"""Prefix-stability analysis: where a trajectory's prompt prefix broke, and why.

Primitives (every name below imports from ``agentkv.diagnostics``):
  load_trajectory(lines)        JSONL -> Trajectory (requests + LineError per malformed line)
  read_trajectory(path)         the same, from a file
  load_tokenizer(model_dir)     HFChatTokenizer over a local model folder (transformers, lazily)
  render_request(tok, request)  RenderedPrompt: text, token ids, offsets, zone spans
  zone_of(rendered, char)       (zone, message index) of a character of the rendered prompt
  classify(prev, cur, ...)      Cause of a break: kind, detail, fix
  diagnose(traj, tok, ...)      DiagnoseReport: per-turn S_prompt, S_match, H_prefix, divergence
  CAUSES                        cause kind -> the fix to make

The modules, one idea each:
  trajectory   the input: JSONL requests or SDK trace turns, malformed lines named and skipped
  prompts      a request rendered with the chat template and tokenized, each character's zone
  causes       the diagnosis rules: why a prefix broke between two turns, and the fix
  replay       the replay through ``prefix_sim.PagedPrefixCache`` and the report it produces

Input lines are the requests as sent (OpenAI chat format: ``model``, ``messages``, ``tools``) or
the SDK trace export (``{"type": "turn", "request": {...}, "response": {...}}``); a response's
``kv_transfer_params.agentkv`` (the engine's per-turn prefix statistics) is carried along so the
offline replay and the online numbers can be compared turn by turn.

Each prompt is rendered with the model's chat template, tokenized, and replayed through
``prefix_sim.PagedPrefixCache``. The first divergent token is the token-level longest common
prefix with the previous turn's prompt; its zone comes from message roles and positions:
``system`` (leading system/developer messages), ``tools`` (the rendered tool list), ``history``
(older turns), ``recent`` (the last assistant turn and what follows it, plus the generation
prompt) and ``observation`` (tool results after the last assistant message).

transformers is imported inside ``load_tokenizer`` only; the analysis itself needs no torch.
The report's rendering (text and JSON on the terminal) is ``agentkv.cli.diagnose``'s.
"""

from __future__ import annotations

from agentkv.diagnostics.causes import CAUSES, Cause, classify
from agentkv.diagnostics.prompts import (
    ZONES,
    ChatTokenizer,
    HFChatTokenizer,
    RenderedPrompt,
    ZoneSpan,
    load_tokenizer,
    render_request,
    zone_of,
)
from agentkv.diagnostics.replay import DiagnoseReport, Divergence, TurnReport, diagnose
from agentkv.diagnostics.trajectory import (
    LineError,
    Trajectory,
    TrajectoryRequest,
    load_trajectory,
    read_trajectory,
)

__all__ = [
    "CAUSES",
    "ZONES",
    "Cause",
    "ChatTokenizer",
    "DiagnoseReport",
    "Divergence",
    "HFChatTokenizer",
    "LineError",
    "RenderedPrompt",
    "Trajectory",
    "TrajectoryRequest",
    "TurnReport",
    "ZoneSpan",
    "classify",
    "diagnose",
    "load_tokenizer",
    "load_trajectory",
    "read_trajectory",
    "render_request",
    "zone_of",
]
