"""What the ahead-of-time compile tests share (``test_torchloss_triton_aot.py``,
``test_jaxloss_pallas_aot.py``): they compile for sm_80 / sm_90 with the ``ptxas`` that the
``triton`` package bundles, so they skip where there is none. Not a test module."""

from __future__ import annotations

from pathlib import Path

import pytest


def ptxas_available() -> bool:
    """Whether ``triton`` imports and carries its own ``ptxas`` (no GPU needed)."""
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


NEEDS_PTXAS = pytest.mark.skipif(not ptxas_available(), reason="needs triton with its bundled ptxas")
