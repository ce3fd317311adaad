"""Per-process CPU of each vLLM server tree (health check to exit) and of the bench client
while each server was healthy. argv: OUT SECONDS LABEL1,LABEL2,... (labels in server order)."""
import os, sys, time, collections, re, urllib.request
out, limit, labels = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(',')
hz = os.sysconf(os.sysconf_names['SC_CLK_TCK'])
def cmd(p):
    try: return open(f'/proc/{p}/cmdline','rb').read().replace(b'\0', b' ').decode()
    except Exception: return ''
def ticks(p):
    try:
        st = open(f'/proc/{p}/stat').read(); f = st[st.rindex(')')+2:].split()
        return int(f[11]) + int(f[12])
    except Exception: return None
def tree(root):
    pids = [root]; i = 0
    while i < len(pids):
        try:
            for t in os.listdir(f'/proc/{pids[i]}/task'):
                try: pids += [int(c) for c in open(f'/proc/{pids[i]}/task/{t}/children').read().split()]
                except Exception: pass
        except Exception: pass
        i += 1
    return pids
roots = []  # in order of appearance
healthy = {}
base = {}   # (root, pid) -> ticks at health
last = {}   # (root, pid) -> (pname, ticks)
client = {} # root -> [client ticks at health, at last seen]
end = time.time() + limit
while time.time() < end and not os.path.exists('/tmp/i26c/stop'):
    procs = [int(p) for p in os.listdir('/proc') if p.isdigit()]
    clients = [p for p in procs if 'bench agents' in cmd(p)]
    cticks = sum(ticks(p) or 0 for p in clients)
    for p in procs:
        c = cmd(p)
        if 'vllm.entrypoints.openai.api_server' not in c or 'python' not in c.split(' ')[0]: continue
        if p not in roots: roots.append(p)
        if not healthy.get(p):
            try:
                port = re.search(r'--port (\d+)', c).group(1)
                with urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=0.3) as r:
                    healthy[p] = r.status == 200
            except Exception: healthy[p] = False
        for q in tree(p):
            t = ticks(q)
            if t is None: continue
            try: pname = open(f'/proc/{q}/comm').read().strip()
            except Exception: continue
            if not healthy[p]: base[(p, q)] = t
            last[(p, q)] = (pname, t - base.get((p, q), t if not healthy[p] else 0))
        if healthy[p]:
            client.setdefault(p, [cticks, cticks])[1] = cticks
    time.sleep(0.5)
with open(out, 'w') as fh:
    for i, root in enumerate(roots):
        agg = collections.Counter()
        for (r, q), (pname, t) in last.items():
            if r == root: agg[pname] += t / hz
        label = labels[i] if i < len(labels) else f'server{i}'
        c0, c1 = client.get(root, [0, 0])
        fh.write(f'== {label} (root {root}) total {sum(agg.values()):.2f} s CPU; bench client {(c1 - c0) / hz:.2f} s\n')
        for k, v in agg.most_common(8):
            if v >= 0.05: fh.write(f'   {v:7.2f} s  {k}\n')
print(open(out).read())
