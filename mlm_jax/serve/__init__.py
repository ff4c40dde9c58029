"""A text-generation server on uvicorn (Starlette) that real clients can use.

    python -m mlm_jax.serve --load CKPT --port 5000 [--host 127.0.0.1]

Routes: Megatron-LM's `PUT /api` (its fields, beam search included: `megatron_api.py`),
OpenAI's `POST /v1/completions`, `POST /v1/chat/completions` (when the tokenizer carries a
chat template), `GET /v1/models[/{id}]` (`completions.py`), `GET /health` and a page at `/`.
Clients: the `openai` package, EleutherAI lm-eval-harness's `local-completions`, Megatron's
`tools/text_generation_cli.py` (and `python -m mlm_jax.tools.text_generation_cli`).

Decoding is continuous batching (`engine.py`): a request that arrives while others decode
joins them at the next step. Limits: request bodies over --max-body-mb are 413, JSON nested
deeper than 32 levels 400, a prompt longer than the context is refused before it is
tokenised (tokenising runs off the event loop), a full queue is 503 with Retry-After, a
request waiting longer than --request-timeout 504. Every error body names the field. One log
line per request (method, path, status, tokens, queue wait, time), one per new compiled shape.
"""

from mlm_jax.serve.app import make_app  # noqa: F401
from mlm_jax.serve.command import main  # noqa: F401
