"""Reading a compiled GPU program (mlm_jax/plan/gpu_hlo.py) on its text alone: which collectives
XLA runs asynchronously. No jax and no CUDA plugin needed; the lines are the shapes XLA wrote in
the GPU-compile tier's programs (jax 0.10.2 and 0.12)."""

from mlm_jax.plan import gpu_hlo

GROUPS = "channel_id={}, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add"
SYNC, ASYNC = ('backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":%s,'
               '"is_pipelined":false}}' % flag for flag in ("true", "false"))

# One scheduled step (instructions in execution order): an all-reduce overlapping a fusion, one
# XLA left synchronous as a start/done pair (jax 0.10's XLA), one left a plain instruction (0.12's).
PROGRAM = f"""HloModule jit_train_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}}

ENTRY %main (p0: f32[4], p1: f32[1024]) -> (f32[1024], f32[4], f32[4]) {{
  %p0 = f32[4]{{0}} parameter(0)
  %p1 = f32[1024]{{0}} parameter(1)
  %all-reduce-start = f32[1024]{{0}} all-reduce-start(%p1), {GROUPS.format(1)}, {ASYNC}
  %fusion = f32[4]{{0}} fusion(%p0), kind=kLoop, calls=%add
  %all-reduce-done = f32[1024]{{0}} all-reduce-done(%all-reduce-start)
  %all-reduce-start.1 = f32[4]{{0}} all-reduce-start(%fusion), {GROUPS.format(2)}, {SYNC}
  %all-reduce-done.1 = f32[4]{{0}} all-reduce-done(%all-reduce-start.1)
  %all-reduce.2 = f32[4]{{0}} all-reduce(%all-reduce-done.1), {GROUPS.format(3)}, {SYNC}
  ROOT %tuple = (f32[1024]{{0}}, f32[4]{{0}}, f32[4]{{0}}) tuple(%all-reduce-done, %all-reduce-done.1, %all-reduce.2)
}}
"""


def test_a_collective_xla_runs_synchronously_is_not_async_in_either_form():
    collectives = gpu_hlo.read(PROGRAM, {"data": 8}).collectives
    assert [(c.kind, c.axes, c.bytes, c.is_async, c.overlapped) for c in collectives] == [
        ("all-reduce", ("data",), 4096, True, True),
        ("all-reduce", ("data",), 16, False, False),  # jax 0.10's XLA: a start/done pair, is_sync
        ("all-reduce", ("data",), 16, False, False),  # jax 0.12's XLA: the plain instruction
    ]
