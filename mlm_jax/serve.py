"""A text-generation server on uvicorn (Starlette): Megatron's `PUT /api`, an OpenAI-style
`POST /v1/completions`, `GET /health` and a small page at `/`.

    python -m mlm_jax.serve --load CKPT --port 5000 [--host 127.0.0.1]
    python -m mlm_jax.tools.text_generation_cli 127.0.0.1:5000

Requests that arrive while a decode runs wait in a bounded queue and are decoded together, in
one batch (`mlm_jax.generate.Decoder`: rows are independent, so each request gets what it would
alone). A request that finds the queue full gets 503 with Retry-After; one that waits longer
than --request-timeout gets 504. Every invalid field is answered 400 with a JSON body
`{"error": message, "field": name}` (Megatron's server answers some of these with 200).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import time
import uuid
from typing import Sequence

from mlm_jax.cli import cli
from mlm_jax.errors import UsageError

MAX_PROMPTS = 128  # Megatron's limit per request
STATIC = os.path.join(os.path.dirname(__file__), "static")


class BadRequest(ValueError):
    """A request field that cannot run: answered 400 naming the field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class Job:
    """One request's prompts (token ids) and settings, decoded as rows of a batch."""

    prompts: list[list[int]]
    new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token: int | None
    logprobs: bool = False  # the prompt tokens' log-probs too
    future: asyncio.Future | None = None
    cancelled: bool = False


# ------------------------------------------------------------------------------ validation


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise BadRequest(field, message)


API_FIELDS = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p",
              "add_BOS", "stop_token", "random_seed")


def parse_api(body, vocab_size: int) -> dict:
    """Megatron's PUT /api fields, validated (BadRequest naming the field), with its defaults."""
    _check(isinstance(body, dict), "body", "the request body must be a JSON object")
    _check("sentences" not in body, "sentences", "sentences is no longer used; replace with prompts")
    _check("max_len" not in body, "max_len", "max_len is no longer used; replace with tokens_to_generate")
    for key in body:
        _check(key in API_FIELDS, key, f"unknown field {key!r}; fields: {', '.join(API_FIELDS)}")
    _check("prompts" in body, "prompts", "prompts argument required")
    prompts = body["prompts"]
    _check(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts), "prompts",
           "prompts is not a list of strings")
    _check(len(prompts) > 0, "prompts", "prompts is empty")
    _check(len(prompts) <= MAX_PROMPTS, "prompts", f"maximum number of prompts is {MAX_PROMPTS}")
    r = dict(prompts=prompts, tokens_to_generate=64, logprobs=False, temperature=1.0, top_k=0, top_p=0.0,
             add_BOS=False, stop_token=None, random_seed=None)
    r.update({k: body[k] for k in API_FIELDS if k in body})
    _check(_is_int(r["tokens_to_generate"]) and r["tokens_to_generate"] >= 0, "tokens_to_generate",
           "tokens_to_generate must be an integer greater than or equal to 0")
    _check(isinstance(r["logprobs"], bool), "logprobs", "logprobs must be a boolean value")
    _check(r["tokens_to_generate"] > 0 or r["logprobs"], "tokens_to_generate",
           "tokens_to_generate=0 implies logprobs should be true")
    _check(_is_number(r["temperature"]) and 0.0 < r["temperature"] <= 100.0, "temperature",
           "temperature must be a positive number less than or equal to 100.0")
    _check(_is_int(r["top_k"]) and 0 <= r["top_k"] <= 1000, "top_k",
           "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    _check(_is_number(r["top_p"]) and 0.0 <= r["top_p"] <= 1.0, "top_p",
           "top_p must be a positive float less than or equal to 1.0")
    _check(not (r["top_k"] > 0 and r["top_p"] > 0), "top_p", "cannot set both top-k and top-p samplings")
    _check(isinstance(r["add_BOS"], bool), "add_BOS", "add_BOS must be a boolean value")
    _check(r["add_BOS"] or all(prompts), "prompts", "empty prompts require add_BOS=true")
    _check(r["stop_token"] is None or (_is_int(r["stop_token"]) and 0 <= r["stop_token"] < vocab_size),
           "stop_token", f"stop_token must be an integer token id in [0, {vocab_size})")
    _check(r["random_seed"] is None or (_is_int(r["random_seed"]) and r["random_seed"] >= 0),
           "random_seed", "random_seed must be a non-negative integer")
    return r


COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
                     "echo", "n", "stream", "user", "stop_token")


def parse_completion(body) -> dict:
    """OpenAI completions fields, validated (BadRequest naming the field), with its defaults."""
    _check(isinstance(body, dict), "body", "the request body must be a JSON object")
    for key in body:
        _check(key in COMPLETION_FIELDS, key, f"unknown or unsupported field {key!r}")
    _check("prompt" in body, "prompt", "prompt is required")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    _check(isinstance(prompts, list) and 0 < len(prompts) <= MAX_PROMPTS
           and all(isinstance(p, str) and p for p in prompts), "prompt",
           f"prompt must be a non-empty string or a list of 1 to {MAX_PROMPTS} non-empty strings")
    r = dict(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=None, echo=False,
             n=1, stream=False, stop_token=None)
    r.update({k: body[k] for k in r if k in body})
    _check(_is_int(r["max_tokens"]) and r["max_tokens"] >= 0, "max_tokens", "max_tokens must be an integer >= 0")
    _check(_is_number(r["temperature"]) and 0 <= r["temperature"] <= 2, "temperature",
           "temperature must be a number in [0, 2]")
    _check(_is_number(r["top_p"]) and 0 < r["top_p"] <= 1, "top_p", "top_p must be a number in (0, 1]")
    _check(_is_int(r["top_k"]) and r["top_k"] >= 0, "top_k", "top_k must be an integer >= 0")
    _check(r["seed"] is None or (_is_int(r["seed"]) and r["seed"] >= 0), "seed", "seed must be an integer >= 0")
    _check(r["logprobs"] is None or (_is_int(r["logprobs"]) and 0 <= r["logprobs"] <= 1), "logprobs",
           "logprobs must be null, 0 or 1 (the chosen token's log-prob)")
    _check(isinstance(r["echo"], bool), "echo", "echo must be a boolean")
    _check(r["n"] == 1, "n", "only n=1 is supported")
    _check(r["stream"] is False, "stream", "streaming is not supported")
    _check(r["stop_token"] is None or _is_int(r["stop_token"]), "stop_token", "stop_token must be an integer")
    r["prompts"] = prompts
    return r


# ------------------------------------------------------------------------------ batching


class Batcher:
    """Jobs in, one decode per batch of waiting jobs out; a bounded number in flight."""

    def __init__(self, model, max_batch: int, max_queue: int, timeout: float):
        self.model, self.max_batch, self.max_queue, self.timeout = model, max_batch, max_queue, timeout
        self.queue: asyncio.Queue | None = None
        self.in_flight = 0
        self.batches = 0  # decodes run (a test checks concurrent requests share them)
        self._task = None
        self._held: Job | None = None

    def start(self):
        self.queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        if self._task is not None:
            self._task.cancel()

    async def submit(self, job: Job):
        """The job's list of `Generated`; raises Full (503) or asyncio.TimeoutError (504)."""
        if self.in_flight >= self.max_queue:
            raise Full()
        self.in_flight += 1
        job.future = asyncio.get_running_loop().create_future()
        try:
            await self.queue.put(job)
            return await asyncio.wait_for(asyncio.shield(job.future), self.timeout)
        except asyncio.TimeoutError:
            job.cancelled = True
            raise
        finally:
            self.in_flight -= 1

    async def _next_batch(self) -> list[Job]:
        """The waiting jobs, oldest first, up to max_batch rows (a job that does not fit waits
        for the next batch; one job larger than max_batch runs alone)."""
        jobs = [self._held if self._held is not None else await self.queue.get()]
        self._held = None
        rows = len(jobs[0].prompts)
        while not self.queue.empty():
            job = self.queue.get_nowait()
            if rows + len(job.prompts) > self.max_batch:
                self._held = job
                break
            jobs.append(job)
            rows += len(job.prompts)
        return [j for j in jobs if not j.cancelled]

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._next_batch()
            if not jobs:
                continue
            try:
                outs = await loop.run_in_executor(None, self._decode, jobs)
                self.batches += 1
                for job, out in zip(jobs, outs):
                    if not job.future.done():
                        job.future.set_result(out)
            except Exception as e:  # noqa: BLE001 - the requests get the error, the server lives
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(e)

    def _decode(self, jobs: list[Job]):
        """All jobs' rows in one decode; returns each job's list of `Generated`."""
        rows = [(j, i, p) for j in jobs for i, p in enumerate(j.prompts)]
        outs = self.model.decoder()(
            [p for _, _, p in rows], [j.new_tokens for j, _, _ in rows],
            [j.temperature for j, _, _ in rows], [j.top_k for j, _, _ in rows],
            [j.top_p for j, _, _ in rows], [(j.seed, i) for j, i, _ in rows],
            [j.stop_token for j, _, _ in rows], prompt_logprobs=any(j.logprobs for j in jobs))
        result, at = [], 0
        for j in jobs:
            result.append(outs[at: at + len(j.prompts)])
            at += len(j.prompts)
        return result


class Full(Exception):
    """The queue is full (503)."""


# ------------------------------------------------------------------------------ the app


def _encode(model, text: str, add_bos: bool, bos: int | None) -> list[int]:
    ids = list(model.tokenizer.tokenize(text)) if text else []
    return ([bos] if add_bos and bos is not None else []) + ids


def _check_lengths(model, prompts: list[list[int]], new: int, field: str) -> None:
    m = model.config
    limit = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
    for p in prompts:
        _check(len(p) > 0, "prompts", "a prompt has no tokens; set add_BOS=true")
        _check(limit is None or len(p) + new <= limit, field,
               f"a prompt of {len(p)} tokens + {new} new tokens exceeds the model's {limit} positions")


def _seed(value) -> int:
    return value if value is not None else int.from_bytes(os.urandom(4), "little") >> 1


async def _run_job(batcher: Batcher, job: Job):
    from starlette.responses import JSONResponse

    try:
        return await batcher.submit(job)
    except Full:
        return JSONResponse({"error": "the server is busy: queue full, retry later"}, status_code=503,
                            headers={"Retry-After": "1"})
    except asyncio.TimeoutError:
        return JSONResponse({"error": f"request timed out after {batcher.timeout} s"}, status_code=504)
    except Exception as e:  # noqa: BLE001 - one failed decode answers 500, the server stays up
        return JSONResponse({"error": f"generation failed: {type(e).__name__}: {e}"}, status_code=500)


async def _json_body(request):
    import json

    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise BadRequest("body", f"the request body is not valid JSON ({e})") from e


def api_response(model, prompts_ids, outs, logprobs: bool) -> dict:
    """Megatron's response: the prompt and new text together, per-token segments, log-probs."""
    tok = model.tokenizer
    full = [p + o.tokens for p, o in zip(prompts_ids, outs)]
    return {"text": [tok.detokenize(ids) for ids in full],
            "segments": [[tok.detokenize([t]) for t in ids] for ids in full],
            "logprobs": [o.prompt_logprobs + o.logprobs for o in outs] if logprobs else None}


class Handlers:
    """The routes' request handlers for one model and its batcher."""

    def __init__(self, model, batcher: Batcher):
        self.model, self.batcher = model, batcher
        # Megatron adds and stops on the tokenizer's end-of-document token.
        self.bos = self.default_stop = getattr(model.tokenizer, "eod", None)

    async def api(self, request):
        from starlette.responses import JSONResponse

        model = self.model
        try:
            r = parse_api(await _json_body(request), model.config.vocab_size)
            ids = [_encode(model, p, r["add_BOS"], self.bos) for p in r["prompts"]]
            _check_lengths(model, ids, r["tokens_to_generate"], "tokens_to_generate")
        except BadRequest as e:
            return JSONResponse({"error": str(e), "field": e.field}, status_code=400)
        stop = r["stop_token"] if r["stop_token"] is not None else self.default_stop
        job = Job(ids, r["tokens_to_generate"], r["temperature"], r["top_k"], r["top_p"],
                  _seed(r["random_seed"]), stop, r["logprobs"])
        outs = await _run_job(self.batcher, job)
        if not isinstance(outs, list):
            return outs
        return JSONResponse(api_response(model, ids, outs, r["logprobs"]))

    async def completions(self, request):
        from starlette.responses import JSONResponse

        model = self.model
        try:
            r = parse_completion(await _json_body(request))
            ids = [_encode(model, p, False, self.bos) for p in r["prompts"]]
            _check_lengths(model, ids, r["max_tokens"], "max_tokens")
        except BadRequest as e:
            return JSONResponse({"error": {"message": str(e), "field": e.field, "type": "invalid_request_error"}},
                                status_code=400)
        top_p = 0.0 if r["top_p"] >= 1.0 else r["top_p"]  # OpenAI's 1.0 is "off"
        job = Job(ids, r["max_tokens"], r["temperature"], r["top_k"], top_p, _seed(r["seed"]), r["stop_token"])
        outs = await _run_job(self.batcher, job)
        if not isinstance(outs, list):
            return outs
        return JSONResponse(completion_response(model, r, ids, outs))

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model.path, "in_flight": self.batcher.in_flight,
                             "batches": self.batcher.batches})

    async def page(self, request):
        from starlette.responses import FileResponse

        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")


def make_app(model, max_batch: int = 16, max_queue: int = 64, timeout: float = 60.0):
    """The Starlette app serving `model` (a LoadedModel with a tokenizer); `app.state.batcher`
    is its Batcher."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    if model.tokenizer is None:
        raise UsageError(f"--load {model.path} carries no tokenizer; give --tokenizer-type and its files")
    batcher = Batcher(model, max_batch, max_queue, timeout)
    h = Handlers(model, batcher)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = Starlette(routes=[Route("/api", h.api, methods=["PUT"]),
                            Route("/v1/completions", h.completions, methods=["POST"]),
                            Route("/health", h.health), Route("/", h.page)], lifespan=lifespan)
    app.state.batcher = batcher
    return app


def completion_response(model, r: dict, ids, outs) -> dict:
    tok = model.tokenizer
    choices = []
    for i, (p, o) in enumerate(zip(ids, outs)):
        text = tok.detokenize((p if r["echo"] else []) + o.tokens)
        lp = None
        if r["logprobs"] is not None:
            lp = {"tokens": [tok.detokenize([t]) for t in o.tokens], "token_logprobs": o.logprobs}
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": o.finish_reason})
    n_prompt, n_new = sum(map(len, ids)), sum(len(o.tokens) for o in outs)
    return {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": os.path.basename(os.path.normpath(model.path)), "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}}


@cli
def main(argv: Sequence[str] | None = None) -> int:
    from mlm_jax.generate import add_model_args, load_model

    p = argparse.ArgumentParser(prog="python -m mlm_jax.serve", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-batch-size", type=int, default=16, help="prompts decoded together at most")
    p.add_argument("--max-queue", type=int, default=64, help="requests in flight before 503")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before 504")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_batch_size", "max_queue"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0, got {args.request_timeout}")
    import uvicorn

    app = make_app(load_model(args), args.max_batch_size, args.max_queue, args.request_timeout)
    print(f"serving {args.load} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
