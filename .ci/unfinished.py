"""After a failed `python -m pytest tests`: were its only failures crashed workers (a native crash,
e.g. inside XLA:CPU, ends the run at once: --max-worker-restart 0)? Then print the test files that
did not finish, to be run once more, and exit 0; exit 1 if any test itself failed (no retry).

Usage: python .ci/unfinished.py OUTCOMES [PATH ...]   (OUTCOMES: the file tests/conftest.py writes,
MLM_JAX_TEST_OUTCOMES; PATHs: what the run was given, default tests)
"""

import subprocess
import sys


def main(path: str, run: list[str]) -> int:
    done, crashed = set(), []
    for line in open(path):
        outcome, nodeid = line.rstrip("\n").split("\t")[:2]
        if outcome == "failed":
            print(f"a test failed ({nodeid}): not run again", file=sys.stderr)
            return 1
        (crashed.append if outcome == "crashed" else done.add)(nodeid)
    if not crashed:
        print("no crashed worker: nothing to run again", file=sys.stderr)
        return 1
    listed = subprocess.run([sys.executable, "-m", "pytest", *run, "--collect-only", "-n", "0"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    collected = [line for line in listed if "::" in line]
    files = sorted({nodeid.split("::")[0] for nodeid in collected if nodeid not in done})
    print(f"crashed while running: {', '.join(crashed)}; not finished: {len(files)} files", file=sys.stderr)
    print(" ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] or ["tests"]))
