"""Worker of the GPU-compile tier (tests/test_gpu_compile.py): compiles each named layout's train
step for 8 H100s, deviceless, in one process started with the XLA flags a GPU run of them sets
(the same for every layout given: XLA reads its flags once per process), and writes each plan
report (or the failure) as JSON.

    python -m tests.gpu_compile_worker OUT.json [--kernel-cache=FILE] NAME=FLAGS...
    (FLAGS: the training flags, one string; FILE: XLA's GPU kernel cache, kept between processes)
"""

import json
import os
import shlex
import sys


def main(out: str, cases: list[str]) -> int:
    from mlm_jax import xla_flags
    from mlm_jax.arguments import parse_args

    if cases and cases[0].startswith("--kernel-cache="):
        os.environ["XLA_FLAGS"] = "--xla_gpu_kernel_cache_file=" + cases.pop(0).split("=", 1)[1]
    configs = {}
    for case in cases:
        name, flags = case.split("=", 1)
        configs[name] = parse_args(shlex.split(flags))
    flag_sets = {name: xla_flags.gpu_flags(cfg.parallel) for name, cfg in configs.items()}
    if len({tuple(f) for f in flag_sets.values()}) > 1:
        sys.exit(f"these layouts' GPU runs set different XLA flags; give each set its own process: {flag_sets}")
    xla_flags.apply(next(iter(configs.values())).parallel, gpu=True)
    import jax

    jax.config.update("jax_platforms", "cpu")
    from mlm_jax.plan import check
    from mlm_jax.plan.compile import compile_step
    from mlm_jax.plan.targets import devices, gpu
    from mlm_jax.validation import finalize

    target = gpu("h100")
    devs = devices(target, 8)
    results = {}
    for name, cfg in configs.items():
        try:
            c = compile_step(finalize(cfg, 8), devs)
            results[name] = check.report(c, target, 8, 8)
        except Exception as e:  # noqa: BLE001 - the test names the failure
            results[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"}
        print(name, "error" if "error" in results[name] else "ok", flush=True)
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    os.environ.pop("XLA_FLAGS", None)  # the CPU test flags are not a GPU run's
    sys.exit(main(sys.argv[1], sys.argv[2:]))
