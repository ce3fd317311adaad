"""CPU per pause+resume pair, per process, on an idle agentkv server."""
import os, sys, time, resource, json
sys.path.insert(0, '/work/main/bench')
import httpx
from agentkv import modelgen
from agentkv.launch import LaunchSpec, running_server
hz = os.sysconf('SC_CLK_TCK')
def ticks(p):
    st = open(f'/proc/{p}/stat').read(); f = st[st.rindex(')')+2:].split(); return int(f[11]) + int(f[12])
def tree(root):
    pids=[root]; i=0
    while i < len(pids):
        for t in os.listdir(f'/proc/{pids[i]}/task'):
            try: pids += [int(c) for c in open(f'/proc/{pids[i]}/task/{t}/children').read().split()]
            except Exception: pass
        i+=1
    return pids
def tticks(p, t):
    st = open(f'/proc/{p}/task/{t}/stat').read(); f = st[st.rindex(')')+2:].split(); return int(f[11]) + int(f[12])
def snap(root):
    out = {}
    for q in tree(root):
        pn = open(f'/proc/{q}/comm').read().strip()
        for t in os.listdir(f'/proc/{q}/task'):
            tn = open(f'/proc/{q}/task/{t}/comm').read().strip()
            k = f"{pn}[{q}]/{tn}"
            out[k] = out.get(k, 0) + tticks(q, t)
    return out
N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
model = str(modelgen.ensure_model('small'))
spec = LaunchSpec(model=model, connector_config={"host_capacity_gib": 1}, num_blocks=128, kv_space_gib=1, max_model_len=4096, served_model_name='small', extra_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, log_path=__import__('pathlib').Path('/work/tmp/s8/cpu_pair.log'))
with running_server(spec) as srv:
    c = httpx.Client(timeout=60)
    def req(tid):
        r = c.post(srv.base_url + '/v1/completions', json={"model": srv.model, "prompt": [17]*300, "max_tokens": 4, "temperature": 0, "kv_transfer_params": {"agentkv": {"trajectory_id": tid}}})
        r.raise_for_status()
    req('t0'); time.sleep(1)
    r = c.post(srv.base_url + '/agentkv/v1/trajectories/t0/pause', json={"tool": "bash"}); print('first pause', r.json().get('decision', {}).get('action'), r.json().get('decision', {}).get('rationale', '')[:300])
    c.post(srv.base_url + '/agentkv/v1/trajectories/t0/resume', json={})
    print('STATUS', {k: v for k, v in c.get(srv.base_url + '/agentkv/v1/status').json()['pool'].items() if k in ('steps', 'pinned_blocks')})
    for label, fn in [('pause+resume', lambda i: (c.post(srv.base_url + '/agentkv/v1/trajectories/t0/pause', json={"tool": "bash"}).raise_for_status(), c.post(srv.base_url + '/agentkv/v1/trajectories/t0/resume', json={}).raise_for_status())),
                      ('status', lambda i: c.get(srv.base_url + '/agentkv/v1/status').raise_for_status()),
                      ('health', lambda i: c.get(srv.base_url + '/health').raise_for_status())]:
        time.sleep(1)
        spies = []
        if os.environ.get('SPY') and label == 'pause+resume':
            import subprocess
            for q in tree(srv.proc.pid):
                comm = open(f'/proc/{q}/comm').read().strip()
                if q == srv.proc.pid or 'EngineCor' in comm:
                    tag = 'api' if q == srv.proc.pid else 'core'
                    spies.append(subprocess.Popen(['/work/main/.venv/bin/py-spy','record','-p',str(q),'-r','250','-f','raw','-t','-d','8','-o',f'/work/tmp/s8/pair.{tag}.txt'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.5)
        steps0 = c.get(srv.base_url + '/agentkv/v1/status').json()['pool']['steps']
        a = snap(srv.proc.pid); ca = resource.getrusage(resource.RUSAGE_SELF); t0 = time.monotonic()
        for i in range(N): fn(i)
        wall = time.monotonic() - t0
        for sp in spies: sp.wait()
        b = snap(srv.proc.pid); cb = resource.getrusage(resource.RUSAGE_SELF)
        per = {k: (b[k]-a[k])/hz/N*1e3 for k in b if k in a}
        cl = ((cb.ru_utime+cb.ru_stime)-(ca.ru_utime+ca.ru_stime))/N*1e3
        steps1 = c.get(srv.base_url + '/agentkv/v1/status').json()['pool']['steps']
        print(f"steps {steps0} -> {steps1}")
        print(f"{label:14s} wall/call {wall/N*1e3:6.2f} ms  client {cl:5.2f} ms  " + "  ".join(f"{k} {v:5.2f}" for k,v in per.items() if v > 0.005), flush=True)
