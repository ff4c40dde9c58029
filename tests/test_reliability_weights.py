"""Issue "reliability, round three": HF weights with NaN or infinity, or integer weights, were
imported with exit 0 (generate then emitted token 0, evaluate printed `avg loss: NAN`). Import
refuses them naming the tensor (exit 2), through import-hf and mlm_jax.load; a model whose
activations overflow makes evaluate fail (exit 1) instead of printing a NaN result."""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlm_jax
from mlm_jax.tools import checkpoint as hfc
from mlm_jax.tools.checkpoint import HFError
from tests.gen_util import make_gpt2
from tests.test_evaluate import WIKI
from tests.test_reliability import assert_named_error, cmd


def _edit(folder, key, change):
    path = f"{folder}/model.safetensors"
    w = load_file(path)
    w[key] = change(w[key])
    save_file(w, path, metadata={"format": "pt"})


@pytest.mark.parametrize("change,what", [
    (lambda x: np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x).astype(x.dtype), "1 NaN or infinite"),
    (lambda x: np.full_like(x, np.inf), "NaN or infinite"),
    (lambda x: (x * 100).astype(np.int32), "has dtype int32"),
], ids=["nan", "inf", "int32"])
def test_hf_weights_that_are_not_finite_floats_are_refused(tmp_path, capsys, change, what):
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    _edit(folder, "transformer.h.0.mlp.c_fc.weight", change)
    assert hfc.main(["import-hf", "--hf-dir", folder, "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "'transformer.h.0.mlp.c_fc.weight'" in err and what in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(HFError, match="transformer.h.0.mlp.c_fc.weight"):
        mlm_jax.load(folder)


def test_evaluate_never_prints_a_nan_result(tmp_path):
    """Finite weights whose activations overflow fp32 (the final norm's scale at 3e38: the logits
    overflow): the loss is not finite; evaluate ends with one error line, exit 1, no result."""
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    _edit(folder, "transformer.ln_f.weight", lambda x: np.full_like(x, 3e38))
    (tmp_path / "wiki.tokens").write_text(WIKI)
    rc, out = cmd(["--task", "WIKITEXT103", "--valid-data", tmp_path / "wiki.tokens", "--seq-length", "8",
                   "--overlapping-eval", "4", "--load", folder, "--output-json", tmp_path / "r.json"], tmp_path,
                  module="mlm_jax.evaluate")
    assert_named_error(rc, out, 1, f"--load {folder}", "loss on", "no result is written")
    assert "avg loss" not in out and not (tmp_path / "r.json").exists()


def test_generate_never_prints_tokens_of_non_finite_logits(tmp_path):
    """The same overflowing model through generate: the logits are not finite (they once sampled
    token 0 every step, exit 0); one error line naming --load, exit 1, nothing printed."""
    folder = str(tmp_path / "gpt2")
    make_gpt2(folder)
    _edit(folder, "transformer.ln_f.weight", lambda x: np.full_like(x, 3e38))
    rc, out = cmd(["--load", folder, "--prompt-ids", "1 2 3", "--tokens-to-generate", "4"], tmp_path,
                  module="mlm_jax.generate")
    assert_named_error(rc, out, 1, f"--load {folder}", "not finite (NaN or inf) for prompt 1")
    assert "1 2 3" not in out.replace(f"--load {folder}", "")


@pytest.mark.parametrize("edit,names", [
    ({"n_head": 0}, ["config.json", "n_head 0: a positive integer is expected"]),
    ({"n_head": 3}, ["config.json", "n_embd 32 is not divisible by n_head 3"]),
    ({"n_layer": -1}, ["config.json", "n_layer -1: a positive integer is expected"]),
    ({"n_layer": "two"}, ["config.json", "n_layer 'two': a positive integer is expected"]),
    ({"n_embd": 64}, ["tensor 'transformer.h.0.attn.c_attn.weight' has shape (32, 96)", "(64,3,4,16)"]),
], ids=["n_head 0", "n_head 3", "n_layer -1", "n_layer str", "wrong shapes"])
def test_bad_hf_configs_and_shapes_are_named(tmp_path, capsys, edit, names):
    """Issue "reliability, round three": bad HF configs or tensor shapes ended in a bare
    ZeroDivisionError / ValueError / TypeError (exit 1); now exit 2 naming the key or tensor."""
    import json

    folder = tmp_path / "gpt2"
    make_gpt2(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edit)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert hfc.main(["import-hf", "--hf-dir", str(folder), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and all(n in err for n in names), err
