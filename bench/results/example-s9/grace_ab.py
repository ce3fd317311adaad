"""One agentkv server (128 blocks, tiny model): per round, four new trajectories, each two turns
(P tokens, then P+100) with WAIT s between them: (none) no pause, so its grace expires;
(routes) pause + resume calls; (request) pause_after in turn 1; (plain) no trajectory. Prints the
turn-2 TTFT per kind and the server's counters. Usage: grace_ab.py N P (BG=k adds k background
decode streams, CC='{...}' the connector config). A scratch script, kept with its results."""
import os, sys, time, json, random, statistics as st, pathlib
import httpx
from agentkv import modelgen
from agentkv.launch import LaunchSpec, running_server
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
P = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
WAIT = float(os.environ.get('WAIT', '0.5'))
model = str(modelgen.ensure_model('small'))
cc = json.loads(os.environ.get('CC', '{"host_capacity_gib": 1}'))
spec = LaunchSpec(model=model, connector_config=cc, num_blocks=128, kv_space_gib=1, max_model_len=4096,
                  served_model_name='small', extra_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                  log_path=pathlib.Path('grace_ab.log'))
res = {k: [] for k in 'none routes request plain'.split()}
dec = {}
with running_server(spec) as srv:
    c = httpx.Client(timeout=60)
    def turn(prompt, tid, pause_after=None, max_tokens=8):
        body = {"model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if tid:
            ak = {"trajectory_id": tid}
            if pause_after: ak["pause_after"] = pause_after
            body["kv_transfer_params"] = {"agentkv": ak}
        t0 = time.perf_counter(); ttft = None
        with c.stream('POST', srv.base_url + '/v1/completions', json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith('data:') and ttft is None: ttft = time.perf_counter() - t0
        return ttft
    rng = random.Random(0)
    import threading
    stop = threading.Event()
    K = int(os.environ.get('BG', '0'))
    def bg(j):
        cc2 = httpx.Client(timeout=120); r2 = random.Random(j)
        while not stop.is_set():
            body = {"model": srv.model, "prompt": [r2.randrange(100, 8000) for _ in range(300)], "max_tokens": 150, "temperature": 0, "ignore_eos": True}
            cc2.post(srv.base_url + '/v1/completions', json=body)
    ths = [threading.Thread(target=bg, args=(j,), daemon=True) for j in range(K)]
    for t in ths: t.start()
    for i in range(N + 2):
        order = list(res); rng.shuffle(order)
        for kind in order:
            tid = f"{kind}-{i}"
            base = [rng.randrange(100, 8000) for _ in range(P)]
            ext = base + [rng.randrange(100, 8000) for _ in range(100)]
            if kind == 'request':
                turn(base, tid, pause_after={"tool": "bash", "expected_wait_s": WAIT})
            else:
                turn(base, tid if kind != 'plain' else None)
            if kind == 'routes':
                r = c.post(srv.base_url + f"/agentkv/v1/trajectories/{tid}/pause", json={"tool": "bash", "expected_wait_s": WAIT}); print(r.status_code, r.text[:300]) if r.status_code != 200 else None; r.raise_for_status()
                dec.setdefault(r.json().get('decision', {}).get('action'), 0)
                dec[r.json().get('decision', {}).get('action')] += 1
            time.sleep(WAIT)
            if kind == 'routes':
                c.post(srv.base_url + f'/agentkv/v1/trajectories/{tid}/resume', json={}).raise_for_status()
            t = turn(ext, tid if kind != 'plain' else None, max_tokens=1)
            if i >= 2: res[kind].append(t * 1e3)
    stop.set()
    print('decisions(routes)', dec)
    for k, v in res.items():
        v = sorted(v); print(f"{k:8s} n={len(v)} p25 {v[len(v)//4]:.1f} med {st.median(v):.1f} p75 {v[3*len(v)//4]:.1f} ms")
    s = c.get(srv.base_url + '/agentkv/v1/status').json()
    print(json.dumps({k: s.get(k) for k in ('counters',)})[:2000])
