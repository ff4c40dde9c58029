"""The Starlette app: routes, request limits, tokenisation off the event loop, and a log line
per request. The decoding itself is `mlm_jax.serve.engine.Engine` on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid

from mlm_jax.errors import UsageError
from mlm_jax.serve import completions as oai
from mlm_jax.serve import megatron_api
from mlm_jax.serve.engine import Engine, Request, Row
from mlm_jax.serve.fields import BadRequest, check, parse_json

STATIC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "static")
MAX_BODY = 8 << 20  # bytes


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _seed(value) -> int:
    return value if value is not None else int.from_bytes(os.urandom(4), "little") >> 1


def _row_key(seed: int, index: int):
    from mlm_jax.generate import _row_key as key

    return key(seed % (1 << 31), index)


@dataclasses.dataclass
class Outcome:
    status: int = 200
    prompt_tokens: int = 0
    new_tokens: int = 0
    wait: float | None = None
    quiet: bool = False  # Megatron's no_log


class Service:
    """One model served: its engine, limits, tokenizer helpers and the handlers."""

    def __init__(self, model, engine: Engine, name: str, max_queue: int, timeout: float, max_body: int,
                 log=_log):
        self.model, self.engine, self.name = model, engine, name
        self.max_queue, self.timeout, self.max_body, self.log = max_queue, timeout, max_body, log
        self.tok = model.tokenizer
        self.text = oai.Text(self.tok)
        self.in_flight = 0
        self.vocab = model.config.vocab_size
        self.eod = getattr(self.tok, "eod", None)
        self._beam_lock = threading.Lock()
        self._other_names: set = set()  # model names asked for besides self.name (logged once each)
        self._beam_programs: dict = {}
        self.chars_per_token = self._longest_token()
        self.nl, self.nn, self.colon = (self._single(s) for s in ("\n", "\n\n", ":"))

    def _longest_token(self) -> int | None:
        """The most characters one token decodes to: a prompt longer than context x this is
        refused before it is tokenised (None: unknown, no such bound)."""
        try:
            return max(len(self.tok.detokenize([i])) for i in range(self.vocab)) or 1
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode single ids: no bound
            return None

    def _single(self, s: str) -> int | None:
        try:
            ids = list(self.tok.tokenize(s))
        except Exception:  # noqa: BLE001
            return None
        return ids[0] if len(ids) == 1 else None

    # ---------------------------------------------------------------- request plumbing

    async def body(self, request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise BadRequest("body", f"the request body is {int(size)} bytes; the limit is {self.max_body}", 413)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body:
                raise BadRequest("body", f"the request body exceeds the limit of {self.max_body} bytes", 413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if len(raw) > 1 << 16:
            return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)
        return parse_json(raw)

    async def encode(self, prompts: list, add_bos: bool, field: str, new: int) -> list[list[int]]:
        """Token ids of each prompt (strings tokenised in a worker thread, after the bound on
        characters), each checked to fit the context with `new` tokens."""
        limit = self.engine.context
        for p in prompts:
            if isinstance(p, str) and self.chars_per_token and len(p) > limit * self.chars_per_token:
                raise BadRequest(field, f"a prompt of {len(p)} characters is longer than the {limit}-token "
                                        f"context can hold")
        if any(isinstance(p, str) for p in prompts) and self.tok is None:
            raise BadRequest(field, "this checkpoint carries no tokenizer: give prompts as token ids")

        def run():
            bos = [self.eod] if add_bos and self.eod is not None else []
            return [bos + (list(self.tok.tokenize(p)) if p else []) if isinstance(p, str) else list(p)
                    for p in prompts]

        ids = await asyncio.get_running_loop().run_in_executor(None, run)
        # What makes an empty prompt usable on this endpoint: Megatron's API has add_BOS; the
        # OpenAI endpoints have no such field (a prompt there needs a token of its own).
        empty = ("a prompt has no tokens; set add_BOS=true" if field == "prompts" else
                 "a prompt has no tokens; give at least one token (text, or token ids)")
        for p in ids:
            check(len(p) > 0, field, empty)
            check(len(p) + new <= limit, {"prompts": "tokens_to_generate"}.get(field, "max_tokens"),
                  f"a prompt of {len(p)} tokens + {new} new tokens exceeds the {limit}-position context")
        return ids

    async def run_rows(self, rows: list[Row], outcome: Outcome) -> list[Row]:
        """Decode rows (BadRequest-shaped errors for busy, timeout and failure)."""
        if self.in_flight >= self.max_queue:
            raise BadRequest("queue", "the server is busy: queue full, retry later", 503)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        req = Request(rows, loop, lambda rs: future.done() or future.set_result(rs))
        self.in_flight += 1
        try:
            self.engine.submit(req)
            rows = await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except asyncio.TimeoutError:
            req.cancel()
            raise BadRequest("timeout", f"request timed out after {self.timeout} s", 504) from None
        finally:
            self.in_flight -= 1
        outcome.prompt_tokens += sum(len(r.prompt) for r in rows)
        outcome.new_tokens += sum(len(r.tokens) for r in rows)
        started = [r.started_at - r.queued_at for r in rows if r.started_at is not None]
        outcome.wait = max(started) if started else None
        failed = [r for r in rows if r.finish_reason == "error"]
        if failed:
            e = failed[0].error
            raise BadRequest("generation", f"generation failed: {type(e).__name__}: {e}", 500)
        return rows

    def row(self, prompt, new, temperature, top_k, top_p, seed, index, **kw) -> Row:
        return Row(prompt, new, float(temperature), int(top_k), float(top_p),
                   key=_row_key(seed, index) if temperature > 0 else None, **kw)

    # ---------------------------------------------------------------- Megatron's PUT /api

    async def api(self, request, outcome: Outcome):
        from starlette.responses import JSONResponse

        r = megatron_api.parse(await self.body(request))
        outcome.quiet = r["no_log"]
        ids = await self.encode(r["prompts"], r["add_BOS"], "prompts", r["tokens_to_generate"])
        if r["beam_width"] is not None:
            return JSONResponse(await self.beam(ids[0], r, outcome))
        stop = r["stop_token"] if r["stop_token"] is not None else self.eod
        seed = _seed(r["random_seed"])
        rows = []
        for i, p in enumerate(ids):
            kw = dict(stop_ids=() if stop is None else (stop,), prompt_scores=r["logprobs"],
                      top_p_decay=r["top_p_decay"], top_p_bound=r["top_p_bound"])
            if r["stop_on_eol"] or r["stop_on_double_eol"]:
                kw.update(stop_ids=(), stop_text=megatron_api.eol_rule(self.nl, self.nn, r["stop_on_double_eol"], p[-1]))
            if r["prevent_newline_after_colon"] and self.colon is not None and self.nl is not None:
                kw["ban"] = (self.colon, self.nl)
            rows.append(self.row(p, r["tokens_to_generate"], r["temperature"], r["top_k"], r["top_p"], seed, i, **kw))
        rows = await self.run_rows(rows, outcome)
        return JSONResponse(megatron_api.response(self.tok, ids, rows, r["logprobs"]))

    async def beam(self, prompt: list[int], r: dict, outcome: Outcome) -> dict:
        from mlm_jax.beam import beam_search

        stop = r["stop_token"] if r["stop_token"] is not None else self.eod
        stop = stop if stop is not None and 0 <= stop < self.vocab else None  # outside the vocab: never met
        colon = (self.colon, self.nl) if r["prevent_newline_after_colon"] and None not in (self.colon, self.nl) else None
        e = self.engine

        def run():
            with self._beam_lock:
                return beam_search(e.graphdef, e.params, self.vocab, prompt, r["tokens_to_generate"],
                                   r["beam_width"], stop, float(r["length_penalty"]), colon, e.context,
                                   e.mesh, e.rules, self._beam_programs)

        try:
            beams = await asyncio.get_running_loop().run_in_executor(None, run)
        except UsageError as e:
            raise BadRequest("beam_width", str(e)) from None
        outcome.prompt_tokens, outcome.new_tokens = len(prompt), sum(len(b.tokens) - len(prompt) for b in beams)
        return megatron_api.beam_response(self.tok, beams)

    # ---------------------------------------------------------------- OpenAI

    def check_model(self, name):
        """A request's `model`: this server serves one, so any name is answered by it (as
        llama.cpp's and Megatron's servers do), with a note in the log the first time a name
        other than the served id is asked for."""
        if name is None or name == self.name or name in self._other_names:
            return
        if not isinstance(name, str):
            raise BadRequest("model", f"model must be a string (this server serves {self.name!r})")
        self._other_names.add(name)
        self.log(f"note: a request names the model {name!r}; this server serves one model, {self.name!r}, "
                 "and answers with it")

    def completion_rows(self, ids, r, new, prompt_scores) -> list[Row]:
        seed = _seed(r["seed"])
        stop = r["stop_token"] if r["stop_token"] is not None else self.eod
        top_p = 0.0 if r["top_p"] >= 1.0 else r["top_p"]  # OpenAI's 1.0 is "off"
        rows = []
        for i, p in enumerate(ids):
            for j in range(r["best_of"]):
                rows.append(self.row(p, new, r["temperature"], r["top_k"], top_p, seed, i * r["best_of"] + j,
                                     stop_ids=() if stop is None else (stop,), prompt_scores=prompt_scores,
                                     stop_text=oai.stop_rule(self.text, p, r["stop"]) if r["stop"] else None))
        return rows

    async def completions(self, request, outcome: Outcome):
        from starlette.responses import JSONResponse

        r = oai.parse(await self.body(request), self.vocab)
        self.check_model(r["model"])
        ids = await self.encode(r["prompts"], False, "prompt", r["max_tokens"])
        rows = self.completion_rows(ids, r, r["max_tokens"], r["echo"] and r["logprobs"] is not None)
        if r["stream"]:
            return self.stream(ids, rows, r, outcome)
        rows = await self.run_rows(rows, outcome)
        choices = []
        for i, p in enumerate(ids):
            for row in oai.best(rows[i * r["best_of"]: (i + 1) * r["best_of"]], r["n"]):
                text, entries, reason = oai.choice(self.text, p, row, r)
                choices.append({"index": len(choices), "text": text,
                                "logprobs": oai.logprobs_body(entries) if r["logprobs"] is not None else None,
                                "finish_reason": reason})
        return JSONResponse({"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion",
                             "created": int(time.time()), "model": self.name, "choices": choices,
                             "usage": self.usage(ids, rows)})

    def usage(self, ids, rows) -> dict:
        n_prompt, n_new = sum(map(len, ids)), sum(len(row.tokens) for row in rows)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    def stream(self, ids, rows, r, outcome: Outcome):
        """Server-sent events: one chunk per choice whenever its settled text grows."""
        from starlette.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        prompt_of = {}
        for i, row in enumerate(rows):
            prompt_of[i] = ids[i // r["best_of"]]

            def on_token(row, i=i):
                snap = dataclasses.replace(row, tokens=list(row.tokens), logprobs=list(row.logprobs), top=list(row.top))
                loop.call_soon_threadsafe(events.put_nowait, (i, snap))

            row.on_token = on_token
        req = Request(rows, loop, lambda rs: None)
        if self.in_flight >= self.max_queue:
            raise BadRequest("queue", "the server is busy: queue full, retry later", 503)
        cid, created = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())
        started = time.perf_counter()

        def chunk(choices, usage=None):
            body = {"id": cid, "object": "text_completion", "created": created, "model": self.name,
                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def gen():
            self.in_flight += 1
            sent = [(0, 0)] * len(rows)  # characters and logprob entries sent per choice
            left = len(rows)
            try:
                self.engine.submit(req)
                while left:
                    i, snap = await events.get()
                    text, entries, reason = oai.choice(self.text, prompt_of[i], snap, r, final=snap.done)
                    chars, n = sent[i]
                    if len(text) > chars or len(entries) > n or snap.done:
                        lp = oai.logprobs_body(entries[n:]) if r["logprobs"] is not None else None
                        sent[i] = (len(text), len(entries))
                        yield chunk([{"index": i, "text": text[chars:], "logprobs": lp,
                                      "finish_reason": reason if snap.done else None}])
                    if snap.done:
                        left -= 1
                        if snap.finish_reason == "error":
                            yield f"data: {json.dumps({'error': {'message': f'generation failed: {snap.error}'}})}\n\n"
                if (r["stream_options"] or {}).get("include_usage"):
                    yield chunk([], self.usage(ids, rows))
                yield "data: [DONE]\n\n"
            finally:
                req.cancel()
                self.in_flight -= 1
                outcome.prompt_tokens = sum(map(len, ids))
                outcome.new_tokens = sum(len(row.tokens) for row in rows)
                self.log_request("POST", "/v1/completions (stream)", outcome, time.perf_counter() - started)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def chat(self, request, outcome: Outcome):
        from starlette.responses import JSONResponse

        r = oai.parse_chat(await self.body(request), self.vocab)
        self.check_model(r["model"])
        template = getattr(self.tok, "chat_template", None)
        if not template:
            raise BadRequest("messages", f"{self.name}'s tokenizer carries no chat template: chat completions "
                                         f"need one; use /v1/completions with a plain prompt")
        piece = self.text.piece
        prompt = oai.render_chat(template, r["messages"], getattr(self.tok, "bos_text", "") or "",
                                 piece(self.eod) if self.eod is not None else "")
        ids = await self.encode([prompt], False, "messages", 0)
        new = r["new"] if r["new"] is not None else self.engine.context - len(ids[0])
        check(len(ids[0]) + new <= self.engine.context, "max_tokens",
              f"the conversation's {len(ids[0])} tokens + {new} new tokens exceed the {self.engine.context}-position context")
        r.update(best_of=r["n"], echo=False, logprobs=None)
        rows = await self.run_rows(self.completion_rows(ids, r, new, False), outcome)
        choices = []
        for i, row in enumerate(rows):
            text, _, reason = oai.choice(self.text, ids[0], row, r)
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": reason})
        return JSONResponse({"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion",
                             "created": int(time.time()), "model": self.name, "choices": choices,
                             "usage": self.usage(ids, rows)})

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "mlm_jax"}

    # ---------------------------------------------------------------- logging

    def log_request(self, method: str, path: str, o: Outcome, seconds: float):
        if o.quiet:
            return
        wait = f"{o.wait:.3f}s" if o.wait is not None else "-"
        self.log(f"{method} {path} {o.status} prompt={o.prompt_tokens} new={o.new_tokens} "
                 f"wait={wait} time={seconds:.3f}s")


def _error_body(path: str, e: BadRequest) -> dict:
    """OpenAI's error shape on /v1; Megatron's (`message`, which its CLI prints) elsewhere."""
    if path.startswith("/v1"):
        kind = {404: "not_found_error", 413: "invalid_request_error", 503: "server_busy", 504: "timeout",
                500: "server_error"}.get(e.status, "invalid_request_error")
        return {"error": {"message": str(e), "type": kind, "param": e.field, "code": e.status}}
    return {"message": str(e), "error": str(e), "field": e.field}


def make_app(model, max_batch: int = 16, max_queue: int = 64, timeout: float = 60.0, context: int | None = None,
             name: str | None = None, max_body: int = MAX_BODY, continuous: bool = True, log=_log):
    """The Starlette app serving `model` (a LoadedModel with a tokenizer); `app.state.service`
    holds its Service and `app.state.engine` its Engine (started with the app)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Route

    from mlm_jax.config import Config
    from mlm_jax.models.build import abstract_model
    from mlm_jax.sharding.rules import activation_rules

    if model.tokenizer is None:
        raise UsageError(f"--load {model.path} carries no tokenizer; give --tokenizer-type and its files")
    m = model.config
    context = context or m.max_position_embeddings
    if m.position_embedding_type == "learned_absolute" and context > m.max_position_embeddings:
        raise UsageError(f"--max-context {context} exceeds the model's {m.max_position_embeddings} positions")
    graphdef, _, _ = abstract_model(Config(model=m))
    engine = Engine(graphdef, model.params, m.vocab_size, max_batch, context, model.mesh, activation_rules(False),
                    continuous, log)
    name = name or os.path.normpath(model.path)
    svc = Service(model, engine, name, max_queue, timeout, max_body, log)

    def route(method: str, path: str, handler):
        async def endpoint(request):
            o, t = Outcome(), time.perf_counter()
            try:
                response = await handler(request, o)
            except BadRequest as e:
                o.status = e.status
                headers = {"Retry-After": "1"} if e.status == 503 else None
                response = JSONResponse(_error_body(path, e), status_code=e.status, headers=headers)
            except ClientDisconnect:  # gone mid-body: nobody to answer, one log line
                svc.log(f"{method} {path}: the client disconnected before its request body ended "
                        f"({time.perf_counter() - t:.3f}s); nothing answered")
                return Response(status_code=499)
            if getattr(response, "media_type", "") != "text/event-stream":
                o.status = response.status_code
                svc.log_request(method, path, o, time.perf_counter() - t)
            return response

        return Route(path, endpoint, methods=[method])

    async def models(request, o):
        return JSONResponse({"object": "list", "data": [svc.model_card()]})

    async def model_one(request, o):  # the listing is exact: another id is not found here
        name = request.path_params["name"]
        if name != svc.name:
            raise BadRequest("model", f"the model {name!r} does not exist; this server serves {svc.name!r}", 404)
        return JSONResponse(svc.model_card())

    async def health(request, o):
        o.quiet = True
        return JSONResponse({"status": "ok", "model": svc.name, "in_flight": svc.in_flight,
                             "steps": engine.steps, "slots": engine.slots, "context": engine.context})

    async def page(request, o):
        o.quiet = True
        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html")

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else "method not allowed"
        e = BadRequest("path", f"{what}: {request.method} {request.url.path}", status)
        return JSONResponse(_error_body(request.url.path, e), status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.get_running_loop().run_in_executor(None, engine.start)
        yield
        engine.stop()

    routes = [route("PUT", "/api", svc.api), route("POST", "/v1/completions", svc.completions),
              route("POST", "/v1/chat/completions", svc.chat), route("GET", "/v1/models", models),
              route("GET", "/v1/models/{name:path}", model_one), route("GET", "/health", health),
              route("GET", "/", page)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.service, app.state.engine = svc, engine
    return app
