"""Megatron's text-generation client: prompt for text and a token count, PUT them to a running
`python -m mlm_jax.serve`, print the reply; until end of input (Ctrl-D).

    python -m mlm_jax.tools.text_generation_cli 127.0.0.1:5000
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Sequence

from mlm_jax.arguments import ArgumentParser
from mlm_jax.cli import cli
from mlm_jax.errors import RunFailure, UsageError


def put(url: str, body: dict, timeout: float = 300.0) -> dict:
    """PUT `body` as JSON to `url`; the JSON reply, or {"error": ...} for an HTTP error
    (RunFailure when the server cannot be reached)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read()).get("error")
        except ValueError:
            detail = e.reason
        return {"error": f"HTTP {e.code}: {detail}"}
    except (urllib.error.URLError, OSError) as e:
        raise RunFailure(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from e


@cli
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m mlm_jax.tools.text_generation_cli", description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="HOST:PORT of the server")
    args = p.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"address {args.address!r} must be HOST:PORT, e.g. 127.0.0.1:5000")
    url = f"http://{args.address}/api"
    while True:
        try:
            sentence = input("Enter prompt: ")
            count = input("Enter number of tokens to generate: ")
        except EOFError:
            print()
            return 0
        try:
            tokens = int(count)
        except ValueError:
            print(f"error: number of tokens {count!r} is not an integer", file=sys.stderr)
            continue
        reply = put(url, {"prompts": [sentence], "tokens_to_generate": tokens})
        if "error" in reply:
            print(f"error: {reply['error']}", file=sys.stderr)
            continue
        print("Megatron Response: ")
        print(reply["text"][0], flush=True)


if __name__ == "__main__":
    sys.exit(main())
