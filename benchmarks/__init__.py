"""Benchmarks of ``jaxloss`` and ``torchloss`` against the losses users would pick instead.

``python -m benchmarks.run --quick`` (see ``docs/benchmarks.md``)."""
