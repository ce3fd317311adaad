import json, statistics as st, sys, collections
d0 = sys.argv[1]
for rep in (1,2,3):
    try: d=json.load(open(f'{d0}/pool-128/rep-{rep}/report.json'))
    except FileNotFoundError: break
    cfg=d['configs']
    def rounds(n):
        return {(r['session_id'], r['round']): r for r in cfg[n]['rounds']}
    v = rounds('vanilla')
    for n in cfg:
        if n == 'vanilla': continue
        a = rounds(n)
        keys=[k for k in v if k in a and v[k]['kind']=='resume']
        diffs=[a[k]['ttft_s']-v[k]['ttft_s'] for k in keys]
        pf = collections.Counter(str(a[k].get('prefetch')) for k in keys)
        print(rep, n, len(keys), 'ttft diff median %.1f ms mean %.1f' % (st.median(diffs)*1e3, st.mean(diffs)*1e3), dict(pf))
        by = collections.defaultdict(list)
        for k in keys: by[str(a[k].get('prefetch'))].append(a[k]['ttft_s']-v[k]['ttft_s'])
        for p, ds in by.items(): print('      prefetch=%s n=%d median %.1f ms' % (p, len(ds), st.median(ds)*1e3))
