"""MLflow for reference, with the shape gradflow-bench sends: a local `mlflow server`
on SQLite (what a user would run instead), 4 client threads, each its own run,
logging every step's 690 values (loss, lr, 230 module gradient norms and hook hits,
57 norm weights x 4) with `log_batch`, which takes at most 1,000 metrics a request,
so one step a request. Prints JSON: module gradient norms stored per second and
bytes on disk per module gradient norm.

Usage: python3 scripts/mlflow_reference.py STEPS_PER_CLIENT
(run by `gradflow-bench mlflow`; needs `pip install mlflow`)."""
import json, os, random, socket, subprocess, sys, tempfile, threading, time, urllib.request

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
clients, modules, norms = 4, 230, 57

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

work = tempfile.mkdtemp(prefix="mlflow-ref-")
db = os.path.join(work, "mlflow.db")
port = free_port()
server = subprocess.Popen(
    [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
     "--default-artifact-root", os.path.join(work, "artifacts"), "--host", "127.0.0.1",
     "--port", str(port), "--workers", "2"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
uri = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):
        try:
            urllib.request.urlopen(uri + "/health", timeout=1).read()
            break
        except Exception:
            time.sleep(0.2)
    else:
        raise SystemExit("the MLflow server did not start")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("gradflow-reference")
    names = ["loss", "lr"] + [f"grad_norm/m{m}" for m in range(modules)] + [f"hook_hits/m{m}" for m in range(modules)] \
        + [f"{k}/p{p}" for p in range(norms) for k in ("grad_norm", "update_norm", "drift", "mean")]
    runs = [client.create_run(experiment).info.run_id for _ in range(clients)]
    batches = []
    for c in range(clients):
        rng = random.Random(c)
        out = []
        for s in range(steps):
            ts = int(time.time() * 1000)
            out.append([Metric(n, rng.lognormvariate(-3, 1), ts, s) for n in names])
        batches.append(out)
    def worker(c):
        for metrics in batches[c]:
            client.log_batch(runs[c], metrics=metrics)
    started = time.time()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    seconds = time.time() - started
finally:
    server.terminate()
    server.wait()
size = sum(os.path.getsize(os.path.join(work, f)) for f in os.listdir(work) if f.startswith("mlflow.db"))
module_values = clients * steps * modules
import mlflow
print(json.dumps({
    "mlflow": mlflow.__version__,
    "clients": clients, "steps_per_client": steps, "metrics_per_request": len(names),
    "seconds": round(seconds, 2),
    "module_values_per_second": round(module_values / seconds),
    "values_per_second": round(clients * steps * len(names) / seconds),
    "bytes_per_module_value": round(size / module_values, 1),
}))
