"""A/B warm load: alternating fresh processes. argv: rounds, then sides NAME=PYTHON:PYTHONPATH:CACHE"""
import subprocess, sys, statistics, json, os
ROUNDS = int(sys.argv[1])
sides = []
for s in sys.argv[2:]:
    name, rest = s.split("=", 1); py, pp, cache = rest.split(":")
    sides.append((name, py, pp, cache))
CODE = """
import json, sys, time, torch, gc
ev=[]
gc.callbacks.append(lambda phase, info: ev.append((phase, info['generation'], time.perf_counter())))
t0 = time.perf_counter()
import sglang_hicache_jit
from sglang_hicache_jit import load_kernels
t1 = time.perf_counter(); lib = load_kernels('9.0'); t2 = time.perf_counter()
gcs=[(ev[i][1], (ev[i+1][2]-ev[i][2])*1e3) for i in range(0,len(ev)-1,2) if t0 <= ev[i][2] <= t2]
print(json.dumps({'total': (t2-t0)*1e3, 'import': (t1-t0)*1e3, 'load': (t2-t1)*1e3, 'gc_ms': sum(g[1] for g in gcs), 'gcs': [g[0] for g in gcs], 'file': sglang_hicache_jit.__file__, 'sglang': 'sglang' in sys.modules or __import__('importlib.util').util.find_spec('sglang') is not None, 'numpy': 'numpy' in sys.modules}))
"""
res = {s[0]: [] for s in sides}
for r in range(ROUNDS + 1):
    for name, py, pp, cache in (sides if r % 2 == 0 else sides[::-1]):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
        env["SGLANG_HICACHE_JIT_CACHE_DIR"] = cache
        if pp: env["PYTHONPATH"] = pp
        out = subprocess.run([py, "-c", CODE], env=env, cwd="/tmp", capture_output=True, text=True)
        if out.returncode: sys.exit(out.stderr)
        if r: res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))  # round 0: warms the page cache
for name, rs in res.items():
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{name:10} median total {med('total'):.2f} ms (best {min(r['total'] for r in rs):.2f})  import {med('import'):.2f}  load_kernels {med('load'):.2f}  gc in window {med('gc_ms'):.2f} ms, collections {sorted(set(g for r in rs for g in r['gcs']))}  numpy {rs[0]['numpy']} sglang {rs[0]['sglang']}  {rs[0]['file']}")
print(f"{ROUNDS} alternating rounds, load average {os.getloadavg()[0]:.2f} after")
