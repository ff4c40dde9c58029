"""Checkpoints on the fake 8-device mesh: exact resume, restore onto other layouts, crash safety,
clean exits, load flags and their error messages."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mlm_jax
from mlm_jax import checkpoint as ckpt
from mlm_jax.arguments import parse_args
from mlm_jax.config import ConfigError
from mlm_jax.build import parallelize
from mlm_jax.sharding.mesh import make_mesh
from mlm_jax.train import main, train
from tests.tiny_flags import tiny, train_run, xla_flags_for
from mlm_jax.validation import finalize

# Dropout on, so resuming must restore the dropout stream too. --make-vocab-size-divisible-by 100
# makes the padded vocab depend on the tensor-parallel size (tp4: 800, tp2: 600, tp1: 500 rows),
# so restoring across tp sizes also re-pads the embedding and its Adam moments.
TINY = tiny("--make-vocab-size-divisible-by", "100", "--global-batch-size", "16", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1",
            "--lr", "1e-3", "--peak-flops-per-device", "1e12",
            "--micro-batch-size", "1")  # dp8 unless a layout below overrides
LAYOUT_A = ["--tensor-model-parallel-size", "4", "--use-distributed-optimizer", "--micro-batch-size", "2"]  # dp2
# dp4, no ZeRO; micro 1 keeps A's split of the batch (4 microbatches of 4 rows), hence its dropout masks.
LAYOUT_B = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"]


def run(tmp, name, extra, iters=6):
    summary, records, log = train_run(TINY + ["--train-iters", str(iters)] + extra, tmp / name)
    losses = {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
    summary["valid_losses"] = {r["iteration"]: r["valid_lm_loss"] for r in records if "valid_lm_loss" in r}
    return summary, losses, log


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def straight(tmp):
    """6 iterations on layout A (tp4 x dp2, ZeRO), saving at 3 and 6, evaluating every 2."""
    return run(tmp, "straight", LAYOUT_A + ["--save", str(tmp / "S"), "--save-interval", "3",
                                            "--eval-interval", "2"])


@pytest.fixture(scope="module")
def cfg_a(tmp):
    return finalize(parse_args(TINY + LAYOUT_A + ["--train-iters", "6"]), jax.device_count())


def test_exit_interval_then_exact_resume(straight, tmp, cfg_a):
    """Iterations 4-6 after saving at 3 and resuming are bit-identical to the straight run,
    training and validation losses both."""
    straight_summary, losses, _ = straight
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert sorted(straight_summary["valid_losses"]) == [2, 4, 6]  # Megatron's: none before step 1
    summary, first, log = run(tmp, "exit", LAYOUT_A + ["--save", str(tmp / "E"), "--exit-interval", "3",
                                                       "--eval-interval", "2"])
    assert summary["exit_reason"] == "--exit-interval 3" and summary["last_iteration"] == 3
    assert sorted(first) == [1, 2, 3] and "training blocked" in log
    assert ckpt.scan(str(tmp / "E"))[0] == [3]
    assert [first[i] for i in (1, 2, 3)] == [losses[i] for i in (1, 2, 3)]
    # The straight run saved iteration 3 asynchronously and went on donating its state to the next
    # steps; what it wrote equals what the exiting run wrote after its last step.
    pz = parallelize(cfg_a, make_mesh(cfg_a.parallel))
    quiet = lambda *_: None  # noqa: E731
    a, _ = ckpt.restore_train_state(cfg_a, pz, ckpt.find_checkpoint(str(tmp / "S"), 3), log=quiet)
    b, _ = ckpt.restore_train_state(cfg_a, pz, ckpt.find_checkpoint(str(tmp / "E")), log=quiet)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)

    # --load == --save, the resume-if-any pattern; keep only the newest 2 of the saves at 4, 5, 6.
    summary, resumed, log = run(tmp, "resumed", LAYOUT_A + [
        "--load", str(tmp / "E"), "--save", str(tmp / "E"), "--save-interval", "1", "--keep-last-checkpoints", "2",
        "--eval-interval", "2"])
    assert f"resumed from checkpoint {tmp / 'E' / '3'}: iteration 3, 48 consumed samples" in log, log
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 5, 6)] == [losses[i] for i in (4, 5, 6)]  # bit for bit
    assert summary["valid_losses"] == {i: straight_summary["valid_losses"][i] for i in (4, 6)}
    assert ckpt.scan(str(tmp / "E"))[0] == [5, 6]


def test_resume_onto_another_layout_continues_the_curve(straight, tmp):
    """Saved on tp4 x dp2 with ZeRO, resumed on tp2 x dp4 without: the loss continues (fp32)."""
    _, losses, _ = straight
    summary, resumed, log = run(tmp, "reshard", LAYOUT_B + ["--load", str(tmp / "S"), "--ckpt-step", "3"])
    assert "saved on [data=2 x tensor=4, ZeRO], restored onto [data=4 x tensor=2]" in log, log
    assert sorted(resumed) == [4, 5, 6]
    assert max(abs(resumed[i] - losses[i]) for i in (4, 5, 6)) < 2e-5, (resumed, losses)
    # Without --save the final checkpoint goes into the run folder.
    assert summary["checkpoints"] == [str(tmp / "reshard" / "checkpoints" / "6")]
    assert ckpt.scan(str(tmp / "reshard" / "checkpoints")) == ([6], [])


def _equal_up_to_padding(a, b):
    """Equal where both have values; every row one of them has beyond the other's is zero."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.ndim == b.ndim
    common = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
    np.testing.assert_array_equal(a[common], b[common])
    for x in (a, b):
        rest = x.copy()
        rest[common] = 0
        assert not rest.any()


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2"],  # tp 4 -> 2, dp 2 -> 4, ZeRO off
    ["--use-distributed-optimizer"],  # tp 4 -> 1, dp 2 -> 8, ZeRO on
    ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],  # pipe 1 -> 2
    ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2"],  # cp 1 -> 2
], ids=["tp2dp4", "dp8zero", "pp2tp2", "cp2tp2"])
def test_restore_onto_any_layout_is_exact(straight, tmp, cfg_a, layout):
    """Every parameter and optimizer-state value restored onto another mesh equals the saved one."""
    found = ckpt.find_checkpoint(str(tmp / "S"))
    assert found.iteration == 6
    cfg = finalize(parse_args(TINY + layout + ["--train-iters", "6"]), jax.device_count())
    pz_a = parallelize(cfg_a, make_mesh(cfg_a.parallel))
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    ref, _ = ckpt.restore_train_state(cfg_a, pz_a, found, log=lambda *_: None)
    state, start = ckpt.restore_train_state(cfg, pz, found, log=lambda *_: None)
    assert (start.iteration, start.consumed_samples, int(state["step"])) == (6, 96, 6)
    for tree, shardings in ((state["params"], pz.param_sharding), (state["opt_state"], pz.opt_sharding)):
        got = jax.tree.map(lambda x: x.sharding, tree)
        assert jax.tree.leaves(got) == jax.tree.leaves(shardings)  # this layout's shardings
    for x, y in zip(jax.tree.leaves(pz.plain(state["params"])), jax.tree.leaves(ref["params"])):
        _equal_up_to_padding(x, y)
    for x, y in zip(jax.tree.leaves(pz.plain(state["opt_state"])), jax.tree.leaves(ref["opt_state"])):
        _equal_up_to_padding(x, y)
    # The restored opt_state's LR count and the step agree with the checkpoint's 6 updates.
    assert int(ref["step"]) == 6


def test_interleaved_pipeline_layout_round_trip(tmp):
    """An interleaved pipeline stores layers permuted ([0, 2, 1, 3] here): checkpoints hold the
    plain order, so it restores onto pp=1 (ZeRO) and back onto the pipeline exactly."""
    four = TINY + ["--num-layers", "4", "--train-iters", "6"]
    world = jax.device_count()
    cfg_pp = finalize(parse_args(four + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1"]), world)
    cfg_flat = finalize(parse_args(four + ["--use-distributed-optimizer"]), world)
    pz_pp = parallelize(cfg_pp, make_mesh(cfg_pp.parallel))
    assert not pz_pp.pipeline.layout.is_identity
    state = pz_pp.init(3)
    saver = ckpt.Saver(cfg_pp.replace(checkpoint=dataclasses.replace(cfg_pp.checkpoint, save=str(tmp / "PP"))),
                       pz_pp, None, str(tmp / "pp_run"), ckpt.Start(), log=lambda *_: None)
    saver.save(2, state, 32, jax.random.key_data(jax.random.key(3)))
    saver.close()
    found = ckpt.find_checkpoint(str(tmp / "PP"))
    flat, _ = ckpt.restore_train_state(cfg_flat, parallelize(cfg_flat, make_mesh(cfg_flat.parallel)), found,
                                       log=lambda *_: None)
    for x, y in zip(jax.tree.leaves(pz_pp.plain(state)), jax.tree.leaves(flat)):
        _equal_up_to_padding(x, y)  # vocab rows: 600 with tp2, 500 with tp1
    back, _ = ckpt.restore_train_state(cfg_pp, pz_pp, found, log=lambda *_: None)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(x, y)


def test_load_flags_finetune_no_load_optim_no_load_rng(straight, tmp, cfg_a):
    found = ckpt.find_checkpoint(str(tmp / "S"), 3)
    pz = parallelize(cfg_a, make_mesh(cfg_a.parallel))
    quiet = lambda *_: None  # noqa: E731

    def restore(**flags):
        c = cfg_a.replace(checkpoint=dataclasses.replace(cfg_a.checkpoint, load=str(tmp / "S"), **flags))
        return ckpt.restore_train_state(c, pz, found, log=quiet)

    full, start = restore()
    assert (start.iteration, start.consumed_samples, int(full["step"])) == (3, 48, 3)
    np.testing.assert_array_equal(start.rng_key_data, jax.random.key_data(jax.random.key(1234)))
    fresh = pz.init(1234)["opt_state"]
    moments = lambda o: [np.asarray(x) for x in jax.tree.leaves(o) if np.ndim(x) > 0]  # noqa: E731
    assert any(m.any() for m in moments(full["opt_state"]))  # real Adam moments came back

    tuned, start = restore(finetune=True)
    assert start == ckpt.Start(0, 0, None, found.path) and int(tuned["step"]) == 0
    for x, y in zip(jax.tree.leaves(tuned["params"]), jax.tree.leaves(full["params"])):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(moments(tuned["opt_state"]), moments(fresh)):
        np.testing.assert_array_equal(x, y)

    no_optim, start = restore(load_optim=False)
    assert (start.iteration, int(no_optim["step"])) == (3, 0)
    assert not any(m.any() for m in moments(no_optim["opt_state"]))

    _, start = restore(load_rng=False)  # the run then draws dropout from its own --seed
    assert start.iteration == 3 and start.rng_key_data is None


def test_kill_during_async_save_and_sigterm(tmp):
    """kill -9 while a save is being written: that checkpoint is never loaded; the next start
    resumes from the previous complete one and says which. SIGTERM with --exit-signal-handler
    saves and exits 0, with the tokenizer files in the checkpoint."""
    env = dict(os.environ)  # conftest's 8 fake devices and compilation cache
    tok = tmp / "tok"
    _byte_level_tokenizer(tok)
    base = [sys.executable, "-m", "mlm_jax.train"] + TINY + ["--train-iters", "100000"]
    kdir, tdir = tmp / "K", tmp / "T"
    killed = subprocess.Popen(base + ["--run-dir", str(tmp / "kill"), "--save", str(kdir), "--save-interval", "1"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    termed = subprocess.Popen(base + ["--run-dir", str(tmp / "term"), "--save", str(tdir), "--exit-signal-handler",
                                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                                      "--merge-file", str(tok / "merges.txt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # kill -9: freeze the process when a save is in flight (and a complete one exists), check
        # the save is still uncommitted while frozen, then kill it.
        deadline = time.time() + 240
        caught = None
        while caught is None and time.time() < deadline and killed.poll() is None:
            if os.path.isdir(kdir):
                complete, incomplete = ckpt.scan(str(kdir))
                if complete and incomplete:
                    killed.send_signal(signal.SIGSTOP)
                    complete, incomplete = ckpt.scan(str(kdir))
                    if complete and incomplete:
                        caught = (complete, incomplete)
                        killed.send_signal(signal.SIGKILL)
                    else:
                        killed.send_signal(signal.SIGCONT)
            time.sleep(0.002)
        killed.wait(60)
        assert caught is not None, killed.stdout.read().decode()[-3000:]
        assert killed.returncode == -signal.SIGKILL
        # SIGTERM once the run has trained a few iterations.
        metrics = tmp / "term" / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert termed.poll() is None, termed.stdout.read()[-3000:]
            time.sleep(0.05)
        termed.send_signal(signal.SIGTERM)
        out, _ = termed.communicate(timeout=120)
    finally:
        for p in (killed, termed):
            if p.poll() is None:
                p.kill()
    assert termed.returncode == 0, out[-3000:]
    stopped = int(out.split("> exiting at iteration ")[1].split(":")[0])
    assert f"> exiting at iteration {stopped}: received SIGTERM" in out
    assert ckpt.scan(str(tdir))[0] == [stopped]
    assert {"vocab.json", "merges.txt"} <= set(os.listdir(tdir / str(stopped) / "tokenizer"))
    m = mlm_jax.load(str(tdir))  # the tokenizer came with it
    assert m.iteration == stopped and m.tokenizer.eod == 256 and m.config.vocab_size == 257
    assert m.logits(np.asarray([m.tokenizer.tokenize("def f(): pass")])).shape[-1] == 257

    # The interrupted save is skipped with a message; the latest complete one is loaded.
    assert ckpt.scan(str(kdir)) == caught
    complete, incomplete = caught
    latest = complete[-1]
    summary, losses, log = run(tmp, "after_kill", ["--load", str(kdir), "--save", str(kdir)], iters=latest + 1)
    assert f"ignoring incomplete checkpoint(s) {', '.join(incomplete)}" in log, log
    assert f"resumed from checkpoint {kdir / str(latest)}: iteration {latest}" in log, log
    assert sorted(losses) == [latest + 1]
    assert ckpt.scan(str(kdir)) == ([*complete, latest + 1], [])  # the saver removed the partial one


def _byte_level_tokenizer(folder):
    """GPT-2 style vocab.json/merges.txt: the 256 byte symbols, then <|endoftext|> (id 256)."""
    from tokenizers.pre_tokenizers import ByteLevel

    folder.mkdir()
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")


def test_exit_duration_and_no_save_optim_rng(tmp, cfg_a):
    summary, losses, log = run(tmp, "duration", ["--save", str(tmp / "D"), "--exit-duration-in-mins", "1e-4",
                                                 "--no-save-optim", "--no-save-rng"], iters=5)
    assert summary["exit_reason"] == "--exit-duration-in-mins 0.0001" and sorted(losses) == [1]
    found = ckpt.find_checkpoint(str(tmp / "D"))
    assert found.iteration == 1 and found.meta["rng"] is None and not found.meta["has_optimizer"]
    assert not os.path.exists(os.path.join(found.path, "opt_state"))
    cfg = finalize(parse_args(TINY + ["--train-iters", "5", "--load", str(tmp / "D")]), jax.device_count())
    with pytest.raises(ckpt.CheckpointError, match="has no optimizer state .* add --finetune .* or --no-load-optim"):
        ckpt.restore_train_state(cfg, parallelize(cfg, make_mesh(cfg.parallel)), found, log=lambda *_: None)


def test_load_errors_name_the_problem(straight, tmp, capsys):
    world = jax.device_count()
    # A missing folder: the CLI says so and exits 2.
    assert main(TINY + ["--train-iters", "2", "--load", str(tmp / "nope")]) == 2
    assert f"error: --load {tmp / 'nope'}: no such folder" in capsys.readouterr().err
    # An empty folder: an error, unless it is also --save (then training starts from scratch) ...
    empty = tmp / "empty"
    empty.mkdir()
    cfg = parse_args(TINY + ["--train-iters", "2", "--load", str(empty)])
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint in this folder"):
        ckpt.resolve_load(finalize(cfg, world), log=lambda *_: None)
    logs = []
    cfg = finalize(parse_args(TINY + ["--train-iters", "2", "--load", str(empty), "--save", str(empty)]), world)
    assert ckpt.resolve_load(cfg, log=logs.append)[1] is None and "starting from scratch" in logs[-1]
    # ... and --exit-on-missing-checkpoint makes that an error too.
    cfg = finalize(parse_args(TINY + ["--train-iters", "2", "--load", str(empty), "--save", str(empty),
                                      "--exit-on-missing-checkpoint"]), world)
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint there; exiting .--exit-on-missing"):
        ckpt.resolve_load(cfg)
    # --ckpt-step of an iteration that was not saved lists the ones that were.
    with pytest.raises(ckpt.CheckpointError, match=r"--ckpt-step 4: .* \(complete: \[3, 6\]\)"):
        ckpt.find_checkpoint(str(tmp / "S"), 4)
    # Load flags without --load.
    with pytest.raises(ConfigError, match="--finetune needs --load DIR"):
        finalize(parse_args(TINY + ["--finetune"]), world)
    # A model-shape mismatch names each field and both values, only those that differ and apply
    # (a dense model's expert sizes do not: they only follow the FFN size).
    with pytest.raises(ckpt.CheckpointError, match=r"model differs from this run's: --num-layers: checkpoint 2, "
                                                   r"this run 3; --hidden-size: checkpoint 64, this run 32; .*"
                                                   r"\(pass matching flags, or --use-checkpoint-args") as e:
        train(parse_args(TINY + ["--train-iters", "2", "--load", str(tmp / "S"), "--hidden-size", "32",
                                 "--num-layers", "3", "--run-dir", str(tmp / "mismatch")]), log=lambda *_: None)
    assert "--moe-ffn-hidden-size" not in str(e.value) and "--moe-" not in str(e.value), str(e.value)
    # --use-checkpoint-args takes the sizes from the checkpoint instead.
    cfg = finalize(parse_args(TINY + ["--train-iters", "2", "--load", str(tmp / "S"), "--hidden-size", "32",
                                      "--num-layers", "3", "--use-checkpoint-args"]), world)
    cfg, found = ckpt.resolve_load(cfg, log=lambda *_: None)
    assert (cfg.model.hidden_size, cfg.model.num_layers, found.iteration) == (64, 2, 6)
    # Saving into a folder that holds later checkpoints of another run is refused.
    cfg = finalize(parse_args(TINY + ["--train-iters", "6", "--save", str(tmp / "S")]), world)
    with pytest.raises(ckpt.CheckpointError, match=r"already holds checkpoints of iterations \[3, 6\]"):
        ckpt.Saver(cfg, None, None, str(tmp / "x"), ckpt.Start(), log=lambda *_: None)
    # A Hugging Face folder given to --load points at the converter.
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="Hugging Face model folder.*import-hf"):
        ckpt.find_checkpoint(str(hf))


def test_export_a_trained_checkpoint_from_a_one_device_process(straight, tmp):
    """A checkpoint saved sharded over 8 devices converts in a process with 1 device (the CLI),
    and the exported GPT-2 computes the same logits as the checkpoint."""
    env = {**os.environ, "XLA_FLAGS": xla_flags_for(1)}
    out = tmp / "exported"
    proc = subprocess.run([sys.executable, "-m", "mlm_jax.tools.checkpoint", "export-hf", "--load", str(tmp / "S"),
                           "--ckpt-step", "6", "--hf-dir", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as GPT2LMHeadModel (float32)" in proc.stdout
    config = json.load(open(out / "config.json"))
    assert (config["activation_function"], config["vocab_size"], config["n_layer"]) == ("gelu", 500, 2)
    tokens = np.random.default_rng(0).integers(0, 500, (8, 32))
    np.testing.assert_allclose(mlm_jax.load(str(out)).logits(tokens),
                               mlm_jax.load(str(tmp / "S")).logits(tokens), rtol=1e-6, atol=1e-6)


# -- checkpoints of an older format ---------------------------------------------------------------

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
V1_FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
            "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--no-progress-bar", "--sample-tokens", "0", "--eval-iters", "1", "--log-interval", "1",
            "--peak-flops-per-device", "1e9", "--no-final-checkpoint"]
# The same resume (iteration 2 -> 4, dropout off: its random stream has changed since) run by the
# code that wrote the checkpoint (commit 250d8f5, format 1, one CPU device), with the flags below:
# what the format-2 code must reproduce from it. Iteration 3's loss and gradient check the restored
# parameters and data position, iteration 4's the restored optimizer state as well.
V1_RESUME_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--min-lr", "1e-4",
                   "--lr-decay-style", "cosine", "--train-iters", "4"]
V1_RESUMED = {3: (4.132192134857178, 1.9164550304412842), 4: (4.145040512084961, 1.9765435457229614)}


def test_format_1_checkpoint_restores_renamed_and_resumes_as_its_writer_did(tmp_path):
    """tests/fixtures/checkpoint_v1 was written before parameters were grouped into attention/
    and mlp/ (2 iterations of a tiny GPT, with optimizer state); its params were dumped to
    checkpoint_v1_params.npz by the code that wrote it."""
    from mlm_jax.models import upgrade_params

    folder = tmp_path / "v1"
    import shutil

    shutil.copytree(os.path.join(FIXTURES, "checkpoint_v1"), folder)
    found = ckpt.find_checkpoint(str(folder))
    assert ckpt.saved_version(found.meta) == 1 and ckpt.FORMAT_VERSION == 2
    params = ckpt.restore_host_params(found)
    assert set(params["layers"]["attention"]) == {"wqkv", "bqkv", "wo", "bo"}
    expected = {}
    for path, value in np.load(os.path.join(FIXTURES, "checkpoint_v1_params.npz")).items():
        node = expected
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    expected = upgrade_params(expected, 1)
    assert jax.tree.structure(expected) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    # Resume, optimizer state included (renamed the same way), on one device as it was written.
    env = dict(os.environ, MLM_JAX_CPU_DEVICES="1", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "mlm_jax.train", *V1_FLAGS, *V1_RESUME_FLAGS,
                           "--load", str(folder), "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    got = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}
    assert sorted(got) == [3, 4]
    for iteration, (loss, grad_norm) in V1_RESUMED.items():
        assert abs(got[iteration][0] - loss) <= 1e-6, (iteration, got[iteration], loss)
        assert abs(got[iteration][1] - grad_norm) <= 1e-5, (iteration, got[iteration], grad_norm)


def test_newer_format_is_refused_naming_both_versions(tmp_path):
    import shutil

    folder = tmp_path / "v3"
    shutil.copytree(os.path.join(FIXTURES, "checkpoint_v1"), folder)
    meta_file = folder / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["version"] = 3
    meta_file.write_text(json.dumps(meta))
    env = dict(os.environ, MLM_JAX_CPU_DEVICES="1", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-m", "mlm_jax.train", *V1_FLAGS, "--train-iters", "3",
                           "--load", str(folder), "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the checkpoint has format version 3, newer than this mlm_jax's 2; update mlm_jax to load it")
