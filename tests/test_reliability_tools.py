"""Bad inputs of the command-line tools other than training's flags (preprocess, inspect, the
checkpoint tool, generate, evaluate, serve, and train's --load) end with one `error:` line naming
the flag and the value, exit 2, no traceback; each fails before any model is built:

1. a file where a folder is needed (--load, --hf-dir) or a folder where a file is (--input,
   --valid-data) says which it is, never "no such ...";
2. numbers the tools cannot use: --make-vocab-size-divisible-by < 1 (was ZeroDivisionError),
   --max-shard-size-gb 0 or nan (0 wrote a shard per tensor, nan a ValueError), serve's
   --max-body-mb inf (an OverflowError after the model loaded);
3. generate --prompt-ids with a word that is not a token id names the word (was int()'s text);
4. a sample count whose index cannot fit in memory names --train-samples (was MemoryError);
5. a folder with a config.json but no *.safetensors says the weights are missing.
"""

import pytest

from mlm_jax.data import inspect, preprocess
from mlm_jax.data.indexed_dataset import write_indexed_dataset
from mlm_jax.evaluate import main as evaluate_main
from mlm_jax.generate import main as generate_main
from mlm_jax.serve.command import main as serve_main
from mlm_jax.tools import checkpoint as hfc
from mlm_jax.train import main as train_main
from tests.test_reliability import T, assert_named_error, cmd


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A folder of odd inputs: a plain file, an empty folder, a Hugging Face folder without
    weights, a tiny indexed dataset `ds`."""
    tmp = tmp_path_factory.mktemp("reliability_tools")
    (tmp / "a_file").write_text("not a folder\n")
    (tmp / "a_folder").mkdir()
    (tmp / "hf_no_weights").mkdir()
    (tmp / "hf_no_weights" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}\n')
    write_indexed_dataset(str(tmp / "ds"), [list(range(1, 30))] * 4)
    return tmp


NULL_TOK = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
TRAIN = T + ["--train-iters", "2"]

# (id, entry point, argv (with {d} for the fixture folder), strings the error line must hold)
CASES = [
    ("preprocess --input a folder", preprocess.main,
     ["--input", "{d}/a_folder", "--output-prefix", "{d}/out/x"] + NULL_TOK,
     ["--input", "a_folder", "is a folder, not a file"]),
    ("evaluate --valid-data a folder", evaluate_main,
     ["--task", "LAMBADA", "--valid-data", "{d}/a_folder", "--seq-length", "16", "--load", "{d}/a_folder"],
     ["--valid-data", "a_folder", "is a folder, not a file"]),
    ("import-hf --hf-dir a file", hfc.main, ["import-hf", "--hf-dir", "{d}/a_file", "--save", "{d}/o1"],
     ["--hf-dir", "a_file", "is a file, not a folder"]),
    ("import-megatron --load a file", hfc.main, ["import-megatron", "--load", "{d}/a_file", "--save", "{d}/o3"],
     ["--load", "a_file", "is a file, not a checkpoint folder"]),
    ("export-hf --load a file", hfc.main, ["export-hf", "--load", "{d}/a_file", "--hf-dir", "{d}/o2"],
     ["--load", "a_file", "is a file, not a folder"]),
    ("generate --load a file", generate_main, ["--load", "{d}/a_file", "--prompt-ids", "1"],
     ["--load", "a_file", "is a file, not a folder"]),
    ("serve --load a file", serve_main, ["--load", "{d}/a_file", "--port", "0"],
     ["--load", "a_file", "is a file, not a folder"]),
    ("train --load a file", train_main, TRAIN + ["--load", "{d}/a_file"],
     ["--load", "a_file", "is a file, not a folder"]),
    ("import-hf --make-vocab-size-divisible-by 0", hfc.main,
     ["import-hf", "--hf-dir", "{d}/hf_no_weights", "--save", "{d}/o1", "--make-vocab-size-divisible-by", "0"],
     ["--make-vocab-size-divisible-by", ">= 1", "got 0"]),
    ("import-hf --make-vocab-size-divisible-by -1", hfc.main,
     ["import-hf", "--hf-dir", "{d}/hf_no_weights", "--save", "{d}/o1", "--make-vocab-size-divisible-by", "-1"],
     ["--make-vocab-size-divisible-by", ">= 1", "got -1"]),
    ("export-hf --max-shard-size-gb 0", hfc.main,
     ["export-hf", "--load", "{d}/a_folder", "--hf-dir", "{d}/o2", "--max-shard-size-gb", "0"],
     ["--max-shard-size-gb", "> 0", "got 0.0"]),
    ("export-hf --max-shard-size-gb nan", hfc.main,
     ["export-hf", "--load", "{d}/a_folder", "--hf-dir", "{d}/o2", "--max-shard-size-gb", "nan"],
     ["--max-shard-size-gb", "finite", "got nan"]),
    ("serve --max-body-mb inf", serve_main, ["--load", "{d}/a_folder", "--port", "0", "--max-body-mb", "inf"],
     ["--max-body-mb", "finite", "got inf"]),
    ("generate --prompt-ids abc", generate_main, ["--load", "{d}/a_folder", "--prompt-ids", "1 2 abc"],
     ["--prompt-ids", "'abc' is not a token id"]),
    ("inspect --train-samples 1e15", inspect.main,
     ["--data-path", "{d}/ds", "--split", "100,0,0", "--seq-length", "8", "--show", "0:2",
      "--train-samples", str(10 ** 15)] + NULL_TOK,
     ["--train-samples", "does not fit in memory", str(10 ** 15)]),
    ("generate --load config.json without weights", generate_main,
     ["--load", "{d}/hf_no_weights", "--prompt-ids", "1"],
     ["--load", "hf_no_weights", "config.json but no *.safetensors"]),
]


@pytest.mark.parametrize("main,argv,names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(fx, capsys, main, argv, names):
    rc = main([a.replace("{d}", str(fx)) for a in argv])
    out = capsys.readouterr()
    assert_named_error(rc, out.out + out.err, 2, *names)
    assert not any((fx / o).exists() for o in ("o1", "o2", "o3", "out"))


def test_the_command_line_ends_the_same_way(fx):
    """One subprocess: the real command's last line and exit code, without pytest's capture."""
    rc, out = cmd(["--load", fx / "a_folder", "--prompt-ids", "1 x"], fx, module="mlm_jax.generate")
    assert_named_error(rc, out, 2, "--prompt-ids", "'x' is not a token id")


def test_generate_tensor_parallel_beyond_the_cpu_devices_names_the_variable(fx, tmp_path):
    """Issue "reliability, round three": `generate --tensor-model-parallel-size 2` on one CPU
    device said only "must divide the 1 devices"; the line now names MLM_JAX_CPU_DEVICES."""
    from tests.test_reliability import assert_named_error

    rc, out = cmd(["--load", fx / "a_folder", "--prompt-ids", "1", "--tensor-model-parallel-size", "2"], tmp_path,
                  module="mlm_jax.generate")
    assert_named_error(rc, out, 2, "--tensor-model-parallel-size 2", "1 cpu device", "MLM_JAX_CPU_DEVICES=2")


@pytest.mark.parametrize("module,argv,names", [
    ("mlm_jax.generate", ["--prompt-ids", "1"], ["the following arguments are required: --load"]),
    ("mlm_jax.serve", ["--load", "x", "--port", "abc"], ["--port", "invalid int value: 'abc'"]),
    ("mlm_jax.evaluate", ["--task", "LAMBADA"], ["the following arguments are required", "--valid-data"]),
    ("mlm_jax.tools.checkpoint", ["import-hf"], ["the following arguments are required", "--hf-dir"]),
    ("mlm_jax.tools.checkpoint", ["export-megatron", "--load", "a", "--save", "b", "--ckpt-format", "zarr"],
     ["--ckpt-format", "invalid choice: 'zarr'"]),
    ("mlm_jax.tools.text_generation_cli", [], ["the following arguments are required: address"]),
])
def test_every_tool_s_usage_error_is_one_error_line(tmp_path, module, argv, names):
    """Issue "reliability, round three": generate, serve, evaluate and the checkpoint tools
    printed argparse's usage screen and `python -m ...: error:`; now the one `error:` line (exit
    2) of train."""
    from tests.test_reliability import assert_named_error

    rc, out = cmd(argv, tmp_path, module=module)
    assert_named_error(rc, out, 2, *names)
    assert "usage:" not in out
