"""The text-generation server (mlm_jax/serve.py) over loopback (127.0.0.1 only): Megatron's
PUT /api, OpenAI's POST /v1/completions, batching of concurrent requests, 400s naming the
field, 503 when the queue is full, timeouts, a bounded load test, the CLI client, and the page
at / in a real headless Chromium."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import mlm_jax
from mlm_jax.serve import make_app
from tests.gen_util import gpt2_reference, make_gpt2, numpy_decoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["w5 w9 w13", "w40 w2", "w7 w7 w7 w1 w3", "w60", "w11 w12 w13 w14", "w90 w80", "w33", "w2 w4 w6"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving `app` on 127.0.0.1 in a thread of this process."""

    def __init__(self, app):
        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("serve") / "gpt2")
    cfg, w = make_gpt2(folder)
    model = mlm_jax.load(folder)
    app = make_app(model, max_batch=16, max_queue=64, timeout=60.0)
    server = Server(app)
    yield server, app, model, cfg, w
    server.close()


def _put(url, body, timeout=60):
    return httpx.put(url + "/api", json=body, timeout=timeout)


async def _concurrent(url, bodies, path="/api", method="PUT", limit=None):
    sem = asyncio.Semaphore(limit or len(bodies))
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(body):
            async with sem:
                t = time.perf_counter()
                r = await client.request(method, url + path, json=body)
                return r, time.perf_counter() - t
        return await asyncio.gather(*(one(b) for b in bodies))


def test_api_greedy_matches_numpy_decoder(served):
    server, app, model, cfg, w = served
    r = _put(server.url, {"prompts": ["w5 w9 w13"], "tokens_to_generate": 5, "top_k": 1, "logprobs": True})
    assert r.status_code == 200, r.text
    data = r.json()
    want = numpy_decoder(gpt2_reference, w, cfg, [5, 9, 13], 5)
    # Megatron's response: the prompt included in the text, one segment per token, log-probs
    # of every token after the first (the stop token is this tokenizer's <|endoftext|>).
    full = [5, 9, 13] + want
    if cfg["eos_token_id"] in want:
        full = full[: full.index(cfg["eos_token_id"], 3) + 1]
    assert data["text"] == [model.tokenizer.detokenize(full)]
    assert data["segments"] == [[model.tokenizer.detokenize([t]) for t in full]]
    assert len(data["logprobs"][0]) == len(full) - 1


def test_concurrent_equals_sequential(served):
    server, app, model, cfg, w = served
    bodies = [{"prompts": [p], "tokens_to_generate": 6, "top_k": 1 if i % 2 else 0, "temperature": 0.8,
               "random_seed": i} for i, p in enumerate(PROMPTS)]
    sequential = [_put(server.url, b).json()["text"] for b in bodies]
    engine = app.state.engine
    before, joined = engine.steps, engine.joined_running
    results = asyncio.run(_concurrent(server.url, bodies))
    assert [r.json()["text"] for r, _ in results] == sequential
    # Decoded together: fewer steps than one request after another (8 x 6), and some joined
    # a batch that was already decoding (continuous batching).
    assert engine.steps - before < 6 * len(bodies)
    assert engine.joined_running > joined


def test_completions(served):
    server, app, model, cfg, w = served
    r = httpx.post(server.url + "/v1/completions", json={"model": app.state.service.name, "prompt": ["w5 w9 w13", "w40 w2"],
                                                         "max_tokens": 4, "temperature": 0, "logprobs": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    want = [model.generate([p], max_new_tokens=4)[0] for p in ["w5 w9 w13", "w40 w2"]]
    # The completion is the new text as it follows the prompt (its leading space kept).
    tok = model.tokenizer
    assert [c["text"] for c in data["choices"]] == [
        tok.detokenize(o.prompt + o.tokens)[len(tok.detokenize(o.prompt)):] for o in want]
    assert data["usage"]["completion_tokens"] == sum(len(o.tokens) for o in want)
    assert all(len(c["logprobs"]["token_logprobs"]) == len(o.tokens) for c, o in zip(data["choices"], want))
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"


BAD = [
    ("prompts", {"tokens_to_generate": 4}),
    ("prompts", {"prompts": "w1"}),
    ("prompts", {"prompts": []}),
    ("prompts", {"prompts": ["w1"] * 129}),
    ("prompts", {"prompts": [""]}),
    ("tokens_to_generate", {"prompts": ["w1"], "tokens_to_generate": -1}),
    ("tokens_to_generate", {"prompts": ["w1"], "tokens_to_generate": 2.5}),
    ("tokens_to_generate", {"prompts": ["w1"], "tokens_to_generate": 0}),
    ("tokens_to_generate", {"prompts": ["w1"], "tokens_to_generate": 100}),
    ("logprobs", {"prompts": ["w1"], "logprobs": "yes"}),
    ("temperature", {"prompts": ["w1"], "temperature": 101}),
    ("top_k", {"prompts": ["w1"], "top_k": -1}),
    ("top_k", {"prompts": ["w1"], "top_k": 1001}),
    ("top_p", {"prompts": ["w1"], "top_p": 1.5}),
    ("top_p", {"prompts": ["w1"], "top_k": 5, "top_p": 0.5}),
    ("add_BOS", {"prompts": ["w1"], "add_BOS": 1}),
    ("stop_token", {"prompts": ["w1"], "stop_token": "eos"}),
    ("top_p_decay", {"prompts": ["w1"], "top_p_decay": 0.5}),
    ("top_p_bound", {"prompts": ["w1"], "top_p": 0.5, "top_p_bound": 0.9}),
    ("stop_on_eol", {"prompts": ["w1"], "stop_on_eol": 1}),
    ("no_log", {"prompts": ["w1"], "no_log": "no"}),
    ("length_penalty", {"prompts": ["w1"], "length_penalty": "x"}),
    ("beam_width", {"prompts": ["w1", "w2"], "beam_width": 2}),
    ("beam_width", {"prompts": ["w1"], "beam_width": 0}),
    ("nonsense", {"prompts": ["w1"], "nonsense": 0}),
    ("random_seed", {"prompts": ["w1"], "random_seed": -3}),
    ("max_len", {"prompts": ["w1"], "max_len": 5}),
    ("sentences", {"sentences": ["w1"]}),
    ("body", ["w1"]),
]


def test_bad_requests_are_400_naming_the_field(served):
    server, *_ = served
    for field, body in BAD:
        r = _put(server.url, body)
        assert r.status_code == 400, (field, r.status_code, r.text)
        # Megatron's CLI prints body["message"]; our older clients read "error".
        assert r.json()["field"] == field and r.json()["message"] == r.json()["error"] != "", r.text
    r = httpx.put(server.url + "/api", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["field"] == "body"
    bad_completions = [("prompt", {"max_tokens": 2}), ("max_tokens", {"prompt": "w1", "max_tokens": -2}),
                       ("temperature", {"prompt": "w1", "temperature": 3}), ("n", {"prompt": "w1", "n": 0}),
                       ("stream", {"prompt": "w1", "stream": 1}), ("best_of", {"prompt": "w1", "n": 3, "best_of": 2}),
                       ("logprobs", {"prompt": "w1", "logprobs": 6}), ("stop", {"prompt": "w1", "stop": ["a"] * 5}),
                       ("suffix", {"prompt": "w1", "suffix": "x"}), ("logit_bias", {"prompt": "w1", "logit_bias": {"1": 5}}),
                       ("presence_penalty", {"prompt": "w1", "presence_penalty": 0.5}),
                       ("prompt", {"prompt": [1, 100000]}), ("prompt", {"prompt": []}),
                       ("max_tokens", {"prompt": "w1", "max_tokens": 0})]
    for field, body in bad_completions:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    # An empty prompt: a message that works on the endpoint (it has no add_BOS, Megatron's /api has)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "", "max_tokens": 2}, timeout=10)
    assert r.status_code == 400 and "add_BOS" not in r.text and "give at least one token" in r.text, r.text
    r = _put(server.url, {"prompts": [""], "tokens_to_generate": 2})
    assert r.status_code == 400 and "add_BOS" in r.json()["message"], r.text


def test_queue_limit_gives_503_and_timeout_504(served):
    server, app, *_ = served
    b = app.state.service
    b.max_queue = 1
    try:
        bodies = [{"prompts": [p], "tokens_to_generate": 12, "top_k": 1} for p in PROMPTS]
        results = asyncio.run(_concurrent(server.url, bodies))
        codes = [r.status_code for r, _ in results]
        assert 200 in codes and 503 in codes, codes
        busy = next(r for r, _ in results if r.status_code == 503)
        assert busy.headers["Retry-After"] == "1"
    finally:
        b.max_queue = 64
    b.timeout = 1e-4
    try:
        r = _put(server.url, {"prompts": ["w1 w2"], "tokens_to_generate": 12})
        assert r.status_code == 504 and "timed out" in r.json()["message"]
    finally:
        b.timeout = 60.0


def test_load(served):
    """200 requests, 16 at a time: no errors; prints latency p50/p99 and tokens/s."""
    server, *_ = served
    rng = np.random.default_rng(0)
    bodies = [{"prompts": [" ".join(f"w{t}" for t in rng.integers(1, 99, size=int(rng.integers(1, 6))))],
               "tokens_to_generate": 8, "random_seed": i} for i in range(200)]
    t = time.perf_counter()
    results = asyncio.run(_concurrent(server.url, bodies, limit=16))
    wall = time.perf_counter() - t
    assert [r.status_code for r, _ in results] == [200] * 200
    lat = np.array([d for _, d in results])
    new = sum(len(r.json()["segments"][0]) - len(b["prompts"][0].split()) for (r, _), b in zip(results, bodies))
    print(f"\nload: 200 requests, 16 concurrent: p50 {np.percentile(lat, 50) * 1e3:.0f} ms, "
          f"p99 {np.percentile(lat, 99) * 1e3:.0f} ms, {new / wall:.0f} generated tokens/s, {wall:.1f} s")


def test_text_generation_cli(served):
    server, *_ = served
    env = dict(os.environ, PYTHONPATH=ROOT)
    addr = server.url.removeprefix("http://")
    r = subprocess.run([sys.executable, "-m", "mlm_jax.tools.text_generation_cli", addr],
                       input="w5 w9 w13\n3\nw1\nlots\n", capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Megatron Response: \nw5 w9 w13 " in r.stdout
    assert "error: number of tokens 'lots' is not an integer" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "mlm_jax.tools.text_generation_cli", "nohost"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: address 'nohost'")


def start_serve(folder: str, env: dict, timeout: float = 120, cwd=None):
    """(port, process) of `python -m mlm_jax.serve --load folder` on a free port, once /health answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlm_jax.serve", "--load", folder, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not come up: {proc.communicate()[1][-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return port, proc
        except httpx.TransportError:
            time.sleep(0.2)


def test_serve_command(tmp_path):
    """`python -m mlm_jax.serve` itself: starts, answers, and refuses bad flags with exit 2."""
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    env = dict(os.environ, PYTHONPATH=ROOT)
    bad = subprocess.run([sys.executable, "-m", "mlm_jax.serve", "--load", folder, "--max-queue", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == "error: --max-queue must be >= 1, got 0"
    port, proc = start_serve(folder, env)
    try:
        r = _put(f"http://127.0.0.1:{port}", {"prompts": ["w5 w9"], "tokens_to_generate": 2, "top_k": 1})
        assert r.status_code == 200 and r.json()["text"][0].startswith("w5 w9 ")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
