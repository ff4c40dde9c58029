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


# An expert-parallel dispatch and return (ep4 x dp2, T*K = 1024 rows of d = 256 in bf16): the
# dispatch sends its [1024, d] rows into a receive buffer of the worst case, [4 x 1024, d]; the
# return sends from that buffer back into [1024, d]. (jax 0.10.2's XLA, as the GPU-compile
# tier's ep4_alltoall program has them.)
RAGGED_TYPES = "(bf16[{0}]{{1,0}}, bf16[{1}]{{1,0}}, s64[4]{{0}}, s64[4]{{0}}, s64[4]{{0}}, /*index=5*/s64[4]{{0}})"
EXPERT_GROUPS = "channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}"
RAGGED = f"""HloModule jit_train_step, is_scheduled=true

ENTRY %main (rows: bf16[1024,256], zeros: bf16[4096,256], back: bf16[1024,256], o: s64[4]) -> bf16[1024,256] {{
  %rows = bf16[1024,256]{{1,0}} parameter(0)
  %zeros = bf16[4096,256]{{1,0}} parameter(1)
  %back = bf16[1024,256]{{1,0}} parameter(2)
  %o = s64[4]{{0}} parameter(3)
  %ragged-all-to-all-start = ({RAGGED_TYPES.format("1024,256", "4096,256")}, bf16[4096,256]{{1,0}}) ragged-all-to-all-start(%rows, %zeros, %o, %o, %o, /*index=5*/%o), {EXPERT_GROUPS}, {ASYNC}
  %ragged-all-to-all-done = bf16[4096,256]{{1,0}} ragged-all-to-all-done(%ragged-all-to-all-start)
  %fusion = bf16[4096,256]{{1,0}} fusion(%ragged-all-to-all-done), kind=kLoop, calls=%add
  %ragged-all-to-all-start.1 = ({RAGGED_TYPES.format("4096,256", "1024,256")}, bf16[1024,256]{{1,0}}) ragged-all-to-all-start(%fusion, %back, %o, %o, %o, /*index=5*/%o), {EXPERT_GROUPS}, {ASYNC}
  ROOT %ragged-all-to-all-done.1 = bf16[1024,256]{{1,0}} ragged-all-to-all-done(%ragged-all-to-all-start.1)
}}
"""


def test_a_ragged_all_to_all_counts_the_rows_it_sends():
    """The dispatch's operand (a rank's T*K rows), not its receive buffer (ep times that); the
    return's output, not its operand (that receive buffer): averaged over the ranks a rank
    sends what the others receive."""
    mesh = {"data": 2, "expert": 4}
    collectives = gpu_hlo.read(RAGGED, mesh).collectives
    rows = 1024 * 256 * 2
    assert [(c.kind, c.axes, c.bytes, c.dtypes, c.is_async) for c in collectives] == [
        ("ragged-all-to-all", ("expert",), rows, ("bf16",), True)] * 2
    assert gpu_hlo.sent_per_axis(collectives, mesh) == {"expert": 2 * rows * 3 / 4}
