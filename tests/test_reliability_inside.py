"""Issue "reliability, round three", its security rows: every file name read from inside a
checkpoint or a Hugging Face folder resolves inside that folder, else one `error:` line naming
the key and the path (exit 2). A torch_dist `.metadata` whose chunk `relative_path` is absolute
or climbs with `../`, and an HF `model.safetensors.index.json` whose `weight_map` points outside
`--hf-dir`, were followed (`/etc/passwd` opened, another folder's weights loaded). Tested through
both import tools, `train --load` and `mlm_jax.load`; the targets exist, so only the rule stops them.
"""

import json
import os
import shutil

import pytest

import mlm_jax
from mlm_jax.checkpoint.megatron import MegatronCheckpointError
from mlm_jax.paths import inside
from mlm_jax.tools import checkpoint as hfc
from mlm_jax.tools.checkpoint import HFError
from tests.test_reliability import T, assert_named_error, cmd

DATA_FILE = b"__0_0.distcp"  # the chunk file our torch_dist export writes (Megatron-Core's name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny mlm_jax checkpoint, its torch_dist export and its HF export."""
    tmp = tmp_path_factory.mktemp("inside")
    rc, out = cmd(T + ["--train-iters", "1", "--save", tmp / "ck", "--tokenizer-type", "NullTokenizer"], tmp)
    assert rc == 0, out[-3000:]
    assert hfc.main(["export-megatron", "--load", str(tmp / "ck"), "--save", str(tmp / "meg"),
                     "--ckpt-format", "torch_dist"]) == 0
    assert hfc.main(["export-hf", "--load", str(tmp / "ck"), "--hf-dir", str(tmp / "hf")]) == 0
    return tmp


def _metadata(root):
    [it] = [d for d in os.listdir(root) if d.startswith("iter_")]
    return os.path.join(root, it, ".metadata")


@pytest.mark.parametrize("name", [b"/etc//passwd", b"../outside.x"], ids=["absolute", "climbs"])
def test_a_torch_dist_chunk_path_outside_the_checkpoint_is_refused(saved, tmp_path, capsys, name):
    bad = tmp_path / "meg"
    shutil.copytree(saved / "meg", bad)
    meta = _metadata(bad)
    raw = open(meta, "rb").read()
    assert raw.count(DATA_FILE) >= 1 and len(name) == len(DATA_FILE)
    open(meta, "wb").write(raw.replace(DATA_FILE, name))
    (tmp_path / "meg" / "outside.x").write_bytes(open(os.path.join(os.path.dirname(meta), DATA_FILE.decode()), "rb").read())
    shown = name.decode()
    # the import tool
    assert hfc.main(["import-megatron", "--load", str(bad), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and ".metadata" in err and repr(shown) in err and "outside the checkpoint" in err, err
    assert not (tmp_path / "out").exists()
    # mlm_jax.load
    with pytest.raises(MegatronCheckpointError, match="outside the checkpoint folder"):
        mlm_jax.load(str(bad))
    # train --load
    rc, out = cmd(T + ["--train-iters", "2", "--load", bad, "--tokenizer-type", "NullTokenizer"], tmp_path)
    assert_named_error(rc, out, 2, ".metadata", repr(shown), "outside the checkpoint folder")


def test_an_hf_weight_map_outside_the_folder_is_refused(saved, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(saved / "hf", hf)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(str(hf / "model.safetensors"), str(tmp_path / "elsewhere" / "model.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "elsewhere" / "model.safetensors"), framework="np") as f:
        keys = sorted(f.keys())
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "../elsewhere/model.safetensors" for k in keys}}))
    assert hfc.main(["import-hf", "--hf-dir", str(hf), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "model.safetensors.index.json" in err and repr(keys[0]) in err, err
    assert "'../elsewhere/model.safetensors', outside --hf-dir" in err, err
    with pytest.raises(HFError, match="outside --hf-dir"):
        mlm_jax.load(str(hf))
    # a symlink inside the folder that leads out of it is outside too
    (hf / "model.safetensors.index.json").unlink()
    os.symlink(tmp_path / "elsewhere" / "model.safetensors", hf / "model.safetensors")
    with pytest.raises(HFError, match="outside --hf-dir"):
        mlm_jax.load(str(hf))


def test_inside_resolves_names_within_the_folder_only(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    assert inside(str(tmp_path / "a"), "f") == os.path.realpath(tmp_path / "a" / "f")
    assert inside(str(tmp_path / "a"), "sub/../f") == os.path.realpath(tmp_path / "a" / "f")
    assert inside(str(tmp_path / "a"), "../a/f") == os.path.realpath(tmp_path / "a" / "f")  # out and back in
    for name in ("/etc/passwd", "../b", "..", "", ".", "f\0x", None):
        assert inside(str(tmp_path / "a"), name) is None, name


class _Call:
    """Pickles as `fn(*args)` (what a crafted checkpoint holds; unpickled here only by our reader)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads():
    import numpy as np

    from numpy._core import multiarray  # numpy 2 (the installs here); numpy.core in numpy 1

    return {"bytearray": _Call(bytearray, 10 ** 12),
            "ndarray": _Call(np.ndarray, (10 ** 6, 10 ** 6), np.dtype("float64")),
            "reconstruct": _Call(multiarray._reconstruct, np.ndarray, (10 ** 7, 10 ** 6), b"b")}


@pytest.mark.parametrize("kind", ["bytearray", "ndarray", "reconstruct"])
def test_a_pickle_asking_for_a_huge_allocation_is_refused_naming_the_file(saved, tmp_path, capsys, kind):
    """A `.metadata` whose pickle asks an allow-listed constructor for 8 TB: refused before any
    allocation (the bound is the file's own size), one error line naming the file; the same
    pickle holding a small array still loads."""
    import pickle

    import numpy as np

    from mlm_jax.checkpoint.megatron import torch_pickle

    bad = tmp_path / "meg"
    shutil.copytree(saved / "meg", bad)
    meta = _metadata(bad)
    open(meta, "wb").write(pickle.dumps(_payloads()[kind], protocol=2))
    assert hfc.main(["import-megatron", "--load", str(bad), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and meta in err and "more than the file's own" in err, err
    with pytest.raises(MegatronCheckpointError, match="more than the file's own"):
        mlm_jax.load(str(bad))
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert (torch_pickle.unpickle(pickle.dumps(small, protocol=2), None, where="x") == small).all()
    assert torch_pickle.unpickle(pickle.dumps(_Call(bytearray, 4), protocol=2), None, where="x") == bytearray(4)


@pytest.mark.parametrize("content", ["9" * 5000, "\udcff".encode("utf-8", "surrogatepass"), "iter_10"],
                         ids=["5000 digits", "not utf-8", "a folder name"])
def test_a_megatron_tracker_that_is_no_iteration_is_named(saved, tmp_path, capsys, content):
    """latest_checkpointed_iteration.txt with 5000 digits gave int()'s ValueError without the
    file; now one error line naming the file and what it should hold, through the import tool
    and mlm_jax.load."""
    bad = tmp_path / "meg"
    shutil.copytree(saved / "meg", bad)
    tracker = bad / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert hfc.main(["import-megatron", "--load", str(bad), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and str(tracker) in err and "an iteration number" in err, err
    with pytest.raises(MegatronCheckpointError, match="an iteration number"):
        mlm_jax.load(str(bad))
