"""`flashnext serve --decode-graph on`: seconds until the server is ready, and until every bucket runs compiled.

Starts `flashnext serve` (the tiny default model unless `--model`, CPU) as a subprocess three times:
- eager (`--decode-graph off`): the reference time to ready;
- cold cache: the decode graph with a fresh, empty `--compile-cache` directory;
- warm cache: the same again, over the directory the cold run filled.
ready_s is the time from launch until `GET /health` answers (the decode buckets compile in the background after
that, their decode steps running eager meanwhile); all_compiled_s the time until `/health` lists no bucket pending.
Both include the interpreter start and the model load. The box may be shared: the load average is printed with
each line. A cold run compiles each bucket with inductor (a minute or more per bucket on 2 busy cores), so the
default buckets are small (1, 2).

Output:
    # model=<name> buckets=<b> threads=<t> load=<1-min load average> cores=<n>
    cache=none ready_s=<x>
    cache=cold ready_s=<x> all_compiled_s=<y>
    cache=warm ready_s=<x> all_compiled_s=<y>

    python benchmarks/decode_graph_ready.py
    python benchmarks/decode_graph_ready.py --buckets 1,2,4 --threads 2 --cache-dir /tmp/fn-cache
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, graph: bool, cache_dir: str | None) -> tuple[float, float | None]:
    """(seconds to ready, seconds until no bucket is pending; None without the graph) of one `serve` start."""
    port = _free_port()
    cmd = [sys.executable, "-m", "flashnext", "serve", "--port", str(port), "--threads", str(args.threads),
           "--max-slots", str(max(int(b) for b in args.buckets.split(","))), "--decode-buckets", args.buckets,
           "--decode-graph", "on" if graph else "off"]  # fmt: skip
    if cache_dir is not None:
        cmd += ["--compile-cache", cache_dir]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.TemporaryFile("w+")  # serve's log (a pipe nobody reads could fill and block it)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/health"
    try:
        ready = None
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"serve exited with {proc.returncode}: {log.read()[-2000:]}")
            try:
                health = httpx.get(url, timeout=10).json()
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            now = time.perf_counter() - start
            ready = ready if ready is not None else now
            if not graph or not health["decode_graph"]["pending"]:
                return ready, (now if graph else None)
            if now > args.timeout:
                raise SystemExit(f"buckets still pending after {args.timeout} s: {health}")
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny default model)")
    p.add_argument("--buckets", default="1,2", help="decode buckets (default 1,2; --max-slots is the largest)")
    p.add_argument("--threads", type=int, default=1, help="serve --threads (default 1)")
    p.add_argument("--cache-dir", default=None, help="an empty or new compile cache dir (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800, help="give up on a run after this many seconds")
    args = p.parse_args()
    load = lambda: f"load={os.getloadavg()[0]:.1f}"
    print(f"# model={args.model or 'flashnext-tiny'} buckets={args.buckets} threads={args.threads} {load()} "
          f"cores={os.cpu_count()}", flush=True)  # fmt: skip
    ready, _ = measure(args, graph=False, cache_dir=None)
    print(f"cache=none ready_s={ready:.1f} {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fn-compile-cache-") as tmp:
        cache_dir = args.cache_dir or tmp
        if os.path.isdir(cache_dir) and os.listdir(cache_dir):
            raise SystemExit(f"--cache-dir {cache_dir} is not empty: the cold run needs an empty compile cache")
        for kind in ("cold", "warm"):
            ready, done = measure(args, graph=True, cache_dir=cache_dir)
            print(f"cache={kind} ready_s={ready:.1f} all_compiled_s={done:.1f} {load()}", flush=True)


if __name__ == "__main__":
    main()
