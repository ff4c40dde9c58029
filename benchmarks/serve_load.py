"""Server load over loopback: p50/p99 latency and generated tokens/s for a bounded number of
requests, continuous against static batching, and the same load with a 5 MB request in it.

    python benchmarks/serve_load.py [--requests 200] [--concurrency 16] [--out runs/benchmarks]

The model is a tiny Hugging Face GPT-2 folder (tests/gen_util's: 2 layers, d32, 16 positions,
a word-level tokenizer) served in this process by uvicorn on 127.0.0.1; requests ask for 1 to
12 new tokens from 16 clients at a time into 8 decode slots (mixed lengths: static batching waits for the longest of a batch, continuous
batching refills a slot as soon as its row ends). Compiles happen before timing (one warm-up
pass of the same requests). The 5 MB request comes from another process. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _load(url, bodies, limit):
    import httpx

    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(body):
            async with sem:
                t = time.perf_counter()
                r = await client.put(url + "/api", json=body)
                return r.status_code, time.perf_counter() - t, len(r.json().get("tokens", [[]])[0]) if r.status_code == 200 else 0
        return await asyncio.gather(*(one(b) for b in bodies))


def _serve(app):
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def run(mode: str, folder: str, bodies, limit: int, big: bool) -> dict:
    import mlm_jax
    from mlm_jax.serve import make_app

    app = make_app(mlm_jax.load(folder), max_batch=8, max_queue=1024, timeout=600, continuous=mode == "continuous",
                   log=lambda m: None)
    server, url = _serve(app)
    try:
        asyncio.run(_load(url, bodies, limit))  # warm-up: every shape compiled
        steps = app.state.engine.steps

        async def timed():
            extra = None
            if big:  # from another process, as a real client: its JSON encoding is not ours to pay
                import subprocess
                code = ("import httpx, sys; r = httpx.put(sys.argv[1] + '/api', json={'prompts': ['w1 ' * 1_700_000]},"
                        " timeout=300); print(r.status_code)")
                extra = asyncio.create_task(asyncio.to_thread(
                    subprocess.run, [sys.executable, "-c", code, url], capture_output=True, text=True))
            t = time.perf_counter()
            res = await _load(url, bodies, limit)
            times["wall"] = time.perf_counter() - t
            if extra is not None:
                r = await extra
                assert r.stdout.strip() == "400", (r.stdout, r.stderr[-500:])
            return res

        times = {}
        res = asyncio.run(timed())
        wall = times["wall"]
    finally:
        server.should_exit = True
    assert all(code == 200 for code, _, _ in res), [c for c, _, _ in res if c != 200][:5]
    lat = np.array([d for _, d, _ in res])
    new = sum(n - len(b["prompts"][0].split()) for (_, _, n), b in zip(res, bodies))
    return {"mode": mode, "with_5mb_request": big, "requests": len(bodies), "concurrency": limit,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "tokens_per_s": new / wall, "wall_s": wall, "decode_steps": app.state.engine.steps - steps}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", default="runs/benchmarks")
    args = p.parse_args()
    if not 1 <= args.requests <= 200:
        raise SystemExit("error: --requests must be in [1, 200] (a bounded load)")
    from tests.gen_util import make_gpt2

    folder = os.path.join(tempfile.mkdtemp(), "gpt2")
    make_gpt2(folder)
    rng = np.random.default_rng(0)
    bodies = [{"prompts": [" ".join(f"w{t}" for t in rng.integers(1, 99, size=int(rng.integers(1, 4))))],
               "tokens_to_generate": int(rng.integers(1, 13)), "top_k": 1} for _ in range(args.requests)]
    rows = [run("continuous", folder, bodies, args.concurrency, False), run("static", folder, bodies, args.concurrency, False),
            run("continuous", folder, bodies, args.concurrency, True)]
    print(f"{'batching':<11} {'5 MB req':>8} {'p50 ms':>8} {'p99 ms':>8} {'tokens/s':>9} {'steps':>6}")
    for r in rows:
        print(f"{r['mode']:<11} {str(r['with_5mb_request']):>8} {r['p50_ms']:8.0f} {r['p99_ms']:8.0f} "
              f"{r['tokens_per_s']:9.0f} {r['decode_steps']:6d}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "serve_load.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
