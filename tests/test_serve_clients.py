"""The server against clients nobody on the project wrote, over loopback: the `openai` package
(every completions parameter), lm-eval-harness's request shapes (loglikelihood on token-id
prompts with echo/logprobs/max_tokens, generate_until with stop), Megatron's CLI protocol,
and the faults one client must not turn into everyone's problem."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

import mlm_jax
from mlm_jax.serve import make_app
from tests.test_serve import ROOT, Server, _concurrent, _put, start_serve
from tests.gen_util import make_gpt2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("clients") / "gpt2")
    make_gpt2(folder)
    model = mlm_jax.load(folder)
    app = make_app(model, max_batch=8, max_queue=64, timeout=60.0, name="tiny-gpt2")
    server = Server(app)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    yield server, app, model, client
    server.close()


def _logp(model, ids):
    """log_softmax of mlm_jax.load(...).logits for ids: [len, vocab]."""
    x = model.logits(np.array([ids]))[0].astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def test_openai_models_and_model_check(served, capsys):
    """The listing is exact (another id is not found); a completion naming another model is
    answered by the one served, with a note in the log once per name (a single-model server, as
    llama.cpp's and Megatron's)."""
    server, app, model, client = served
    assert [m.id for m in client.models.list().data] == ["tiny-gpt2"]
    assert client.models.retrieve("tiny-gpt2").id == "tiny-gpt2"
    with pytest.raises(openai.NotFoundError, match="tiny-gpt2"):
        client.models.retrieve("other")
    for _ in range(2):
        r = client.completions.create(model="gpt-4", prompt="w1", max_tokens=1)
        assert r.model == "tiny-gpt2" and len(r.choices) == 1
    out = capsys.readouterr().out
    assert out.count("note: a request names the model 'gpt-4'; this server serves one model, 'tiny-gpt2'") == 1, out


def test_served_id_defaults_to_load_as_given(tmp_path):
    """`serve --load ck` serves the id `ck` (what --help says), which a client names as given."""
    make_gpt2(str(tmp_path / "ck"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    port, proc = start_serve("ck", env, cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["ck"]
        assert client.models.retrieve("ck").id == "ck"
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def test_openai_echo_logprobs_equal_model_logits(served):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 0 and 1."""
    server, app, model, client = served
    ids = [5, 9, 13, 40, 2]
    logp = _logp(model, ids)
    for max_tokens in (0, 1):
        r = client.completions.create(model="tiny-gpt2", prompt=[ids], echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0, seed=1234)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None
        want = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
        np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-5)
        # top_logprobs: the most likely token per position; lm-eval's is_greedy compares them.
        for i in range(1, len(ids)):
            (tok, v), = lp.top_logprobs[i].items()
            assert abs(v - logp[i - 1].max()) < 1e-5
        assert lp.tokens[: len(ids)] == [model.tokenizer.detokenize([t]) for t in ids]
        text = model.tokenizer.detokenize(ids)
        assert r.choices[0].text.startswith(text)
        assert lp.text_offset[: len(ids)] == [len(model.tokenizer.detokenize(ids[:i])) for i in range(len(ids))]
        assert len(lp.token_logprobs) == len(ids) + max_tokens
    # logprobs 5: five alternatives, in order, equal to the model's top five.
    r = client.completions.create(model="tiny-gpt2", prompt=[ids], echo=True, logprobs=5, max_tokens=0)
    top = r.choices[0].logprobs.top_logprobs[3]
    np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(logp[2])[::-1][:5], atol=1e-5)


def test_openai_generation_parameters(served):
    server, app, model, client = served
    tok = model.tokenizer
    greedy = client.completions.create(model="tiny-gpt2", prompt="w5 w9", max_tokens=6, temperature=0)
    want = model.generate(["w5 w9"], max_new_tokens=6)[0]
    full = tok.detokenize(want.prompt + want.tokens)
    assert greedy.choices[0].text == full[len(tok.detokenize(want.prompt)):]
    assert greedy.usage.prompt_tokens == 2 and greedy.usage.completion_tokens == len(want.tokens)
    assert greedy.model == "tiny-gpt2"
    # stop: the text ends before the first stop string, finish_reason "stop".
    second = greedy.choices[0].text.split(" ")[2]
    cut = client.completions.create(model="tiny-gpt2", prompt="w5 w9", max_tokens=6, temperature=0,
                                    stop=[" " + second, "zz"])
    assert cut.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(" " + second)]
    assert cut.choices[0].finish_reason == "stop"
    # n and seed: n different samples, the same again with the same seed.
    a = client.completions.create(model="tiny-gpt2", prompt=["w5", "w7"], max_tokens=5, n=3, seed=7, temperature=1.5)
    b = client.completions.create(model="tiny-gpt2", prompt=["w5", "w7"], max_tokens=5, n=3, seed=7, temperature=1.5)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 6
    assert [c.index for c in a.choices] == list(range(6))
    # best_of: the n of best_of with the highest total log-prob.
    r = client.completions.create(model="tiny-gpt2", prompt="w5", max_tokens=4, n=2, best_of=5, seed=3,
                                  temperature=1.5, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert totals == sorted(totals, reverse=True)
    # stream: server-sent events whose texts join to the non-streamed completion.
    chunks = list(client.completions.create(model="tiny-gpt2", prompt="w5 w9", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(want.tokens)
    stopped = list(client.completions.create(model="tiny-gpt2", prompt="w5 w9", max_tokens=6, temperature=0,
                                             stream=True, stop=[" " + second]))
    assert "".join(c.choices[0].text for c in stopped) == cut.choices[0].text
    assert stopped[-1].choices[0].finish_reason == "stop"
    # Unsupported options are a 400 naming the field.
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model="tiny-gpt2", prompt="w1", frequency_penalty=1.0)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "hi"}])


def test_lm_eval_generate_until_shape(served):
    """lm-eval's generate_until payload: prompt list, max_tokens, temperature 0, stop list, seed."""
    server, app, model, client = served
    body = {"model": "tiny-gpt2", "prompt": ["w5 w9", "w40"], "max_tokens": 8, "temperature": 0,
            "stop": ["w3", "<|endoftext|>"], "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert "w3" not in c["text"]


def test_megatron_cli_protocol_and_error_shape(served, tmp_path):
    """Megatron's tools/text_generation_cli.py reads response.json()['message'] on an error and
    ['text'][0] otherwise: run its exact protocol (requests-free: the same calls with httpx)."""
    server, *_ = served
    ok = httpx.put(server.url + "/api", json={"prompts": ["w5 w9"], "tokens_to_generate": 3},
                   headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json()["text"][0].startswith("w5 w9")
    bad = httpx.put(server.url + "/api", json={"prompts": ["w5"], "tokens_to_generate": "x"})
    assert bad.status_code == 400 and "tokens_to_generate" in bad.json()["message"]
    # Megatron's own fields are accepted.
    r = _put(server.url, {"prompts": ["w5 w9"], "tokens_to_generate": 4, "stop_on_eol": True, "stop_on_double_eol": False,
                          "prevent_newline_after_colon": True, "no_log": True, "top_p": 0.9, "top_p_decay": 0.5,
                          "top_p_bound": 0.2, "random_seed": 3, "stop_token": 50256, "temperature": 0.0})
    assert r.status_code == 200, r.text
    # temperature 0 is greedy on /api as on /v1 (top_k 1 gives the same).
    a = _put(server.url, {"prompts": ["w5 w9"], "tokens_to_generate": 4, "temperature": 0}).json()["text"]
    b = _put(server.url, {"prompts": ["w5 w9"], "tokens_to_generate": 4, "top_k": 1}).json()["text"]
    assert a == b


def test_api_beam_search(served):
    """PUT /api with beam_width: Megatron's response (the whole beam, best first, its scores),
    equal to mlm_jax.beam (tested against a reference search on full logits in test_beam)."""
    from mlm_jax.beam import beam_search

    server, app, model, _ = served
    e = app.state.engine
    r = _put(server.url, {"prompts": ["w5 w9"], "tokens_to_generate": 4, "beam_width": 3, "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = model.tokenizer.tokenize("w5 w9")
    want = beam_search(e.graphdef, e.params, model.config.vocab_size, ids, 4, 3, model.tokenizer.eod, 0.5,
                       None, e.context, e.mesh, e.rules)
    assert data["text"] == [model.tokenizer.detokenize(b.tokens) for b in want]
    np.testing.assert_allclose(data["scores"], [b.score for b in want], atol=1e-6)
    assert data["scores"] == sorted(data["scores"], reverse=True) and len(data["segments"]) == 3
    assert _put(server.url, {"prompts": ["w5"], "tokens_to_generate": 2, "beam_width": 2,
                             "stop_token": 10**6}).status_code == 200


def test_faults_do_not_stall_others(served):
    server, app, *_ = served
    svc = app.state.service
    # 5 MB prompt: refused before tokenising; a body over the limit: 413.
    t = time.perf_counter()
    r = _put(server.url, {"prompts": ["w1 " * 1_700_000], "tokens_to_generate": 1})
    assert r.status_code == 400 and r.json()["field"] == "prompts" and time.perf_counter() - t < 5, r.text[:200]
    limit = svc.max_body
    svc.max_body = 1 << 20
    try:
        r = httpx.put(server.url + "/api", content=b"x" * (2 << 20), timeout=30)
        assert r.status_code == 413 and r.json()["field"] == "body"
    finally:
        svc.max_body = limit
    # Deep JSON: 400 naming the body (not a 500).
    r = httpx.post(server.url + "/v1/completions", content=b"[" * 100000 + b"]" * 100000, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    # stop_token any integer, as Megatron: out-of-vocabulary ids never match.
    for stop in (-1, 10**9):
        assert _put(server.url, {"prompts": ["w1"], "tokens_to_generate": 2, "stop_token": stop}).status_code == 200
    # A 5 MB request during a load does not raise the others' p99 by more than a second.
    bodies = [{"prompts": [f"w{i % 90 + 1} w2"], "tokens_to_generate": 6, "random_seed": i} for i in range(48)]

    async def with_big():
        big = asyncio.create_task(asyncio.to_thread(_put, server.url, {"prompts": ["w1 " * 1_700_000]}))
        res = await _concurrent(server.url, bodies, limit=8)
        await big
        return res

    base = asyncio.run(_concurrent(server.url, bodies, limit=8))
    loaded = asyncio.run(with_big())
    p99 = lambda res: np.percentile([d for _, d in res], 99)  # noqa: E731
    assert all(r.status_code == 200 for r, _ in loaded)
    print(f"\np99 without / with a 5 MB request: {p99(base) * 1e3:.0f} / {p99(loaded) * 1e3:.0f} ms")
    assert p99(loaded) < p99(base) + 1.0


def test_continuous_batching_joins_running_batch(served):
    """A row that arrives while another decodes joins at the next step and finishes first."""
    from mlm_jax.serve.engine import Request, Row

    server, app, *_ = served
    engine = app.state.engine
    seen = {}

    async def run():
        loop = asyncio.get_running_loop()
        short_done, long_done = loop.create_future(), loop.create_future()
        short = Row([7, 8], 1)

        def on_token(row):
            if len(row.tokens) == 1 and not row.done:  # the long row is decoding: submit another
                engine.submit(Request([short], loop, lambda rs: short_done.set_result(rs)))
            if short.done and "long_at" not in seen:
                seen["long_at"] = len(row.tokens)

        long = Row([5, 9], 12, on_token=on_token)
        engine.submit(Request([long], loop, lambda rs: long_done.set_result(rs)))
        await asyncio.gather(short_done, long_done)
        return short, long

    before = engine.joined_running
    short, long = asyncio.run(run())
    assert engine.joined_running == before + 1
    assert len(short.tokens) == 1 and len(long.tokens) == 12
    assert seen["long_at"] < 12  # the short row ended while the long one was still decoding


def test_serve_port_in_use_and_sigint(tmp_path):
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    env = dict(os.environ, PYTHONPATH=ROOT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mlm_jax.serve", "--load", folder, "--port", str(port)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: --port {port}: 127.0.0.1:{port} is already in use")
    port, proc = start_serve(folder, env)
    try:
        r = _put(f"http://127.0.0.1:{port}", {"prompts": ["w5 w9"], "tokens_to_generate": 2, "top_k": 1})
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)"
    assert "PUT /api 200 prompt=2 new=2" in out and "decode ready" in out and "serving" in out


def test_chat_completions_with_a_template(tmp_path):
    """A tokenizer whose tokenizer_config.json carries a chat template serves chat completions:
    the reply is the completion of the rendered conversation."""
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template":
                   "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"}, f)
    model = mlm_jax.load(folder)
    server = Server(make_app(model, max_batch=2, name="chat"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "w5 w9"}],
                                           max_tokens=4, temperature=0)
        plain = client.completions.create(model="chat", prompt="w5 w9 w3", max_tokens=4, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == plain.choices[0].text
        assert r.usage.prompt_tokens == 3
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="chat", messages=[{"role": "user"}])
    finally:
        server.close()


def test_a_client_gone_mid_body_is_one_log_line(served, capfd):
    """Issue "reliability, round three": a client that disconnects mid-body printed starlette's
    whole ClientDisconnect traceback; now one log line, and the server goes on answering."""
    server, *_ = served
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  b'{"prompts": ["w1')
    time.sleep(1.0)
    r = _put(server.url, {"prompts": ["w5 w9"], "tokens_to_generate": 1, "top_k": 1})
    assert r.status_code == 200
    out, err = capfd.readouterr()
    assert "PUT /api: the client disconnected before its request body ended" in out + err, out + err
    assert "Traceback" not in out + err and "ClientDisconnect" not in out + err
