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
