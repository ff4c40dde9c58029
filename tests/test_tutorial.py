"""The tutorial "GPT-2 from 0 to 1" (docs/tutorial/gpt2.md) runs as written: its commands are read
from the page itself, so the page and this test cannot drift apart.

Every laptop command runs, in order, in one bash script in an empty folder: the files the page says
to save, the corpus, the local GPT-2 BPE, Megatron-flag preprocessing, pretraining to 100 and the
resume to 200, both evaluations, generation, the server queried with curl, the OpenAI SDK and
Megatron's CLI, the exports to Hugging Face and Megatron and back. Left out: the GPT-2 345M
commands shown beside them for a GPU node (Megatron's 345M flags, `plan --gpu`, the GPU run).
The server listens on a free port instead of the page's 5077 and stops at the end. Each step's
expected output is checked. About 3.5 minutes on 2 cores."""

import os
import re
import socket
import subprocess
import sys

PAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "tutorial", "gpt2.md")
_BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _blocks():
    """(language, code, the page's text before it) of each fenced block, in order."""
    text = open(PAGE).read()
    out, at = [], 0
    for m in _BLOCK.finditer(text):
        out.append((m.group(1), m.group(2), text[at:m.start()]))
        at = m.end()
    return out


def _for_a_gpu(code: str, before: str) -> bool:
    """The 345M commands shown beside the laptop's: Megatron's own flags, plan for a GPU, the
    GPU node's run."""
    return "--num-layers 24" in code or "--gpu " in code or before.rstrip().endswith("(`pip install -e \".[cuda12]\"`):")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(workdir: str, port: int) -> str:
    lines = ["set -euo pipefail", "trap 'kill $SERVER 2>/dev/null || true' EXIT", "SERVER="]
    for lang, code, before in _blocks():
        code = code.replace("5077", str(port))
        if lang == "python":
            saved = re.findall(r"[Ss]ave as\s+`([^`]+)`", before)
            assert saved, f"a python block of {PAGE} says no file to save it as:\n{code}"
            with open(os.path.join(workdir, saved[-1]), "w") as f:
                f.write(code)
        elif lang == "bash" and not _for_a_gpu(code, before):
            if "mlm_jax.serve" in code:  # in the background, until it answers
                lines += [code.strip() + " > server.log 2>&1 &", "SERVER=$!",
                          f"for i in $(seq 300); do curl -sf localhost:{port}/health >/dev/null && break; sleep 1; done",
                          f"curl -sf localhost:{port}/health >/dev/null"]
            elif "text_generation_cli" in code:  # Megatron's CLI reads a prompt, then a token count
                lines.append(code.split("#")[0].strip() + " <<< $'def main(\\n8\\n'")
            else:
                lines.append(code)
    return "\n".join(lines) + "\n"


def test_the_gpt2_tutorial_runs_as_written(tmp_path):
    port = _free_port()
    script = _script(str(tmp_path), port)
    assert script.count("python -m mlm_jax.train") == 3  # pretrain, resume, train on from Megatron
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the user's machine: one CPU device, not the tests' fake mesh
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    assert len(losses) >= 6 and losses[-1] < losses[0] - 0.5, losses  # it learns
    assert "> resumed from checkpoint" in out and "iteration      200/     200" in proc.stdout
    assert "validation results on WIKITEXT103 | avg loss:" in proc.stdout
    assert "validation results on LAMBADA | number correct:" in proc.stdout
    assert proc.stdout.count("> continuation 1:") >= 2
    assert "['gpt2-tiny']" in proc.stdout  # the OpenAI SDK's model list
    assert '"text"' in proc.stdout or '"choices"' in proc.stdout  # curl's answers
    assert "hf-gpt2: max |logit difference| 0.0e+00" in proc.stdout
    assert "megatron_ckpt: max |logit difference| 0.0e+00" in proc.stdout
    assert (tmp_path / "from_megatron" / "210").is_dir() and (tmp_path / "imported").is_dir()
