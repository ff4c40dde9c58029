"""export-megatron: mlm_jax checkpoints written as Megatron-LM legacy `torch` checkpoints and
Megatron-Core `torch_dist` ones without PyTorch (mlm_jax/checkpoint/megatron/torch_write.py,
dcp_write.py, layout_write.py).

The mlm_jax checkpoints come from the synthetic Megatron fixtures (tests/fixtures/
megatron_synthetic/) via import-megatron: a GPT-2 style model (LayerNorm, learned positions,
biases, tied) and a Llama style one (GQA, SwiGLU, RMSNorm, rope, untied). Each is exported at
several tensor x pipeline sizes and read back with mlm_jax's Megatron reader: every parameter
bitwise equal, the same config, the same logits; export then import-megatron is bitwise.
That torch.load opens the files is checked by hand (tests/check_megatron_write.py); these
tests never import torch.
"""

import os
import zipfile

import numpy as np
import pytest

import mlm_jax
from mlm_jax.checkpoint.megatron import MegatronCheckpointError, read_checkpoint, torch_pickle
from mlm_jax.checkpoint.megatron.legacy import rank_dirs
from tests.test_megatron_checkpoint import _flat

HERE = os.path.dirname(__file__)
SYN = os.path.join(HERE, "fixtures", "megatron_synthetic")
TOKENS = np.random.default_rng(0).integers(0, 100, (2, 16))
SIZES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tensor, pipeline)


def _host_params(path):
    from mlm_jax.checkpoint import find_checkpoint, restore_host_params

    found = find_checkpoint(path, log=lambda *a: None)
    return found, _flat(restore_host_params(found))


def _assert_same(got, ref, what):
    assert sorted(got) == sorted(ref), what
    for k in ref:
        assert got[k].dtype == ref[k].dtype or got[k].dtype == np.float32, (what, k)
        np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{what} {k}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{model: (mlm_jax checkpoint root, Found, flat params, logits)} imported once."""
    from mlm_jax.tools.checkpoint import import_megatron

    out = {}
    for model in ("gpt", "llama"):
        root = str(tmp_path_factory.mktemp(f"mlm_{model}"))
        import_megatron(os.path.join(SYN, model, "dist_tp1"), root, log=lambda *a: None)
        found, params = _host_params(root)
        out[model] = (root, found, params, mlm_jax.load(root).logits(TOKENS))
    return out


def _export(src, dst, tp, pp, capsys=None):
    from mlm_jax.tools.checkpoint import main

    rc = main(["export-megatron", "--load", src, "--save", dst, "--ckpt-format", "torch", "--tensor-model-parallel-size",
               str(tp), "--pipeline-model-parallel-size", str(pp)])
    return rc


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("tp,pp", SIZES)
def test_export_reads_back_bitwise(ckpts, tmp_path, model, tp, pp):
    root, found, ref, logits = ckpts[model]
    dst = str(tmp_path / "megatron")
    assert _export(root, dst, tp, pp) == 0
    assert open(os.path.join(dst, "latest_checkpointed_iteration.txt")).read() == str(found.iteration)
    it = os.path.join(dst, f"iter_{found.iteration:07d}")
    assert sorted(rank_dirs(it)) == [(t, p, 0) for t in range(tp) for p in range(pp)]
    names = sorted(os.listdir(it))
    assert names == sorted(f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
                           for t in range(tp) for p in range(pp))
    assert [n for n in os.listdir(tmp_path) if n != "megatron"] == []  # no temp folder left

    ck = read_checkpoint(dst)
    assert ck.format == "torch" and ck.iteration == found.iteration
    assert ck.config == found.config.model
    _assert_same(_flat(ck.params), ref, f"{model} tp{tp} pp{pp}")
    np.testing.assert_array_equal(mlm_jax.load(dst).logits(TOKENS), logits)

    # each rank's file: Megatron's top-level keys, args with the sizes, local layer numbers
    m = found.config.model
    for (t, p, _), folder in rank_dirs(it).items():
        path = os.path.join(folder, "model_optim_rng.pt")
        with zipfile.ZipFile(path) as z:
            listed = z.namelist()
            assert {"archive/data.pkl", "archive/version", "archive/byteorder"} <= set(listed)
            assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
            for info in z.infolist():  # torch's 64-byte alignment of each record's data
                with open(path, "rb") as f:
                    f.seek(info.header_offset + 26)
                    n, e = np.frombuffer(f.read(4), "<u2")
                assert (info.header_offset + 30 + int(n) + int(e)) % 64 == 0, info.filename
        st = torch_pickle.load(open(path, "rb").read(), path)
        assert sorted(st) == ["args", "checkpoint_version", "iteration", "model",
                              "num_floating_point_operations_so_far"]
        assert st["checkpoint_version"] == 3.0 and st["iteration"] == found.iteration
        a = st["args"]
        assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (tp, pp)
        assert a.num_layers == m.num_layers and a.hidden_size == m.hidden_size
        assert a.num_query_groups == m.query_groups and a.kv_channels == m.head_dim
        assert a.padded_vocab_size == 128 * tp  # vocab 100 padded for T
        sd = st["model"]
        layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")})
        assert layers == list(range(m.num_layers // pp))
        assert ("embedding.word_embeddings.weight" in sd) == (p == 0)
        assert ("decoder.final_layernorm.weight" in sd) == (p == pp - 1)
        assert sd["embedding.word_embeddings.weight"].shape == (128, m.hidden_size) if p == 0 else True
        qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
        g, r, k = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
        assert qkv.shape == (g // tp * (r + 2) * k, m.hidden_size)
        proj = sd["decoder.layers.0.self_attention.linear_proj.weight"]
        assert proj.shape == (m.hidden_size, m.num_attention_heads * k // tp)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_export_then_import_is_bitwise(ckpts, tmp_path, model):
    from mlm_jax.tools.checkpoint import import_megatron

    root, found, ref, _ = ckpts[model]
    dst = str(tmp_path / "megatron")
    assert _export(root, dst, 2, 2) == 0
    back = str(tmp_path / "back")
    import_megatron(dst, back, log=lambda *a: None)
    found2, got = _host_params(back)
    _assert_same(got, ref, model)
    assert found2.iteration == found.iteration
    assert found2.config.model == found.config.model


def test_swiglu_fc1_is_each_ranks_gate_and_up(ckpts, tmp_path):
    """T=2: rank t's fc1 is [gate rows of t; up rows of t], the QKV rows its query groups'."""
    root, found, ref, _ = ckpts["llama"]
    dst = str(tmp_path / "megatron")
    assert _export(root, dst, 2, 1) == 0
    it = os.path.join(dst, f"iter_{found.iteration:07d}")
    w1 = ref["layers/mlp/w1"][0]  # [d, 2, f]
    wqkv = ref["layers/attention/wqkv"][0]  # [d, g, r + 2, k]
    f = w1.shape[-1]
    for t in range(2):
        path = os.path.join(it, f"mp_rank_{t:02d}", "model_optim_rng.pt")
        sd = torch_pickle.load(open(path, "rb").read(), path)["model"]
        fc1 = np.asarray(sd["decoder.layers.0.mlp.linear_fc1.weight"])
        half = slice(t * f // 2, (t + 1) * f // 2)
        np.testing.assert_array_equal(fc1, np.concatenate([w1[:, 0, half].T, w1[:, 1, half].T]))
        qkv = np.asarray(sd["decoder.layers.0.self_attention.linear_qkv.weight"])
        d, g = wqkv.shape[0], wqkv.shape[1]
        mine = wqkv[:, t * g // 2:(t + 1) * g // 2]
        np.testing.assert_array_equal(qkv, mine.transpose(1, 2, 3, 0).reshape(-1, d))


def _last_error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_save_that_exists_and_is_not_empty(ckpts, tmp_path, capsys):
    root = ckpts["gpt"][0]
    dst = tmp_path / "megatron"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert _export(root, str(dst), 1, 1) == 2
    last = _last_error(capsys)
    assert last.startswith("error: --save ") and "exists and is not empty" in last
    assert os.listdir(dst) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["megatron"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(root, str(empty), 1, 1) == 0  # an empty folder is fine
    assert os.path.isfile(empty / "latest_checkpointed_iteration.txt")


@pytest.mark.parametrize("tp,pp,what", [(3, 1, "num_attention_heads = 4"), (4, 1, "num_query_groups = 2"),
                                        (1, 3, "num_layers = 4")])
def test_unsupported_layout_is_named(ckpts, tmp_path, capsys, tp, pp, what):
    root = ckpts["llama"][0]
    dst = str(tmp_path / "megatron")
    assert _export(root, dst, tp, pp) == 2
    last = _last_error(capsys)
    assert last.startswith("error: ") and what in last and "unsupported layout" in last
    assert os.listdir(tmp_path) == []  # nothing written


def test_nothing_partial_is_left_on_failure(ckpts, tmp_path, monkeypatch):
    from mlm_jax.checkpoint.megatron import torch_write
    from mlm_jax.tools.checkpoint import export_megatron

    calls = []
    real = torch_write.ArchiveWriter.tensor

    def failing(self, x):
        calls.append(1)
        if len(calls) == 20:
            raise OSError("disk full")
        return real(self, x)

    monkeypatch.setattr(torch_write.ArchiveWriter, "tensor", failing)
    with pytest.raises(OSError, match="disk full"):
        export_megatron(ckpts["llama"][0], str(tmp_path / "megatron"), "torch", tensor_parallel=2, pipeline_parallel=2,
                        log=lambda *a: None)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_torch_dist_export_reads_back_bitwise_in_megatron_cores_layout(ckpts, tmp_path, model):
    """--ckpt-format torch_dist: Megatron-Core's files (metadata.json, common.pt, .metadata,
    __0_0.distcp), global tensors with the layers stacked one chunk each, the norms under the
    fused names, SwiGLU's fc1 in a gate and an up chunk; read back bitwise; then import bitwise.
    (Megatron-Core 0.16.1's dist_checkpointing.load of such an export gives its own logits:
    tests/make_megatron_fixtures.py --check, by hand; benchmarks/RESULTS.md.)"""
    from mlm_jax.checkpoint.megatron import dcp
    from mlm_jax.tools.checkpoint import import_megatron, main

    root, found, ref, logits = ckpts[model]
    dst = str(tmp_path / "megatron")
    assert main(["export-megatron", "--load", root, "--save", dst]) == 0  # torch_dist: the default, as Megatron's
    assert [n for n in os.listdir(tmp_path) if n != "megatron"] == []  # no temp folder left
    it = os.path.join(dst, f"iter_{found.iteration:07d}")
    assert sorted(os.listdir(it)) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert dcp.read_json(os.path.join(it, "metadata.json"))["sharded_backend"] == "torch_dist"
    ck = read_checkpoint(dst)
    assert ck.format == "torch_dist" and ck.iteration == found.iteration and ck.config == found.config.model
    _assert_same(_flat(ck.params), ref, f"{model} torch_dist")
    np.testing.assert_array_equal(mlm_jax.load(dst).logits(TOKENS), logits)

    m = found.config.model
    d = dcp.Distcp(it)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    g, r, k = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
    assert d.shapes[qkv] == (m.num_layers, g * (r + 2) * k, m.hidden_size)
    assert sorted(o for o, _, _ in d.chunks[qkv]) == [(i, 0, 0) for i in range(m.num_layers)]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in d.shapes
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in d.shapes
    assert not [key for key in d.shapes if key.startswith("decoder.layers.0.") or "input_layernorm" in key]
    fc1 = sorted(o for o, _, _ in d.chunks["decoder.layers.mlp.linear_fc1.weight"])
    halves = [0, m.ffn_size] if m.swiglu else [0]
    assert fc1 == [(i, h, 0) for i in range(m.num_layers) for h in halves]
    assert f"decoder.layers.mlp.linear_fc2._extra_state/shard_0_{m.num_layers}" in d.objects
    common = dcp.read_common(it)
    assert common["iteration"] == found.iteration and common["args"].ckpt_format == "torch_dist"
    back = str(tmp_path / "back")
    import_megatron(dst, back, log=lambda *a: None)
    _assert_same(_host_params(back)[1], ref, f"{model} torch_dist -> import")


def test_torch_dist_refuses_what_it_does_not_write(ckpts, tmp_path, capsys):
    """torch_dist is global: no tensor/pipeline split to ask for. An error naming it, nothing
    written."""
    from mlm_jax.tools.checkpoint import main

    gpt = ckpts["gpt"][0]
    assert main(["export-megatron", "--load", gpt, "--save", str(tmp_path / "x"), "--ckpt-format", "torch_dist",
                 "--tensor-model-parallel-size", "2"]) == 2
    assert "--ckpt-format torch_dist (the default, as in Megatron-LM) holds global tensors" in _last_error(capsys)
    assert main(["export-megatron", "--load", gpt, "--save", str(tmp_path / "x"), "--pipeline-model-parallel-size",
                 "2"]) == 2  # the default format: told how to split the legacy one
    assert "or add --ckpt-format torch (the legacy format they split)" in _last_error(capsys)
    assert os.listdir(tmp_path) == []
    with pytest.raises(MegatronCheckpointError):
        from mlm_jax.checkpoint.megatron.torch_write import write_legacy

        write_legacy(str(tmp_path / "y"), {}, ckpts["gpt"][1].config.model, 1, tp=3)


def _dcp_layout(it):
    """{key: (global shape, sorted chunk (offsets, sizes))} and the object keys of a torch_dist folder."""
    from mlm_jax.checkpoint.megatron import dcp

    d = dcp.Distcp(it)
    return {k: (d.shapes[k], sorted((o, s) for o, s, _ in d.chunks[k])) for k in d.shapes}, sorted(d.objects)


def test_moe_torch_dist_export_is_megatron_cores_layout(tmp_path):
    """--ckpt-format torch_dist of the MoE model Megatron-Core 0.16.1 wrote itself
    (tests/fixtures/megatron/moe, SequentialMLP): the same keys, global shapes, chunks (per layer
    and expert, SwiGLU halves apart) and `_extra_state` objects as Megatron-Core's own file; read
    back bitwise, the same logits. (Megatron-Core loads the export and computes its own logits:
    tests/make_megatron_fixtures.py --check, by hand.)"""
    from mlm_jax.tools.checkpoint import import_megatron, main

    src = os.path.join(HERE, "fixtures", "megatron", "moe", "dist_tp1")
    root = str(tmp_path / "mlm")
    import_megatron(src, root, log=lambda *a: None)
    found, ref = _host_params(root)
    dst = str(tmp_path / "megatron")
    assert main(["export-megatron", "--load", root, "--save", dst, "--ckpt-format", "torch_dist"]) == 0
    it = f"iter_{found.iteration:07d}"
    assert _dcp_layout(os.path.join(dst, it)) == _dcp_layout(os.path.join(src, it))
    ck = read_checkpoint(dst)
    assert ck.format == "torch_dist" and ck.config == found.config.model
    _assert_same(_flat(ck.params), ref, "moe torch_dist")
    np.testing.assert_array_equal(mlm_jax.load(dst).logits(TOKENS), mlm_jax.load(src).logits(TOKENS))


@pytest.mark.parametrize("model", ["mixtral", "moe_mixed"])
def test_moe_torch_dist_export_reads_back_bitwise(tmp_path, model):
    """--ckpt-format torch_dist of MoE models: every layer MoE (stacked on the layers dim, experts
    on the second) and dense + MoE layers with a shared expert (Megatron-Core's non-homogeneous
    layers: per-layer keys, no layers dim); read back bitwise, then import bitwise."""
    from mlm_jax.checkpoint.megatron import dcp
    from mlm_jax.tools.checkpoint import import_megatron, main

    root = str(tmp_path / "mlm")
    import_megatron(os.path.join(SYN, model, "dist_tp1"), root, log=lambda *a: None)
    found, ref = _host_params(root)
    m = found.config.model
    dst = str(tmp_path / "megatron")
    assert main(["export-megatron", "--load", root, "--save", dst, "--ckpt-format", "torch_dist"]) == 0
    ck = read_checkpoint(dst)
    assert ck.config == found.config.model
    _assert_same(_flat(ck.params), ref, f"{model} torch_dist")
    np.testing.assert_array_equal(mlm_jax.load(dst).logits(TOKENS), mlm_jax.load(root).logits(TOKENS))
    d = dcp.Distcp(os.path.join(dst, f"iter_{found.iteration:07d}"))
    L, E, f = m.num_layers, m.num_experts, m.moe_ffn_size
    if model == "mixtral":
        fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        assert d.shapes[fc1] == (L, E, 2 * f, m.hidden_size)
        assert sorted(o for o, _, _ in d.chunks[fc1]) == [(i, j, h, 0) for i in range(L) for j in range(E)
                                                         for h in (0, f)]
        assert d.shapes["decoder.layers.mlp.router.weight"] == (L, E, m.hidden_size)
        assert f"decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_{L}.{E}" in d.objects
    else:
        assert not [k for k in d.shapes if k.startswith("decoder.layers.") and not k.split(".")[2].isdigit()]
        assert d.shapes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (E, 2 * f, m.hidden_size)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in d.shapes and "decoder.layers.1.mlp.router.weight" in d.shapes
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in d.shapes
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in d.shapes
        assert f"decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_{E}" in d.objects
        assert "decoder.layers.0.mlp.linear_fc2._extra_state/shard_0_1" in d.objects
    back = str(tmp_path / "back")
    import_megatron(dst, back, log=lambda *a: None)
    _assert_same(_host_params(back)[1], ref, f"{model} torch_dist -> import")


@pytest.mark.parametrize("model", ["mixtral", "moe_mixed"])
def test_moe_export_reads_back_bitwise(tmp_path, model):
    """Experts (SequentialMLP's local_experts.<j>., each TP-sliced), the router, a shared expert
    and dense + MoE layers mixed, at T=2 x P=2."""
    from mlm_jax.tools.checkpoint import import_megatron

    root = str(tmp_path / "mlm")
    import_megatron(os.path.join(SYN, model, "dist_tp1"), root, log=lambda *a: None)
    found, ref = _host_params(root)
    dst = str(tmp_path / "megatron")
    assert _export(root, dst, 2, 2) == 0
    ck = read_checkpoint(dst)
    assert ck.config == found.config.model
    _assert_same(_flat(ck.params), ref, model)
    np.testing.assert_array_equal(mlm_jax.load(dst).logits(TOKENS), mlm_jax.load(root).logits(TOKENS))
    path = os.path.join(dst, f"iter_{found.iteration:07d}", "mp_rank_01_001", "model_optim_rng.pt")
    sd = torch_pickle.load(open(path, "rb").read(), path)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in sd
