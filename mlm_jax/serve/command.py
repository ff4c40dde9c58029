"""`python -m mlm_jax.serve`: flags, the port bound before the model loads, SIGINT drains."""

from __future__ import annotations

import errno
import math
import signal
import socket
from typing import Sequence

from mlm_jax.arguments import ArgumentParser
from mlm_jax.cli import cli
from mlm_jax.errors import EXIT_INTERRUPTED, UsageError


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a port in use is one error line, not a crash
    after the model has loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: {host}:{port} is already in use; pick another --port "
                             f"(0 picks a free one)") from None
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(2048)
    return sock


@cli
def main(argv: Sequence[str] | None = None) -> int:
    from mlm_jax.generate import add_model_args
    from mlm_jax.xla_flags import use_cpu_devices

    p = ArgumentParser(prog="python -m mlm_jax.serve",
                                description="Serve a checkpoint: Megatron's PUT /api and OpenAI's /v1/completions.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together (slots)")
    p.add_argument("--max-context", type=int, default=None,
                   help="positions per sequence, prompt + new tokens (default: the model's)")
    p.add_argument("--max-queue", type=int, default=64, help="requests in flight before 503")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before 504")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (413 beyond)")
    p.add_argument("--served-model-name", default=None, help="the model id the server reports (default: --load as given); a request naming another model is answered by this one, with a note in the log")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="static: a batch runs to its end before the next starts (for comparison)")
    args = p.parse_args(argv)
    use_cpu_devices()
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_batch_size", "max_queue"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {args.max_context}")
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise UsageError(f"--max-body-mb must be a finite number > 0, got {args.max_body_mb}")
    sock = _bind(args.host, args.port)

    import jax
    import uvicorn

    from mlm_jax.generate import load_model
    from mlm_jax.serve.app import _log, make_app

    model = load_model(args)
    m = model.config
    _log(f"model {args.load}: {m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, "
         f"iteration {model.iteration}; devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
         f"(tensor parallel {args.tensor_model_parallel_size})")
    app = make_app(model, args.max_batch_size, args.max_queue, args.request_timeout, args.max_context,
                   args.served_model_name or args.load, int(args.max_body_mb * (1 << 20)), args.batching == "continuous")
    host, port = sock.getsockname()[:2]
    _log(f"serving {app.state.service.name!r} on http://{host}:{port} (Ctrl-C drains and stops)")

    class Server(uvicorn.Server):
        signalled = None

        def handle_exit(self, sig, frame):
            Server.signalled = sig
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=60))
    server.run(sockets=[sock])
    if Server.signalled == signal.SIGINT:
        raise KeyboardInterrupt
    return 0 if Server.signalled in (None, signal.SIGTERM) else EXIT_INTERRUPTED
