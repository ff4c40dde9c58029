"""Megatron-LM checkpoints read without PyTorch (mlm_jax/checkpoint/megatron/).

The synthetic fixtures (tests/fixtures/megatron_synthetic/, written by its make.py with torch;
these tests never import torch) hold three small models in Megatron-Core's layouts, each
written as torch_dist (tensor parallel 1 and 2, and bf16) and legacy torch (tensor parallel 1
and 2, pipeline 2 x virtual 2), plus the same weights under Hugging Face names converted by the
generator independently of the reader. Every layout must give the same parameters, and the
logits must equal those of mlm_jax's Hugging Face importer (itself checked against numpy
transcriptions of transformers' forward in test_hf.py). Bad input must fail with one error
naming the file and the key, and a hostile pickle must never run.
"""

import argparse
import io
import os
import re
import pickle
import shutil
import zipfile

import ml_dtypes
import numpy as np
import pytest

import mlm_jax
from mlm_jax.checkpoint.megatron import MegatronCheckpointError, is_megatron_checkpoint, read_checkpoint
from mlm_jax.checkpoint.megatron import torch_pickle
from mlm_jax.checkpoint.megatron.layout import Tensors, to_params
from mlm_jax.errors import UsageError, exit_code

HERE = os.path.dirname(__file__)
SYN = os.path.join(HERE, "fixtures", "megatron_synthetic")
MODELS = ("gpt", "llama", "mixtral")  # with a Hugging Face reference
LAYOUTS = {"gpt": ("dist_tp1", "dist_tp2", "legacy_tp1", "legacy_tp2"),
           "llama": ("dist_tp1", "dist_tp2", "legacy_tp1", "legacy_tp2", "legacy_pp2_vp2"),
           "mixtral": ("dist_tp1", "dist_tp2", "legacy_tp1", "legacy_tp2", "legacy_tp2_ep2"),
           # dense + MoE layers (per-layer torch_dist keys), a shared expert, local names
           "moe_mixed": ("dist_tp1", "dist_tp2", "legacy_tp1", "legacy_tp2", "legacy_tp2_ep2")}
TOKENS = np.random.default_rng(0).integers(0, 100, (2, 16))
TOL = dict(rtol=0, atol=1e-5)  # fp32, the same weights: equal up to summation order


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _copy(tmp_path, model="gpt", layout="dist_tp2"):
    dst = tmp_path / f"{model}_{layout}"
    shutil.copytree(os.path.join(SYN, model, layout), dst)
    return str(dst)


def _iter_dir(root):
    name = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    return os.path.join(root, f"iter_{int(name):07d}")


def write_torch_save(path, obj):
    """A torch.save-style zip archive of `obj` (no tensors), written without torch."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(obj, protocol=2))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def _plain_args(root):
    """The fixture's args as a plain Namespace (stand-ins dropped), for rewriting common.pt."""
    common = torch_pickle.load(open(os.path.join(_iter_dir(root), "common.pt"), "rb").read(), "common.pt")
    args = vars(common["args"]).copy()
    for k in [k for k, v in args.items() if not isinstance(v, (int, float, str, list, type(None)))]:
        del args[k]
    common["args"] = argparse.Namespace(**args)
    return common


def _rewrite_args(root, **changes):
    common = _plain_args(root)
    for k, v in changes.items():
        setattr(common["args"], k, v)
    write_torch_save(os.path.join(_iter_dir(root), "common.pt"), common)


# --------------------------------------------------------------------------- reading


@pytest.fixture(scope="module")
def params():
    """{model: {layout: flat params}}, read once."""
    return {m: {lay: _flat(read_checkpoint(os.path.join(SYN, m, lay)).params) for lay in LAYOUTS[m]}
            for m in LAYOUTS}


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_every_layout_reads_the_same_parameters(params, model):
    ref = params[model]["dist_tp1"]
    for layout, got in params[model].items():
        assert sorted(got) == sorted(ref), layout
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{model} {layout} {k}")


def test_mixed_dense_and_moe_layers(params):
    p = params["moe_mixed"]["dist_tp2"]
    assert p["layers/mlp/w1"].shape == (1, 32, 2, 40)  # layer 0: dense
    assert p["moe_layers/mlp/w1"].shape == (1, 4, 32, 2, 40)  # layer 1: 4 experts
    assert p["moe_layers/mlp/router"].shape == (1, 32, 4)
    assert p["moe_layers/mlp/shared/w1"].shape == (1, 32, 2, 24)
    m = mlm_jax.load(os.path.join(SYN, "moe_mixed", "legacy_tp2_ep2"))
    assert m.config.moe_layer_freq == (0, 1) and m.config.moe_shared_expert_intermediate_size == 24
    assert np.isfinite(m.logits(TOKENS)).all()


def test_bf16_torch_dist_is_the_weights_rounded(params):
    ck = read_checkpoint(os.path.join(SYN, "llama", "dist_bf16"))
    got, ref = _flat(ck.params), params["llama"]["dist_tp1"]
    for k in ref:
        want = ref[k].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def test_config_from_args():
    ck = read_checkpoint(os.path.join(SYN, "llama", "legacy_tp2"))
    m = ck.config
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size) == (4, 32, 4, 2, 48)
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.add_bias_linear) == ("RMSNorm", "rope", True, False)
    assert m.untie_embeddings_and_output_weights and m.vocab_size == 100  # NullTokenizer: --vocab-size 99 + EOD
    assert ck.iteration == 40 and ck.format == "torch"
    assert ck.tokenizer.tokenizer_type == "NullTokenizer" and ck.tokenizer.vocab_size == 100
    moe = read_checkpoint(os.path.join(SYN, "mixtral", "dist_tp2")).config
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_size) == (4, 2, 40)
    gpt = read_checkpoint(os.path.join(SYN, "gpt", "dist_tp1"))
    assert gpt.format == "torch_dist" and gpt.config.openai_gelu and not gpt.config.untie_embeddings_and_output_weights


def test_root_and_iteration_folder_and_step():
    root = os.path.join(SYN, "gpt", "dist_tp2")
    assert is_megatron_checkpoint(root) and is_megatron_checkpoint(_iter_dir(root))
    assert not is_megatron_checkpoint(SYN)
    assert read_checkpoint(_iter_dir(root)).iteration == 20
    assert read_checkpoint(root, step=20).iteration == 20
    with pytest.raises(MegatronCheckpointError, match="iter_0000021"):
        read_checkpoint(root, step=21)


# --------------------------------------------------------------------------- logits


def _hf_reference(tmp_path, model):
    from safetensors.numpy import save_file

    folder = tmp_path / f"hf_{model}"
    folder.mkdir()
    tensors = dict(np.load(os.path.join(SYN, model, "hf.npz")))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    shutil.copy(os.path.join(SYN, model, "hf_config.json"), folder / "config.json")
    return mlm_jax.load(str(folder)).logits(TOKENS)


@pytest.mark.parametrize("model", MODELS)
def test_logits_equal_the_hugging_face_import(tmp_path, model):
    ref = _hf_reference(tmp_path, model)
    for layout in ("dist_tp2", "legacy_tp2"):
        m = mlm_jax.load(os.path.join(SYN, model, layout))
        assert m.iteration in (20, 40)
        np.testing.assert_allclose(m.logits(TOKENS), ref, **TOL, err_msg=f"{model} {layout}")


def test_logits_on_a_tensor_parallel_mesh(tmp_path):
    from mlm_jax.config import ParallelConfig
    from mlm_jax.sharding.mesh import make_mesh

    ref = _hf_reference(tmp_path, "llama")
    m = mlm_jax.load(os.path.join(SYN, "llama", "legacy_pp2_vp2"),
                     mesh=make_mesh(ParallelConfig(tensor_model_parallel_size=2)))
    assert m.config.padded_vocab_size == 256
    np.testing.assert_allclose(m.logits(TOKENS), ref, **TOL)
    out = m.generate([[1, 2, 3]], max_new_tokens=4)
    assert len(out[0].tokens) == 4


# --------------------------------------------------------------------------- bad input


class _Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_is_refused_by_name_and_never_runs(tmp_path):
    root = _copy(tmp_path)
    marker = tmp_path / "pwned"
    evil = _Hostile()
    evil.marker = marker
    common = os.path.join(_iter_dir(root), "common.pt")
    write_torch_save(common, {"args": evil, "iteration": 1})
    with pytest.raises(MegatronCheckpointError) as e:
        read_checkpoint(root)
    assert "common.pt" in str(e.value) and "system" in str(e.value) and "allow-list" in str(e.value)
    assert not marker.exists()
    # a bare pickle (DCP's .metadata) is held to the same list
    meta = os.path.join(_iter_dir(root), ".metadata")
    write_torch_save(common, _plain_args(os.path.join(SYN, "gpt", "dist_tp2")))
    with open(meta, "wb") as f:
        pickle.dump(evil, f)
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: refuses to unpickle (posix|os)\.system"):
        read_checkpoint(root)
    assert not marker.exists()


def test_other_globals_are_refused():
    for obj in (eval, getattr, np.load, __import__("subprocess").Popen):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("archive/data.pkl", pickle.dumps({"x": obj}, protocol=2))
        with pytest.raises(MegatronCheckpointError, match="refuses to unpickle"):
            torch_pickle.load(buf.getvalue(), "x.pt")


def test_a_truncated_chunk_names_the_file_and_key(tmp_path):
    root = _copy(tmp_path)
    path = os.path.join(_iter_dir(root), "__1_0.distcp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(MegatronCheckpointError) as e:
        read_checkpoint(root)
    msg = str(e.value)
    assert "__1_0.distcp" in msg and "key '" in msg and "truncated" in msg


def test_a_missing_distcp_names_the_file_and_key(tmp_path):
    root = _copy(tmp_path)
    os.remove(os.path.join(_iter_dir(root), "__1_0.distcp"))
    with pytest.raises(MegatronCheckpointError, match=r"__1_0\.distcp: missing \(it holds '[a-z_.]+'\)"):
        read_checkpoint(root)


def test_a_missing_legacy_rank_is_named(tmp_path):
    root = _copy(tmp_path, "llama", "legacy_tp2")
    shutil.rmtree(os.path.join(_iter_dir(root), "mp_rank_01"))
    with pytest.raises(MegatronCheckpointError, match="tensor 1"):
        read_checkpoint(root)


def test_a_truncated_legacy_file_is_named(tmp_path):
    root = _copy(tmp_path, "llama", "legacy_tp1")
    path = os.path.join(_iter_dir(root), "mp_rank_00", "model_optim_rng.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(MegatronCheckpointError, match="mp_rank_00/model_optim_rng.pt"):
        read_checkpoint(root)


def test_an_unknown_key_is_named(tmp_path):
    # RMSNorm args over a LayerNorm checkpoint: its norm biases are keys nothing uses
    root = _copy(tmp_path, "gpt", "dist_tp1")
    _rewrite_args(root, normalization="RMSNorm")
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: unknown key 'decoder\.[a-z_.0-9]+bias'"):
        read_checkpoint(root)
    # and a tensor of a feature mlm_jax lacks
    ck = os.path.join(SYN, "llama", "dist_tp1")
    from mlm_jax.checkpoint.megatron import _dist_tensors, dcp

    m = read_checkpoint(ck).config
    tensors = _dist_tensors(dcp.Distcp(_iter_dir(ck)), m.num_layers)
    tensors["decoder.layers.1.self_attention.q_layernorm.weight"] = ("x/.metadata", lambda: np.ones(8))
    with pytest.raises(MegatronCheckpointError, match="unknown key 'decoder.layers.1.self_attention.q_layernorm"):
        to_params(Tensors(tensors), m, 128)


def test_shapes_that_disagree_with_args_are_named(tmp_path):
    root = _copy(tmp_path, "gpt", "dist_tp2")
    _rewrite_args(root, ffn_hidden_size=64)
    with pytest.raises(MegatronCheckpointError,
                       match=r"\.metadata \(stacked key 'decoder\.layers\.mlp\.linear_fc1\.weight', layer 0\): key "
                             r"'decoder\.layers\.0\.mlp\.linear_fc1\.weight' has shape \(128, 32\), the checkpoint's "
                             r"args imply \(64, 32\)"):
        read_checkpoint(root)


@pytest.mark.parametrize("setting", [{"qk_layernorm": True}, {"position_embedding_type": "yarn"},
                                     {"rotary_interleaved": True}, {"moe_shared_expert_gate": True}])
def test_unsupported_models_are_refused_by_arg_name(tmp_path, setting):
    root = _copy(tmp_path, "gpt", "dist_tp1")
    _rewrite_args(root, **setting)
    name = next(iter(setting))
    with pytest.raises(MegatronCheckpointError, match=rf"common\.pt: args\.{name} = "):
        read_checkpoint(root)


@pytest.mark.parametrize("model,setting,key", [
    ("gpt", {"multi_latent_attention": True, "q_lora_rank": 8}, "decoder.layers.0.self_attention.linear_kv_down_proj"),
    ("mixtral", {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"},
     "decoder.layers.0.mlp.router.expert_bias")])
def test_args_that_ask_for_tensors_the_checkpoint_lacks_name_them(tmp_path, model, setting, key):
    """Multi-latent attention and the router's expert bias are read (tests/test_megatron_core_fixtures.py);
    args that say so over a checkpoint without their tensors name the first one missing."""
    root = _copy(tmp_path, model, "dist_tp1")
    _rewrite_args(root, **setting)
    with pytest.raises(MegatronCheckpointError, match=rf"the checkpoint has no tensor '{re.escape(key)}"):
        read_checkpoint(root)


def test_old_checkpoint_versions_are_refused(tmp_path):
    root = _copy(tmp_path, "gpt", "dist_tp1")
    common = _plain_args(root)
    common["checkpoint_version"] = 2.0
    write_torch_save(os.path.join(_iter_dir(root), "common.pt"), common)
    with pytest.raises(MegatronCheckpointError, match="checkpoint_version' = 2.0"):
        read_checkpoint(root)


def test_the_cli_reports_one_error_line(tmp_path, capsys):
    from mlm_jax.generate import main

    root = _copy(tmp_path)
    os.remove(os.path.join(_iter_dir(root), "__0_0.distcp"))
    assert issubclass(MegatronCheckpointError, UsageError)
    assert exit_code(MegatronCheckpointError("x")) == 2
    assert main(["--load", root, "--prompt", "1 2"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "__0_0.distcp: missing" in last


def test_import_megatron_then_train_continues_at_its_iteration(tmp_path, capsys):
    """import-megatron writes the Megatron weights at the Megatron iteration: the same logits
    as reading the folder directly, and `--load OUT --no-load-optim` trains on from there;
    `--load <Megatron folder>` without --no-load-optim or --finetune is refused naming them."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.tools.checkpoint import main as convert
    from mlm_jax.train import main as train_main
    from mlm_jax.train import train

    root = _copy(tmp_path, "gpt", "dist_tp1")
    out = tmp_path / "imported"
    assert convert(["import-megatron", "--load", root, "--save", str(out)]) == 0
    assert "imported Megatron-LM torch_dist checkpoint" in capsys.readouterr().out
    ids = np.arange(1, 17, dtype=np.int32)[None] % 90
    np.testing.assert_array_equal(mlm_jax.load(str(out)).logits(ids), mlm_jax.load(root).logits(ids))
    assert mlm_jax.load(str(out)).iteration == 10

    flags = ["--use-checkpoint-args", "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-4", "--eval-iters", "0",
             "--no-progress-bar", "--sample-tokens", "0", "--log-interval", "1"]
    logs = []
    summary = train(parse_args(["--load", str(out), "--no-load-optim", "--run-dir", str(tmp_path / "run"), *flags]),
                    log=logs.append)
    assert summary["iterations"] == 12
    assert any("resumed from checkpoint" in str(line) and "iteration 10" in str(line) for line in logs)

    assert train_main(["--load", root, *flags]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: --load {root}: a Megatron-LM checkpoint whose optimizer state mlm_jax "
                           "cannot read: ") and "holds no optimizer state (saved with --no-save-optim)" in last
    assert "--no-load-optim" in last and "--finetune" in last, last


def test_use_checkpoint_args_takes_the_sequence_length_from_the_checkpoint(tmp_path):
    """`train --load <Megatron> --use-checkpoint-args` without --seq-length trains at the
    checkpoint's (64 here, below the default 128 that its 64 positions once refused), as
    Megatron-LM's load_args_from_checkpoint does; a given --seq-length stays."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.train import train

    root = _copy(tmp_path, "gpt", "dist_tp1")
    flags = ["--load", root, "--use-checkpoint-args", "--no-load-optim", "--mock-data", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--train-iters", "11", "--lr", "1e-4", "--eval-iters", "0",
             "--no-progress-bar", "--sample-tokens", "0", "--no-save-optim"]
    logs = []
    summary = train(parse_args(flags + ["--run-dir", str(tmp_path / "run")]), log=logs.append)
    assert summary["iterations"] == 11
    assert any("--use-checkpoint-args: model from" in str(line) and "sequence length 64" in str(line)
               for line in logs), logs
    logs = []
    train(parse_args(flags + ["--seq-length", "16", "--run-dir", str(tmp_path / "run16")]), log=logs.append)
    assert not any("sequence length" in str(line) for line in logs if "--use-checkpoint-args" in str(line)), logs


def test_train_loads_a_megatron_checkpoint_directly(tmp_path, capsys):
    """`train --load <Megatron save root> --no-load-optim` continues at the Megatron iteration with
    its weights (the first step's loss equals the imported copy's), saving into the same folder
    (Megatron's --save = --load); run again, it resumes its own newer checkpoint there, not the
    Megatron one; --finetune starts from the weights at iteration 0."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.tools.checkpoint import main as convert
    from mlm_jax.train import train

    root = _copy(tmp_path, "gpt", "dist_tp1")
    flags = ["--use-checkpoint-args", "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--lr", "1e-4", "--eval-iters", "0", "--no-progress-bar",
             "--sample-tokens", "0", "--log-interval", "1", "--save-interval", "2", "--no-load-optim"]

    def run(load, iters, *extra, save=None):
        logs = []
        capsys.readouterr()
        summary = train(parse_args(["--load", load, "--save", save or str(tmp_path / "s" / str(len(runs))),
                                    "--train-iters", str(iters), "--run-dir", str(tmp_path / f"run{len(runs)}"),
                                    *flags, *extra]), log=logs.append)
        runs.append(logs)
        return summary, [str(line) for line in logs] + capsys.readouterr().out.splitlines()

    runs = []
    out = tmp_path / "imported"
    assert convert(["import-megatron", "--load", root, "--save", str(out)]) == 0
    _, via_import = run(str(out), 12)
    summary, direct = run(root, 12, save=root)  # Megatron's habit: --save = --load
    assert any("Megatron-LM torch_dist checkpoint" in line and "iteration 10" in line for line in direct), direct
    assert any("resumed from checkpoint" in line and "iteration 10" in line for line in direct), direct
    assert summary["iterations"] == 12 and summary["last_iteration"] == 12

    def losses(lines):
        return [line.split("lm loss: ")[1].split(" ")[0] for line in lines if "lm loss: " in line]

    assert losses(direct) and losses(direct) == losses(via_import), (losses(direct), losses(via_import))
    _, again = run(root, 14, save=root)  # our iteration-12 checkpoint beside Megatron's iteration 10
    assert any("resumed from checkpoint" in line and "iteration 12" in line for line in again), again
    assert not any("Megatron-LM torch_dist checkpoint" in line for line in again)
    _, tuned = run(root, 2, "--finetune", "--ckpt-step", "10")
    assert any("weights only (--finetune)" in line for line in tuned), tuned


def test_tokenizer_from_args(tmp_path):
    from mlm_jax.checkpoint.megatron.args import tokenizer_from_args

    missing = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file="/nowhere/vocab.json",
                                 merge_file="/nowhere/merges.txt", tokenizer_model=None)
    assert tokenizer_from_args(missing, str(tmp_path)) is None  # files gone: logits still load
    null = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=99)
    assert tokenizer_from_args(null).vocab_size == 100


def test_import_megatron_bad_load_names_the_flag_and_the_step(tmp_path, capsys):
    from mlm_jax.tools.checkpoint import main as convert

    root = _copy(tmp_path, "gpt", "dist_tp1")
    for argv, want in ((["--load", str(tmp_path / "nope")], f"error: --load {tmp_path / 'nope'}: no such checkpoint folder"),
                       (["--load", root, "--ckpt-step", "7"], "iter_0000007: no such checkpoint folder (--ckpt-step 7)")):
        assert convert(["import-megatron", *argv, "--save", str(tmp_path / "out")]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: --load ") and want in last, last
    assert not (tmp_path / "out").exists()  # nothing written


def _resume_copy(tmp_path):
    dst = tmp_path / "resume"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "llama", "resume_tp1"), dst)
    return str(dst)


RESUME_FLAGS = ["--use-checkpoint-args", "--tensor-model-parallel-size", "2", "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
                "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--min-lr", "1e-4",
                "--lr-warmup-iters", "1", "--lr-decay-iters", "10", "--lr-decay-style", "cosine",
                "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--eval-iters", "0",
                "--no-progress-bar", "--sample-tokens", "0", "--log-interval", "1"]


def test_train_resumes_megatron_cores_optimizer_state(tmp_path, capsys):
    """`train --load <Megatron root>` (no --no-load-optim) on Megatron-Core's fully reshardable
    distributed-optimizer checkpoint: Adam's state restored, iteration 3 -> 4 at the LR Megatron's
    scheduler gives iteration 4."""
    import json

    from mlm_jax.arguments import parse_args
    from mlm_jax.train import train

    want = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "manifest.json")))
    want = want["resume"]["llama"]
    root = _resume_copy(tmp_path)
    logs = []
    summary = train(parse_args(["--load", root, "--save", str(tmp_path / "s"), "--run-dir", str(tmp_path / "run"),
                                *RESUME_FLAGS]), log=logs.append)
    lines = [str(line) for line in logs] + capsys.readouterr().out.splitlines()
    assert any("Adam state (step 3) from its fully reshardable optimizer state" in line for line in lines), lines
    assert any("resumed from checkpoint" in line and "iteration 3, 12 consumed samples; optimizer state restored"
               in line for line in lines), lines
    assert summary["iterations"] == 4 and summary["last_iteration"] == 4
    lr = [line.split("learning rate: ")[1].split(" ")[0] for line in lines if "learning rate: " in line]
    assert lr and abs(float(lr[-1]) - want["next_lr"]) <= 1e-6 * want["next_lr"], (lr, want["next_lr"])


def test_unreadable_megatron_optimizer_states_are_refused_by_name(tmp_path, capsys):
    """Without a readable optimizer state `train --load` stops with one error line naming why and
    --no-load-optim / --finetune: a dp_reshardable distributed optimizer (flat per-bucket
    buffers), the non-distributed optimizer, a legacy checkpoint."""
    from mlm_jax.checkpoint.megatron import read_checkpoint
    from mlm_jax.checkpoint.megatron.optimizer import unreadable_reason
    from mlm_jax.train import main as train_main

    root = _resume_copy(tmp_path)
    common_pt = os.path.join(_iter_dir(root), "common.pt")
    common = _plain_args(root)
    assert unreadable_reason(read_checkpoint(root)) is None
    common["content_metadata"]["distrib_optim_sharding_type"] = "dp_reshardable"
    write_torch_save(common_pt, common)
    assert train_main(["--load", root, "--save", str(tmp_path / "s"), "--run-dir", str(tmp_path / "r"),
                       *RESUME_FLAGS]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: --load {root}: a Megatron-LM checkpoint whose optimizer state mlm_jax cannot "
                           "read: ") and "saved as 'dp_reshardable'" in last and "--dist-ckpt-optim-fully-reshardable" \
        in last and "--no-load-optim" in last and "--finetune" in last, last
    common["args"].use_distributed_optimizer = False
    write_torch_save(common_pt, common)
    assert "args.use_distributed_optimizer is False" in unreadable_reason(read_checkpoint(root))
    legacy = read_checkpoint(_copy(tmp_path, "gpt", "legacy_tp1"))
    assert "legacy ('torch' format) checkpoint" in unreadable_reason(legacy)
