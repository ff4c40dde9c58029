"""CPU commands keep the host memory a step frees for the next step (`xla_flags.keep_host_memory`,
issue 29); the user's own allocator settings win. The page faults it saves are measured in
benchmarks/RESULTS.md (a whole CLI run is too slow for a test, and a toy program's allocations do
not stand for a step's)."""

from mlm_jax import xla_flags


def test_the_users_allocator_settings_are_left_alone():
    for env in ({"MALLOC_ARENA_MAX": "4"}, {"MALLOC_MMAP_MAX_": "0"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
        assert xla_flags.keep_host_memory({"JAX_PLATFORMS": "cpu", **env}) is False
