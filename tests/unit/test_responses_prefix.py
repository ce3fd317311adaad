"""The conversation-prefix match of Responses runs without a chain (``agentkv_vllm.prefixes``):
pure logic, no vLLM. The hooks around it are in test_responses_prefix_hooks.py."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv_vllm.prefixes import (
    ConversationPrefixes,
    Stored,
    conversation_digests,
    extend,
    normalize_item,
)

USER = {"role": "user", "content": "What is the weather?"}


def call(call_id: str, name: str = "get_weather") -> dict[str, Any]:
    """A function_call output item as vLLM writes it."""
    return {
        "id": f"fc_{call_id}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": '{"city":"paris"}',
        "status": "completed",
        "namespace": None,
    }


def replayed(item: dict[str, Any]) -> dict[str, Any]:
    """What the Agents SDK resends for it (``to_input_item``: a parsed item dumped with
    ``exclude_unset``, minus ``created_by``; a placeholder id dropped)."""
    out = {k: v for k, v in item.items() if k not in ("created_by", "id")}
    out["status"] = None
    return out


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "sunny"}


def store(prefixes: ConversationPrefixes, body: dict[str, Any], out: list[Any], tid: str) -> None:
    digests = conversation_digests(body, body.get("cache_salt"))
    assert digests is not None
    prefixes.record(extend(digests[-1], out), tid, "main")


def find(prefixes: ConversationPrefixes, body: dict[str, Any]) -> Stored | None:
    digests = conversation_digests(body, body.get("cache_salt"))
    return None if digests is None else prefixes.lookup(digests)


def test_a_resent_conversation_continues_the_response_it_starts_with() -> None:
    prefixes = ConversationPrefixes()
    first = {"input": [USER]}
    store(prefixes, first, [call("c1")], "resp_1")
    second = {"input": [USER, replayed(call("c1")), output("c1")]}
    assert find(prefixes, second) == Stored("resp_1", "main")
    # The third turn matches the second response's conversation, the longest stored prefix.
    store(prefixes, second, [call("c2")], "resp_1")
    third = {"input": [*second["input"], replayed(call("c2")), output("c2")]}
    assert find(prefixes, third) == Stored("resp_1", "main")
    assert len(prefixes) == 2


def test_a_string_input_is_one_user_message() -> None:
    prefixes = ConversationPrefixes()
    store(prefixes, {"input": "hi"}, [call("c1")], "t")
    resent = {"input": [{"content": "hi", "role": "user"}, replayed(call("c1")), output("c1")]}
    assert find(prefixes, resent) == Stored("t", "main")


def test_only_what_the_round_trip_changes_is_normalized() -> None:
    item = call("c1")
    assert normalize_item(item) == normalize_item(replayed(item))
    assert normalize_item({"role": "user", "content": "x"}) == normalize_item(
        {"type": "message", "role": "user", "content": "x", "id": None}
    )
    nested = {"type": "message", "content": [{"type": "output_text", "logprobs": None}]}
    assert normalize_item(nested) == {"type": "message", "content": [{"type": "output_text"}]}
    # Everything else is the conversation: another call id, argument, name or text differs.
    for changed in (
        {**item, "call_id": "c2"},
        {**item, "arguments": '{"city":"rome"}'},
        {**item, "name": "other"},
    ):
        assert normalize_item(changed) != normalize_item(item)


def test_two_runs_with_different_histories_never_merge() -> None:
    prefixes = ConversationPrefixes()
    store(prefixes, {"input": [USER]}, [call("a1")], "run_a")
    store(prefixes, {"input": [USER]}, [call("b1")], "run_b")
    assert find(prefixes, {"input": [USER, replayed(call("a1")), output("a1")]}) == Stored(
        "run_a", "main"
    )
    assert find(prefixes, {"input": [USER, replayed(call("b1")), output("b1")]}) == Stored(
        "run_b", "main"
    )
    # The shared first message alone is no stored conversation.
    assert find(prefixes, {"input": [USER, {"role": "user", "content": "more"}]}) is None


def test_identical_histories_are_ambiguous_and_stay_so() -> None:
    prefixes = ConversationPrefixes()
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
    store(prefixes, {"input": [USER]}, [text], "run_a")
    store(prefixes, {"input": [USER]}, [text], "run_a")  # the same run again: still its own
    nxt = {"input": [USER, text, {"role": "user", "content": "and?"}]}
    assert find(prefixes, nxt) == Stored("run_a", "main")
    store(prefixes, {"input": [USER]}, [text], "run_b")
    assert find(prefixes, nxt) == Stored("run_b", "main", ambiguous=True)
    store(prefixes, {"input": [USER]}, [text], "run_a")
    assert find(prefixes, nxt) == Stored("run_a", "main", ambiguous=True)


def test_tenants_never_share_a_conversation() -> None:
    prefixes = ConversationPrefixes()
    store(prefixes, {"input": [USER], "cache_salt": "tenant-a"}, [call("c1")], "t")
    resent = [USER, replayed(call("c1")), output("c1")]
    assert find(prefixes, {"input": resent, "cache_salt": "tenant-a"}) == Stored("t", "main")
    assert find(prefixes, {"input": resent, "cache_salt": "tenant-b"}) is None
    assert find(prefixes, {"input": resent}) is None


def test_a_chained_or_stored_conversation_request_is_not_matched() -> None:
    assert conversation_digests({"input": [USER], "previous_response_id": "r"}, None) is None
    assert conversation_digests({"input": [USER], "conversation": "conv_1"}, None) is None
    assert conversation_digests({"input": 3}, None) is None
    assert conversation_digests({"input": []}, None) is not None
    assert ConversationPrefixes().lookup(conversation_digests({"input": []}, None) or []) is None


def test_the_index_is_bounded_and_keeps_active_runs() -> None:
    prefixes = ConversationPrefixes(max_entries=2)
    bodies = [{"input": [{"role": "user", "content": f"run {i}"}]} for i in range(3)]
    store(prefixes, bodies[0], [call("c0")], "t0")
    store(prefixes, bodies[1], [call("c1")], "t1")
    resent0 = {"input": [*bodies[0]["input"], replayed(call("c0")), output("c0")]}
    assert find(prefixes, resent0) == Stored("t0", "main")  # used: t1 is now the oldest
    store(prefixes, bodies[2], [call("c2")], "t2")
    assert len(prefixes) == 2 and find(prefixes, resent0) is not None
    assert find(prefixes, {"input": [*bodies[1]["input"], replayed(call("c1"))]}) is None
    digests = conversation_digests(resent0, None)
    assert digests is not None
    prefixes.forget(extend(digests[0], [*bodies[0]["input"], call("c0")]))
    assert find(prefixes, resent0) is None


ITEMS = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "function_call", "function_call_output"])},
        optional={
            "call_id": st.text(max_size=4),
            "content": st.one_of(st.none(), st.text(max_size=4)),
            "id": st.text(max_size=4),
            "status": st.sampled_from([None, "completed", "in_progress"]),
        },
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(ITEMS, ITEMS, ITEMS, st.sampled_from([None, "s1", "s2"]))
def test_a_lookup_finds_the_longest_stored_prefix_and_nothing_else(
    stored: list[dict[str, Any]],
    outs: list[dict[str, Any]],
    new: list[dict[str, Any]],
    salt: str | None,
) -> None:
    """Any conversation stored in one tenant is found by every input that starts with it (after
    the round trip's normalization) in that tenant, and by no other tenant; a lookup names the
    longest stored prefix."""
    prefixes = ConversationPrefixes()
    body: dict[str, Any] = {"input": stored, "cache_salt": salt}
    store(prefixes, body, outs, "t")
    conversation = [*stored, *outs]
    resent = [replayed(i) if i["type"] == "function_call" else i for i in conversation]
    if conversation:
        assert find(prefixes, {"input": [*resent, *new], "cache_salt": salt}) == Stored("t", "main")
        other = "s3" if salt else "s1"
        assert find(prefixes, {"input": [*resent, *new], "cache_salt": other}) is None
        # A strictly shorter input is no resend of it.
        short = [normalize_item(i) for i in conversation[:-1]]
        found = find(prefixes, {"input": short, "cache_salt": salt})
        assert found is None
    # A longer stored prefix wins over a shorter one.
    store(prefixes, {"input": [*conversation, *new], "cache_salt": salt}, [], "longer")
    if new:
        assert find(prefixes, {"input": [*conversation, *new], "cache_salt": salt}) == Stored(
            "longer", "main"
        )
