"""The bench's occupancy sampler reads agentkv's status only every few samples (each read is a
control call the engine answers, which the vanilla server it is compared with is not asked)."""

from __future__ import annotations

import httpx

from agentkv_bench.sampler import Sampler

METRICS = 'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:num_requests_running 2\n'


async def test_status_is_read_every_nth_sample_and_on_the_last_carried_in_between() -> None:
    hits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        n = hits.count("/agentkv/v1/status")
        return httpx.Response(200, json={"bytes_held": {"host": n}})

    sampler = Sampler("http://x", agentkv=True, t_run=0.0, paused=lambda: (0, 0), status_every=3)
    await sampler._client.aclose()
    sampler._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    for _ in range(5):
        await sampler.sample_once()
    await sampler.sample_once(last=True)
    await sampler._client.aclose()
    assert hits.count("/metrics") == 6
    assert hits.count("/agentkv/v1/status") == 3  # samples 0 and 3, and the last
    assert [s.host_bytes for s in sampler.samples] == [1, 1, 1, 2, 2, 3]
    assert all(s.kv_usage == 0.25 for s in sampler.samples)


async def test_a_vanilla_sampler_never_asks_for_agentkv_status() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, text=METRICS)

    sampler = Sampler("http://x", agentkv=False, t_run=0.0, paused=lambda: (1, 10))
    await sampler._client.aclose()
    sampler._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    await sampler.sample_once(last=True)
    await sampler._client.aclose()
    assert paths == ["/metrics"] and sampler.samples[0].host_bytes is None
