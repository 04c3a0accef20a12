"""Test-session set-up: several JAX CPU devices, the Triton interpreter on CPU machines, and a
torch.compile cache of this run's own.

The first two must be set before JAX initialises its backends and before Triton kernels are defined.
"""

import atexit
import os
import shutil
import subprocess
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# torch.compile's on-disk caches (Inductor's and AOTAutograd's) live in a folder of this run, which
# the workers and their subprocesses inherit: a cache left by another checkout held backward graphs
# that called torchloss' custom ops with an older schema (the regrad op's new `final` argument
# failed as "found type 'str'"), and the compile tests must compile the code that is here. Set
# TORCHINDUCTOR_CACHE_DIR to keep a cache across runs.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="parity_tests_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # Device-function calls skip the interpreter's repeated re-patching of triton.language (a
    # quarter of the interpreted kernels' time; same bits: parity_tests/support/triton_interpreter.py).
    from parity_tests.support import triton_interpreter  # noqa: E402

    triton_interpreter.install()


import re  # noqa: E402

import pytest  # noqa: E402

# The hooks of the test processes' lives (an xdist worker's end, JAX's executables shared by the
# run's processes and dropped between files, the workers' crash reports and peak memory): defined
# in parity_tests/support/workers.py, where their tests import them, and registered here by name.
from parity_tests.support.workers import (  # noqa: E402, F401
    longest_first,
    pytest_collection_finish,
    pytest_configure,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_unconfigure,
)

# The fast lane (`pytest -m "not slow"`) leaves out what the developers' guide puts in the slow
# tier: interpreted kernels (Pallas interpret mode, the Triton interpreter), multi-process and
# end-to-end runs, README examples, subprocess CLIs. CI runs everything.
SLOW_FILES = {
    "test_end_to_end.py",
    "test_readme_examples.py",
    "test_distributed_torch.py",
    "test_distributed_torch_tp.py",
    "test_distributed_jax_multiprocess.py",
    "test_distributed_jax.py",  # 8 host devices: shard_map / pmap equivalence suites
    "test_jaxloss_vocab_parallel.py",
    "test_torchloss_vocab_parallel.py",
    "test_parity_cli.py",
    "test_benchmarks_smoke.py",
    "test_torchloss_triton_kernels.py",
    "test_torchloss_triton_vocab_parallel.py",
    "test_torchloss_triton_threads.py",
    "test_torchloss_triton_aot.py",
    # Compile-heavy JAX suites (large-shape chunking and memory, second order, NNX training loops):
    # seconds per test, in the slow tier so that the fast lane stays under two minutes.
    "test_jaxloss_kernels.py",
    "test_jaxloss_derivatives.py",
    "test_jaxloss_nnx.py",
    "test_linear_head_edge.py",  # fused-head edges: a JAX compile per case
    # More JAX compiles per test than the fast lane's two minutes allow (each keeps a cover in
    # another fast file: transforms in test_jaxloss_oracle, the head in test_linear_head, 16-bit
    # rounding in test_torchloss_oracle, per-sequence modes in test_sequence_normalization).
    "test_jaxloss_transforms.py",
    "test_jaxloss_multisteps.py",
    "test_rounding_16bit.py",
    "test_linear_head_sequences.py",
    "test_linear_head_vocab_parallel.py",
    "test_vocab_parallel_mixture_tiles.py",
    "test_torchloss_compile.py",  # torch.compile: Inductor compiles (eager twins: test_torchloss_autograd)
    "test_jaxloss_entropy_jsd.py",  # JAX cover: test_softcap, test_sequence_normalization
    "test_jaxloss_labels.py",
    "test_jaxloss_upstream_16bit.py",
}
_INTERPRETED = re.compile(r"[\[\-_](triton|pallas)[\]\-_]|triton|pallas", re.IGNORECASE)
# The newest matrices keep their float32 cases in the fast lane; their 16-bit variants (the same
# code paths with one more rounding, checked again by test_rounding_16bit.py) run in the slow tier.
FLOAT32_FAST_FILES = {
    "test_jaxloss_oracle.py",
    "test_softcap.py",
    "test_causal_shift.py",
    "test_accumulate_split.py",
    "test_linear_head.py",
    "test_jaxloss_entropy_jsd.py",
    "test_torchloss_entropy_jsd.py",
    "test_sequence_normalization.py",
}
_SIXTEEN_BIT = re.compile(r"bfloat16|float16")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES or _INTERPRETED.search(item.name):
            item.add_marker(pytest.mark.slow)
        elif item.path.name in FLOAT32_FAST_FILES and _SIXTEEN_BIT.search(item.name):
            item.add_marker(pytest.mark.slow)
    longest_first(items)
