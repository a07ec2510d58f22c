"""Storage and ingest probe: streams a Qwen2.5-1.5B-shaped run (230 modules, 57 norm
parameters) from 4 concurrent clients into a running gradflow-server and prints the
throughput. Usage: python3 scripts/storage_probe.py http://127.0.0.1:7070 STEPS
Then read the file size of the server's --db (after stopping it, so the WAL is
checkpointed). Grad norms are i.i.d. log-normal: a worst case for compression."""
import json, os, random, sys, threading, time, urllib.request
base, steps = sys.argv[1], int(sys.argv[2])
clients, per_batch = 4, 50
mods = [f"qwen.layers.{l}.{m}" for l in range(28) for m in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")][:220] + [f"agent.m{i}" for i in range(10)]
norms = [f"qwen.layers.{l}.{n}.weight" for l in range(28) for n in ("input_layernorm", "post_attention_layernorm")] + ["qwen.norm.weight"]
def req(method, path, body):
    r = urllib.request.Request(base + path, data=body, method=method, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(r).read()
bodies = {}
for c in range(clients):
    run = f"run{c}"
    req("PUT", f"/api/v1/runs/{run}", json.dumps({"params": [{"name": n, "role": "norm", "dtype": "bf16"} for n in norms]}).encode())
    rng = random.Random(c)
    out = []
    for start in range(0, steps, per_batch):
        batch = []
        for s in range(start, start + per_batch):
            batch.append({"step": s, "loss": 4 - s * 1e-4, "lr": 3e-4,
              "modules": [{"module": m, "grad_norm": rng.lognormvariate(-3, 1), "hook_hits": 1} for m in mods],
              "params": [{"name": n, "grad_norm": rng.lognormvariate(-5, 1), "update_norm": 0.0, "drift": 0.0, "mean": 1.0} for n in norms]})
        out.append(json.dumps(batch).encode())
    bodies[run] = out
mb = sum(len(b) for v in bodies.values() for b in v) / 1e6
def worker(run):
    for b in bodies[run]:
        req("POST", f"/api/v1/runs/{run}/steps", b)
t = time.time()
ths = [threading.Thread(target=worker, args=(r,)) for r in bodies]
[x.start() for x in ths]; [x.join() for x in ths]
dt = time.time() - t
values = clients * steps * len(mods)
print(f"{clients} clients x {steps} steps x {len(mods)} modules (+{len(norms)} norm params): {mb:.0f} MB JSON in {dt:.2f}s")
print(f"module values/s: {values/dt:,.0f}   (all values incl. hook hits and 4 per param: {clients*steps*(2*len(mods)+4*len(norms))/dt:,.0f}/s)")
