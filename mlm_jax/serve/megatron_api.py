"""Megatron-LM's `PUT /api`: its fields, rules and defaults (megatron/inference/
text_generation_server.py), its response, and its beam search.

Where we differ, on purpose: an invalid field is always a 400 (Megatron answers some with
200), and temperature 0 means greedy here as on every other path (Megatron refuses it).
Megatron's end-of-line stops use GPT-2's ids (198 "\\n", 628 "\\n\\n"); here they are the
tokenizer's own ids for "\\n" and "\\n\\n".
"""

from __future__ import annotations

from mlm_jax.serve.fields import MAX_PROMPTS, check, is_int, is_number

FIELDS = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "top_p_decay",
          "top_p_bound", "add_BOS", "stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon",
          "random_seed", "no_log", "beam_width", "stop_token", "length_penalty")
DEFAULTS = dict(tokens_to_generate=64, logprobs=False, temperature=1.0, top_k=0, top_p=0.0, top_p_decay=0.0,
                top_p_bound=0.0, add_BOS=False, stop_on_double_eol=False, stop_on_eol=False,
                prevent_newline_after_colon=False, random_seed=None, no_log=False, beam_width=None,
                stop_token=None, length_penalty=1.0)
BOOLS = ("logprobs", "add_BOS", "stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon", "no_log")


def parse(body) -> dict:
    """The request's settings with Megatron's defaults; BadRequest naming the first bad field
    (stop_token None: the tokenizer's end-of-document token)."""
    check(isinstance(body, dict), "body", "the request body must be a JSON object")
    check("max_len" not in body, "max_len", "max_len is no longer used; replace with tokens_to_generate")
    check("sentences" not in body, "sentences", "sentences is no longer used; replace with prompts")
    for key in body:
        check(key in FIELDS, key, f"unknown field {key!r}; fields: {', '.join(FIELDS)}")
    check("prompts" in body, "prompts", "prompts argument required")
    prompts = body["prompts"]
    check(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts), "prompts",
          "prompts is not a list of strings")
    check(len(prompts) > 0, "prompts", "prompts is empty")
    check(len(prompts) <= MAX_PROMPTS, "prompts", f"maximum number of prompts is {MAX_PROMPTS}")
    r = dict(DEFAULTS, prompts=prompts)
    r.update({k: body[k] for k in FIELDS if k in body and k != "prompts"})
    for key in BOOLS:
        check(isinstance(r[key], bool), key, f"{key} must be a boolean value")
    check(is_int(r["tokens_to_generate"]) and r["tokens_to_generate"] >= 0, "tokens_to_generate",
          "tokens_to_generate must be an integer greater than or equal to 0")
    check(r["tokens_to_generate"] > 0 or r["logprobs"], "tokens_to_generate",
          "tokens_to_generate=0 implies logprobs should be true")
    check(is_number(r["temperature"]) and 0.0 <= r["temperature"] <= 100.0, "temperature",
          "temperature must be a number in [0, 100] (0: greedy)")
    check(is_int(r["top_k"]) and 0 <= r["top_k"] <= 1000, "top_k",
          "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    check(is_number(r["top_p"]) and 0.0 <= r["top_p"] <= 1.0, "top_p",
          "top_p must be a positive float less than or equal to 1.0")
    check(not (r["top_k"] > 0 and r["top_p"] > 0), "top_p", "cannot set both top-k and top-p samplings")
    if "top_p_decay" in body:
        check(is_number(r["top_p_decay"]) and 0.0 <= r["top_p_decay"] <= 1.0, "top_p_decay",
              "top_p_decay must be a positive float less than or equal to 1.0")
        check(r["top_p"] > 0, "top_p_decay", "top_p_decay cannot be set without top_p")
    if "top_p_bound" in body:
        check(is_number(r["top_p_bound"]), "top_p_bound",
              "top_p_bound must be a positive float less than or equal to top_p")
        check(r["top_p"] > 0, "top_p_bound", "top_p_bound cannot be set without top_p")
        check(0.0 < r["top_p_bound"] <= r["top_p"], "top_p_bound",
              "top_p_bound must be greater than 0 and less than or equal to top_p")
    check(r["add_BOS"] or all(prompts), "prompts", "empty prompts require add_BOS=true")
    check(r["random_seed"] is None or (is_int(r["random_seed"]) and r["random_seed"] >= 0), "random_seed",
          "random_seed must be a non-negative integer")
    # Any integer, as Megatron: an id outside the vocabulary simply never matches.
    check(r["stop_token"] is None or is_int(r["stop_token"]), "stop_token", "stop_token must be an integer")
    check(is_number(r["length_penalty"]), "length_penalty", "length_penalty must be a float")
    if r["beam_width"] is not None:
        check(is_int(r["beam_width"]) and r["beam_width"] >= 1, "beam_width", "beam_width must be an integer >= 1")
        check(len(prompts) == 1, "beam_width", "when doing beam_search, batch size must be 1")
        check(r["tokens_to_generate"] > 0, "tokens_to_generate", "beam search needs tokens_to_generate > 0")
    return r


def response(tok, prompts_ids, rows, logprobs: bool) -> dict:
    """Megatron's response: prompt and new text together, per-token segments, the token ids,
    and (logprobs) every token's log-prob after the first."""
    full = [p + r.tokens for p, r in zip(prompts_ids, rows)]
    return {"text": [tok.detokenize(ids) for ids in full],
            "segments": [[tok.detokenize([t]) for t in ids] for ids in full],
            "tokens": full,
            "logprobs": [r.prompt_logprobs + r.logprobs for r in rows] if logprobs else None}


def beam_response(tok, beams) -> dict:
    """Megatron's beam-search response: the whole beam, best first, with its scores."""
    return {"text": [tok.detokenize(b.tokens) for b in beams],
            "segments": [[tok.detokenize([t]) for t in b.tokens] for b in beams],
            "scores": [float(b.score) for b in beams]}


def eol_rule(nl: int | None, nn: int | None, double: bool, last_prompt_token: int):
    """Megatron's stop_on_eol / stop_on_double_eol on token ids (`nl` "\\n", `nn` "\\n\\n"):
    eol stops on either; double eol on "\\n\\n" or two "\\n" in a row."""

    def rule(tokens: list[int]):
        t = tokens[-1]
        if nn is not None and t == nn:
            return len(tokens)
        before = tokens[-2] if len(tokens) > 1 else last_prompt_token
        if nl is not None and t == nl and (not double or before == nl):
            return len(tokens)
        return None

    return rule
