"""The one trace context: what a step is traced under, besides the mesh.

`parallel.tracing` sets it for a whole step; the per-rank and pipeline bodies narrow it with
`using`. Model code reads it and calls what is installed here, so nothing under `models/`
imports `parallel/` or names a mesh axis. The fields:

  rules              the activation rules `sharding.rules.constrain` resolves logical dims
                     against; empty: no mesh, model code runs unsharded;
  row_offset         the global index of this program's batch row 0 (a per-rank body holds
                     rows from there on): dropout masks are a function of the global index;
  rank_split         (manual axes, ranks): this program holds one of `ranks` row blocks of each
                     microbatch (the MoE router sums its statistics over them); None: all rows;
  route_groups       the equal blocks of batch rows here that a MoE router gives a capacity of
                     their own: each data-parallel rank's rows (Megatron sizes capacity from a
                     rank's own tokens); 1 in a per-rank body and on one device;
  context_attention  the context-parallel attention (`parallel/context.py`, with the run's
                     --cp-comm-type) where the mesh splits the sequence and the batch is in the
                     chunk order; None: attention runs on the whole sequence;
  seq_order          there, seq_order(s): [s] the original index of each stored position of a
                     sequence of s tokens (`parallel/chunks.py`); None: the plain order;
  expert_dispatch    the token dispatch to the experts (`parallel/experts.py`); None: every
                     expert runs on every token here;
  platform           the platform of the mesh's devices (a deviceless GPU compile runs in a CPU
                     process); None: the default device's (see `mlm_jax.platform.current`);
  layer_grad_hook    what each layer's weights pass through inside the layer scan, with the
                     per-layer inputs it gives (`parallel/data.py`: --overlap-grad-reduce's
                     gradient reduction in the last microbatch's backward); None: nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Trace:
    rules: tuple = ()
    row_offset: Any = None
    rank_split: tuple | None = None
    route_groups: int = 1
    context_attention: Callable | None = None
    seq_order: Callable | None = None
    expert_dispatch: Callable | None = None
    platform: str | None = None
    layer_grad_hook: Any = None


_OUTSIDE = Trace()
_STACK: list[Trace] = []  # innermost last


def current() -> Trace:
    """The trace context in force (every field empty outside `using`)."""
    return _STACK[-1] if _STACK else _OUTSIDE


@contextlib.contextmanager
def using(**fields):
    """The context in force with `fields` replaced, for the body of the `with`."""
    _STACK.append(dataclasses.replace(current(), **fields))
    try:
        yield _STACK[-1]
    finally:
        _STACK.pop()
