"""OpenAI's `POST /v1/completions` (and `/v1/chat/completions` when the tokenizer carries a chat
template), as far as a base model can honour the spec.

Prompts: a string, a list of strings, a list of token ids, or a list of token-id lists.
`echo` returns the prompt too, with its log-probs (the first token's is null); `logprobs` N
(0-5) gives `tokens`, `token_logprobs`, `top_logprobs` (the N most likely tokens per position,
a dict of token text to log-prob) and `text_offset` (each token's start in prompt + completion,
OpenAI's convention); `stop` (up to 4 strings) ends the text before the first of them; `n`
completions per prompt, the best `n` of `best_of` by total log-prob; `stream` sends
server-sent events ending with `data: [DONE]`. The end-of-document token ends a completion
("stop") and is not part of its text. Penalties and `logit_bias` other than their neutral
values, and `suffix`, are refused naming the field.
"""

from __future__ import annotations

from mlm_jax.data.vocab_check import prompt_outside_vocab
from mlm_jax.serve.engine import TOP_N
from mlm_jax.serve.fields import MAX_PROMPTS, BadRequest, check, is_int, is_number

FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stream",
          "stream_options", "logprobs", "echo", "stop", "seed", "user", "presence_penalty",
          "frequency_penalty", "logit_bias", "suffix", "stop_token")
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
               "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias", "stream",
               "logprobs", "top_logprobs", "stop_token")
MAX_STOPS = 4
MAX_BEST_OF = 20
MAX_ROWS = 512  # prompts x best_of


def _prompts(prompt, vocab: int) -> list:
    """A list of prompts, each a string or a list of ids."""
    if isinstance(prompt, str):
        return [prompt]
    check(isinstance(prompt, list) and prompt, "prompt",
          "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")
    if all(is_int(t) for t in prompt):
        prompt = [prompt]
    check(len(prompt) <= MAX_PROMPTS, "prompt", f"at most {MAX_PROMPTS} prompts per request")
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            check(len(p) > 0, "prompt", "a prompt is an empty string")
            continue
        check(isinstance(p, list) and p and all(is_int(t) for t in p), "prompt",
              "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")
        problem = prompt_outside_vocab(p, vocab)
        check(problem is None, "prompt", f"prompt {i}: {problem}")
    return prompt


def _common(body: dict, r: dict) -> None:
    """The sampling fields both endpoints share."""
    check(is_number(r["temperature"]) and 0 <= r["temperature"] <= 2, "temperature",
          "temperature must be a number in [0, 2] (0: greedy)")
    check(is_number(r["top_p"]) and 0 < r["top_p"] <= 1, "top_p", "top_p must be a number in (0, 1]")
    check(is_int(r["top_k"]) and r["top_k"] >= 0, "top_k", "top_k must be an integer >= 0 (0: off)")
    check(r["seed"] is None or is_int(r["seed"]), "seed", "seed must be an integer or null")
    check(is_int(r["n"]) and 1 <= r["n"] <= MAX_BEST_OF, "n", f"n must be an integer in [1, {MAX_BEST_OF}]")
    for key in ("presence_penalty", "frequency_penalty"):
        check(body.get(key) in (None, 0, 0.0), key, f"{key} is not supported (only 0)")
    check(body.get("logit_bias") in (None, {}), "logit_bias", "logit_bias is not supported")
    stop = r["stop"]
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    check(isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop),
          "stop", f"stop must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings")
    r["stop"] = stop
    check(r["stop_token"] is None or is_int(r["stop_token"]), "stop_token", "stop_token must be an integer")
    check(isinstance(r["stream"], bool), "stream", "stream must be a boolean")


def parse(body, vocab: int) -> dict:
    """The completion request's settings with OpenAI's defaults; BadRequest naming the field."""
    check(isinstance(body, dict), "body", "the request body must be a JSON object")
    for key in body:
        check(key in FIELDS, key, f"unknown or unsupported field {key!r}")
    check(body.get("suffix") in (None, ""), "suffix", "suffix is not supported (a base model completes a prefix)")
    check("prompt" in body, "prompt", "prompt is required")
    r = dict(model=None, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, logprobs=None,
             echo=False, n=1, best_of=None, stream=False, stream_options=None, stop=None, stop_token=None)
    r.update({k: body[k] for k in r if body.get(k) is not None})  # null: the default
    r["prompts"] = _prompts(body["prompt"], vocab)
    check(is_int(r["max_tokens"]) and r["max_tokens"] >= 0, "max_tokens", "max_tokens must be an integer >= 0")
    _common(body, r)
    check(r["logprobs"] is None or (is_int(r["logprobs"]) and 0 <= r["logprobs"] <= TOP_N), "logprobs",
          f"logprobs must be null or an integer in [0, {TOP_N}]")
    check(isinstance(r["echo"], bool), "echo", "echo must be a boolean")
    check(r["max_tokens"] > 0 or r["echo"], "max_tokens", "max_tokens 0 needs echo=true (it scores the prompt)")
    best_of = r["n"] if r["best_of"] is None else r["best_of"]
    check(is_int(best_of) and r["n"] <= best_of <= MAX_BEST_OF, "best_of",
          f"best_of must be an integer in [n, {MAX_BEST_OF}]")
    check(not (r["stream"] and best_of > r["n"]), "best_of", "best_of cannot be used with stream")
    check(len(r["prompts"]) * best_of <= MAX_ROWS, "best_of",
          f"prompts x best_of must be at most {MAX_ROWS}, got {len(r['prompts']) * best_of}")
    opts = r["stream_options"]
    check(opts is None or (isinstance(opts, dict) and set(opts) <= {"include_usage"}), "stream_options",
          "stream_options may only hold include_usage")
    r["best_of"] = best_of
    return r


def parse_chat(body, vocab: int) -> dict:
    """The chat request's settings; BadRequest naming the field."""
    check(isinstance(body, dict), "body", "the request body must be a JSON object")
    for key in body:
        check(key in CHAT_FIELDS, key, f"unknown or unsupported field {key!r}")
    msgs = body.get("messages")
    check(isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs),
        "messages", "messages must be a non-empty list of {\"role\": ..., \"content\": \"text\"}")
    r = dict(model=None, max_tokens=None, max_completion_tokens=None, temperature=1.0, top_p=1.0, top_k=0, n=1,
             stop=None, seed=None, stream=False, stop_token=None, logprobs=False)
    r.update({k: body[k] for k in r if body.get(k) is not None})
    _common(body, r)
    check(r["stream"] is False, "stream", "streaming chat completions is not supported; use /v1/completions")
    check(r["logprobs"] is False and body.get("top_logprobs") is None, "logprobs",
          "logprobs on chat completions is not supported; use /v1/completions")
    new = r["max_completion_tokens"] if r["max_completion_tokens"] is not None else r["max_tokens"]
    check(new is None or (is_int(new) and new >= 1), "max_tokens", "max_tokens must be an integer >= 1")
    r["new"], r["messages"] = new, msgs
    return r


def render_chat(template: str, messages: list, bos: str, eos: str) -> str:
    """The conversation as the model's prompt text, through its Jinja chat template."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise BadRequest("messages", "chat templates need jinja2 (pip install jinja2)", 500) from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise BadRequest("messages", f"the chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=bos, eos_token=eos)
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem or the checkpoint's
        raise BadRequest("messages", f"the chat template failed: {type(e).__name__}: {e}") from None


# ------------------------------------------------------------------------------ responses


class Text:
    """Token ids to text for one tokenizer: offsets, one token's text (cached)."""

    def __init__(self, tok):
        self.tok, self._piece = tok, {}

    def piece(self, t: int) -> str:
        if t not in self._piece:
            self._piece[t] = self.tok.detokenize([t])
        return self._piece[t]

    def offsets(self, ids: list[int]) -> tuple[str, list[int]]:
        """(the text of ids, each token's start in it)."""
        text = self.tok.detokenize(ids)
        pieces = [self.piece(t) for t in ids]
        if "".join(pieces) == text:
            starts, at = [], 0
            for p in pieces:
                starts.append(at)
                at += len(p)
            return text, starts
        # Tokens that only decode together (bytes of one character, spacing rules): each start
        # is the length of the text before it, clipped to stay in order.
        starts, at = [], 0
        for i in range(len(ids)):
            at = max(at, min(len(self.tok.detokenize(ids[:i])), len(text)))
            starts.append(at)
        return text, starts

    def generated(self, prompt: list[int], new: list[int]) -> tuple[str, str, list[int]]:
        """(prompt text, new text, start of every token of prompt + new in prompt + new text)."""
        text, starts = self.offsets(prompt + new)
        cut = starts[len(prompt)] if new else len(text)
        return text[:cut], text[cut:], starts


def stop_rule(text: Text, prompt: list[int], stops: list[str]):
    """Row.stop_text for OpenAI's `stop`: where the new text ends (before the first stop
    string), or None while none occurs."""

    def rule(tokens: list[int]):
        _, new, _ = text.generated(prompt, tokens)
        found = [i for i in (new.find(s) for s in stops) if i >= 0]
        return min(found) if found else None

    return rule


def _held_back(new: str, stops: list[str]) -> int:
    """How many trailing characters a stream must hold: a partial character, or the start of
    a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(new)), 0, -1):
            if new.endswith(s[:k]):
                hold = max(hold, k)
                break
    if new.endswith("\ufffd"):
        hold = max(hold, len(new) - len(new.rstrip("\ufffd")))
    return hold


def choice(text: Text, prompt: list[int], row, r: dict, final: bool = True):
    """(text, logprob entries, finish reason) of one row. Entries: (token text, log-prob or
    None, top dict or None, offset) per token returned. Not `final` (a stream in progress):
    only what can no longer change."""
    new_ids = list(row.tokens)
    if new_ids and new_ids[-1] in row.stop_ids:
        new_ids = new_ids[:-1]  # the end-of-document token is not text
    prompt_text, new, starts = text.generated(prompt, new_ids)
    if row.cut is not None:
        new = new[: row.cut]
    elif not final:
        new = new[: len(new) - _held_back(new, r["stop"])]
    end = len(prompt_text) + len(new)
    n_new = sum(1 for i in range(len(new_ids)) if _token_end(starts, len(prompt) + i, prompt_text + new) <= end)
    entries = []
    if r.get("logprobs") is not None:
        lp = [None] + (row.prompt_logprobs or [None] * (len(prompt) - 1)) if r["echo"] else []
        top = [None] + (row.prompt_top or [None] * (len(prompt) - 1)) if r["echo"] else []
        ids = (prompt if r["echo"] else []) + new_ids[:n_new]
        lp += row.logprobs[:n_new]
        top += row.top[:n_new]
        first = 0 if r["echo"] else len(prompt)
        for i, t in enumerate(ids):
            alts = None
            if top[i] is not None and r["logprobs"] > 0:
                alts = {}
                for a, v in top[i][: r["logprobs"]]:
                    alts.setdefault(text.piece(a), v)
            entries.append((text.piece(t), lp[i], alts, starts[first + i]))
    out = (prompt_text if r["echo"] else "") + new
    return out, entries, (row.finish_reason if row.finish_reason in ("stop", "length") else None)


def _token_end(starts, i, text) -> int:
    return starts[i + 1] if i + 1 < len(starts) else len(text)


def logprobs_body(entries) -> dict:
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


def best(rows: list, n: int) -> list:
    """The n rows of highest total log-prob (best_of), in that order."""
    if len(rows) == n:
        return rows
    return sorted(rows, key=lambda row: -sum(row.logprobs))[:n]
