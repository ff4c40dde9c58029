"""Context parallelism computes the single-device model's loss and gradients (fp32).

The sequence is split over `context` in Megatron's load-balanced chunk order; every comm type
(p2p ring, allgather, a2a) at C = 2 and 4, and C = 2 composed with tensor + sequence parallelism
+ data parallelism + ZeRO and with pipeline parallelism. Document masks (--reset-attention-mask,
--reset-position-ids, --eod-mask-loss) and the Llama-style model (GQA: 8 heads in 4 groups,
rotary) are folded into some layouts rather than doubling every case (each compile costs ~10 s
here); learned absolute positions are the default model's. Tolerances: tests/test_parallel.py's.
"""

import dataclasses

import numpy as np
import pytest

from mlm_jax.config import ConfigError, ParallelConfig
from mlm_jax.parallel.chunks import local_order, permute_seq, seq_order, unpermute_seq
from mlm_jax.validation import finalize
from tests.parallel_util import VOCAB, build, document_grads_for, grads_for, tiny_config
from tests.test_parallel import REFERENCE, assert_matches_one_device

LLAMA = (("num_query_groups", 4), ("position_embedding_type", "rope"), ("normalization", "RMSNorm"),
         ("swiglu", True), ("untie_embeddings_and_output_weights", True), ("add_bias_linear", False))


def cp(size, comm, **more):
    return ParallelConfig(context_parallel_size=size, cp_comm_type=comm, **more)


# name -> (parallel config, micro batch, documents?, model overrides)
LAYOUTS = {
    "cp2_p2p": (cp(2, "p2p"), 2, False, ()),
    "cp2_allgather_docs": (cp(2, "allgather"), 2, True, ()),
    "cp2_a2a_gqa_rope": (cp(2, "a2a"), 2, False, LLAMA),
    "cp4_p2p_gqa_rope_docs": (cp(4, "p2p"), 2, True, LLAMA),
    "cp4_allgather": (cp(4, "allgather"), 2, False, ()),
    "cp4_a2a_docs": (cp(4, "a2a"), 2, True, ()),
    "cp2_tp2_dp2_sp_zero_p2p_docs": (cp(2, "p2p", tensor_model_parallel_size=2, sequence_parallel=True,
                                        use_distributed_optimizer=True), 2, True, ()),
    "cp2_tp2_dp2_sp_zero_a2a": (cp(2, "a2a", tensor_model_parallel_size=2, sequence_parallel=True,
                                   use_distributed_optimizer=True), 2, False, ()),
    "cp2_pp2_1f1b_p2p": (cp(2, "p2p", pipeline_model_parallel_size=2), 2, False, ()),
    "cp2_pp2_gpipe_allgather_docs": (cp(2, "allgather", pipeline_model_parallel_size=2,
                                        pipeline_schedule="gpipe"), 2, True, ()),
    # Interleaved: 4 layers, 2 chunks of 1 layer per stage (the third schedule).
    "cp2_pp2_interleaved_a2a": (cp(2, "a2a", pipeline_model_parallel_size=2,
                                   virtual_pipeline_model_parallel_size=2), 2, False, (("num_layers", 4),)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_single_device(name):
    parallel, micro, documents, model = LAYOUTS[name]
    run = document_grads_for if documents else grads_for
    assert_matches_one_device(run(*REFERENCE, single_device=True, model=model), run(parallel, micro, model=model))


def test_chunk_order_is_megatrons_load_balance():
    # 2C = 8 chunks of 2 tokens: rank i holds chunks i and 7 - i.
    order = seq_order(16, 4)
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert local_order(1, 4, 4).tolist() == [2, 3, 12, 13]
    assert seq_order(6, 1).tolist() == list(range(6))  # C = 1: the plain order
    x = np.arange(32).reshape(2, 16)
    assert np.array_equal(unpermute_seq(permute_seq({"x": x}, 4)["x"], 4), x)


def test_loader_delivers_each_context_rank_its_chunks():
    """BatchLoader on a cp4 x dp2 mesh: each device's seq slice is its two original chunks."""
    from mlm_jax.data.batch import make_batch
    from mlm_jax.data.loader import BatchLoader

    pz = build(cp(4, "p2p"), 2)
    m, b, s = pz.batch_shape()
    samples = np.arange(4 * 16 * (s + 1)).reshape(-1, s + 1) % VOCAB

    class Dataset:
        def __len__(self):
            return samples.shape[0]

        def __getitem__(self, i):
            return samples[i]

    with BatchLoader(Dataset(), 16, pz.batch_sharding(), (m, b, s), lambda x: make_batch(x, VOCAB - 1),
                     prefetch=0) as loader:
        batch, _ = next(loader)
    tokens = samples[:16, :-1].reshape(m, b, s)
    for shard in batch["position_ids"].addressable_shards:
        rank = pz.mesh.devices.flatten().tolist().index(shard.device)
        c_rank = np.unravel_index(rank, pz.mesh.devices.shape)[pz.mesh.axis_names.index("context")]
        want = local_order(c_rank, 4, s // 4)
        assert np.array_equal(np.asarray(shard.data)[0, 0], want)  # positions follow the chunks
    got = np.asarray(batch["tokens"])
    assert np.array_equal(got, tokens[..., seq_order(s, 4)])


@pytest.mark.parametrize("parallel, model, message", [
    (cp(4, "p2p"), {}, "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8"),
    (cp(4, "a2a"), {"num_query_groups": 2},
     "--cp-comm-type a2a needs --num-query-groups 2 divisible by --context-parallel-size 4"),
    (cp(2, "a2a", tensor_model_parallel_size=4), {"num_attention_heads": 4, "num_query_groups": 4},
     "--cp-comm-type a2a needs --num-attention-heads 4 divisible by --context-parallel-size 2 x "
     "--tensor-model-parallel-size 4 = 8"),
    (cp(3, "p2p"), {}, "device count 8 is not divisible by tensor (1) x pipeline (1) x context (3) = 3"),
])
def test_bad_context_parallel_sizes_are_one_line_errors(parallel, model, message):
    cfg = tiny_config(parallel, 1, **model)
    if "seq-length 36" in message:
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, seq_length=36),
                          model=dataclasses.replace(cfg.model, max_position_embeddings=36))
    with pytest.raises(ConfigError) as err:
        finalize(cfg, 8)
    assert message in str(err.value) and "\n" not in str(err.value)



def test_cli_bad_context_size_exits_2_with_one_line(tmp_path):
    import os
    import subprocess
    import sys

    keep = tmp_path / "keep.txt"
    keep.write_text("data")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--mock-data", "--context-parallel-size", "2",
                          "--seq-length", "30", "--save", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if "--context-parallel-size" in line]
    assert len(lines) == 1 and "--seq-length 30 is not divisible by 2 x --context-parallel-size 2 = 4" in lines[0], out.stderr
    assert keep.read_text() == "data" and not (tmp_path / "run").exists()


def test_inspect_shows_each_context_ranks_chunks(capsys):
    import json

    from mlm_jax.data import inspect as inspect_cli

    args = ["--mock-data", "--vocab-size", "100", "--seq-length", "8", "--train-samples", "8", "--show", "0:2"]
    assert inspect_cli.main(args + ["--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert inspect_cli.main(args + ["--json", "--context-parallel-size", "2"]) == 0
    ranks = json.loads(capsys.readouterr().out)
    for sample, per_rank in zip(whole, ranks):  # 4 chunks of 2 inputs: rank 0 has 0 and 3
        inputs = sample[:-1]
        assert per_rank == [inputs[0:2] + inputs[6:8], inputs[2:6]]
    assert inspect_cli.main(args + ["--context-parallel-size", "3"]) == 2
    assert "--seq-length 8 is not divisible by 2 x --context-parallel-size 3 = 6" in capsys.readouterr().err


@pytest.mark.parametrize("comm_type,size", [("a2a", 2), ("a2a", 4), ("p2p", 2), ("p2p", 4),
                                            ("allgather", 2), ("allgather", 4)])
def test_fused_kernel_paths_equal_the_xla_blocks(comm_type, size):
    """The paths each comm type takes with a fused kernel (`context_attention(fused=...)`, cuDNN's
    on NVIDIA GPUs): a2a puts each device's whole sequence in the natural order and runs plain
    causal attention; p2p runs the ring with each block's output and log-sum-exp, its backward
    fed the merged ones (`_fused_ring`); allgather runs jax's dot_product_attention with the
    causal order as a mask. Here XLA's kernels stand in for cuDNN's (CPU): output and every input
    gradient equal the XLA block path's (fp32, 1e-5), GQA, cp2 x tp2 and cp4."""
    import jax
    import jax.numpy as jnp

    from mlm_jax.models.attention import XLA
    from mlm_jax.parallel.context import context_attention
    from mlm_jax.parallel import tracing
    from mlm_jax.sharding import make_mesh
    from mlm_jax.sharding.rules import activation_rules

    tp = 2 if size == 2 else 1  # a2a splits the 4 kv heads over cp x tp
    mesh = make_mesh(ParallelConfig(context_parallel_size=size, tensor_model_parallel_size=tp))
    kq, kk, kv, kw = jax.random.split(jax.random.key(size), 4)
    b, s = 4, 64
    q = jax.random.normal(kq, (b, s, 8, 16), jnp.float32)  # [b, s, h, k], stored chunk order
    k = jax.random.normal(kk, (b, s, 4, 16), jnp.float32)  # [b, s, g, k]
    v = jax.random.normal(kv, (b, s, 4, 16), jnp.float32)
    w = jax.random.normal(kw, q.shape, jnp.float32)

    def grads(fused):
        def loss(q, k, v):
            return jnp.sum(context_attention(q, k, v, comm_type=comm_type, fused=fused) * w)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    with tracing(mesh, activation_rules(False), comm_type):
        (ref_loss, ref), (loss, got) = grads(None), grads(XLA)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_flash_with_context_parallelism_is_accepted_with_every_comm_type(comm_type):
    ok = tiny_config(cp(2, comm_type), 2, bf16=True, attention_backend="flash")
    assert finalize(ok, 8).model.attention_backend == "flash"
