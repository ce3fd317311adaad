import agentkv.simulate.writeback as W
orig = W.WritebackMixin._saved_by_ticks
stats = []
def patched(self, tid, start, n):
    due = self._wb_due[tid]
    D = due - self.trend.filled_total - self._wb_place.ahead(due, self.trend.filled_total)
    got = orig(self, tid, start, n)
    stats.append((D, start, n, got, self.trend.step_peak))
    return got
W.WritebackMixin._saved_by_ticks = patched
import sys
from typer.testing import CliRunner
from agentkv.cli import app
r = CliRunner().invoke(app, "simulate -n 300 -t 20 --time-scale 1 --rate 0.05 -r 8 --num-blocks 256 --host-capacity-gib 16 --policy agentkv".split())
import statistics as st
lost = [s for s in stats if s[3] < s[2]]
print(len(stats), 'lost', len(lost))
print('D-start for lost, quantiles', [round(x) for x in st.quantiles([s[0]-s[1] for s in lost], n=10)] if len(lost)>10 else [(s[0]-s[1]) for s in lost])
print('examples', [(round(a),b,c,d,e) for a,b,c,d,e in lost[:15]])
