"""Test-session set-up: several JAX CPU devices and the Triton interpreter on CPU machines.

Both must be set before JAX initialises its backends and before Triton kernels are defined.
"""

import os
import shutil
import subprocess

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
