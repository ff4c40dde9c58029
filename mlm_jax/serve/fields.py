"""Request-field checks shared by the endpoints: each failure is a BadRequest naming the field."""

from __future__ import annotations

MAX_PROMPTS = 128  # Megatron's limit per request
MAX_DEPTH = 32  # JSON nesting a request may have


class BadRequest(ValueError):
    """A request field that cannot run: answered 400 (or `status`) naming the field."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise BadRequest(field, message)


def depth(value, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of a parsed JSON value, counting no further than limit + 1."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(raw: bytes):
    """The request body as JSON: BadRequest on invalid JSON or nesting deeper than MAX_DEPTH."""
    import json

    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("body", f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:
        raise BadRequest("body", f"the request body is not valid JSON ({e})") from None
    if depth(body) > MAX_DEPTH:
        raise BadRequest("body", f"the request body is nested more than {MAX_DEPTH} levels deep")
    return body
