"""``_lcp`` (the first divergence of a turn's prompt from its branch's context) compares list
slices in chunks (issue 26); it answers exactly what the token-by-token definition does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentkv.manager.requests import _LCP_WIDTHS, _lcp


def _simple(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


tokens = st.lists(st.integers(min_value=0, max_value=3), max_size=40)


@given(
    prefix=st.lists(st.integers(min_value=0, max_value=2**31), max_size=2000),
    a=tokens,
    b=tokens,
    as_tuple=st.booleans(),
)
def test_lcp_is_the_simple_common_prefix(
    prefix: list[int], a: list[int], b: list[int], as_tuple: bool
) -> None:
    x, y = prefix + a, prefix + b
    assert _lcp(x, tuple(y) if as_tuple else y) == _simple(x, y)
    assert _lcp(y, x) == _simple(x, y)


def test_every_chunk_boundary() -> None:
    base = list(range(3 * _LCP_WIDTHS[0] + 5))
    for i in range(len(base)):
        other = [*base[:i], -1, *base[i + 1 :]]
        assert _lcp(base, other) == i
    assert _lcp(base, base) == len(base)
    assert _lcp(base, base[:700]) == 700
    assert _lcp([], base) == 0
