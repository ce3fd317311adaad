"""Per-thread CPU of each vLLM server tree (health to exit) + optional py-spy of api/engine.
argv: OUT SECONDS [spy]"""
import os, sys, time, collections, re, urllib.request, subprocess
out, limit = sys.argv[1], float(sys.argv[2]); spy = len(sys.argv) > 3
hz = os.sysconf(os.sysconf_names['SC_CLK_TCK'])
def cmd(p):
    try: return open(f'/proc/{p}/cmdline','rb').read().replace(b'\0', b' ').decode()
    except Exception: return ''
def tstat(p, t):
    try:
        st = open(f'/proc/{p}/task/{t}/stat').read(); f = st[st.rindex(')')+2:].split()
        name = st[st.index('(')+1:st.rindex(')')]
        nv = 0
        for line in open(f'/proc/{p}/task/{t}/status'):
            if line.startswith('nonvoluntary_ctxt_switches'): nv = int(line.split()[1])
        return name, int(f[11]) + int(f[12]), nv
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
if os.path.exists(out + '.stop'): os.remove(out + '.stop')
roots=[]; healthy={}; base={}; last={}; spies={}
end = time.time() + limit
n = 0
while time.time() < end and not os.path.exists(out + '.stop'):
    procs = [int(p) for p in os.listdir('/proc') if p.isdigit()]
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
            if healthy[p] and spy:
                for q in tree(p):
                    comm = open(f'/proc/{q}/comm').read().strip()
                    if q == p or 'EngineCor' in comm:
                        tag = 'api' if q == p else 'core'
                        spies[(p,q)] = subprocess.Popen(['/work/main/.venv/bin/py-spy','record','-p',str(q),'-r','100','--nonblocking','-f','raw','-t','-d','14','-o',f'{out}.{len(roots)}.{tag}.txt'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for q in tree(p):
            try: pname = open(f'/proc/{q}/comm').read().strip()
            except Exception: continue
            try: tids = os.listdir(f'/proc/{q}/task')
            except Exception: continue
            for t in tids:
                s = tstat(q, t)
                if s is None: continue
                key = (p, q, t)
                if not healthy[p]: base[key] = (s[1], s[2])
                b = base.get(key, (s[1], s[2]) if not healthy[p] else (0, 0))
                last[key] = (pname, s[0], s[1] - b[0], s[2] - b[1])
    time.sleep(0.5)
with open(out, 'w') as fh:
    for i, root in enumerate(roots):
        agg = collections.Counter(); per = collections.Counter(); nvc = collections.Counter()
        for (r, q, t), (pname, tname, v, nv) in last.items():
            if r == root:
                agg[pname] += v / hz; per[(pname, tname)] += v / hz; nvc[(pname, tname)] += nv
        fh.write(f'== server {i} (root {root}) total {sum(agg.values()):.2f} s\n')
        for k, v in agg.most_common(): fh.write(f'   {v:7.2f} s {k}\n')
        for (pn, tn), v in per.most_common(25):
            if v >= 0.01: fh.write(f'        {v:7.2f} s {pn}/{tn}  involuntary ctxsw {nvc[(pn, tn)]}\n')
