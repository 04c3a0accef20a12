"""What the benchmark runs: the backends (ours, the peers, the speed-of-light passes), the shapes
and the per-measurement spec. Framework-free: the runner imports this without JAX or torch."""

from __future__ import annotations

import dataclasses
from typing import Any

import lossspec  # NumPy only

# Every kind of the kind table (lossspec.KIND_SPECS), the ones with teacher logits, short labels.
KINDS: tuple[str, ...] = lossspec.ALL_KINDS
DISTILL: tuple[str, ...] = tuple(kind for kind in KINDS if lossspec.KIND_SPECS[kind].target == "teacher_logits")
# The kinds with integer labels (cross-entropy): their GPU targets are Liger's time and a 1.1x floor.
LABELS: tuple[str, ...] = tuple(kind for kind in KINDS if lossspec.KIND_SPECS[kind].target == "labels")
SHORT_KIND: dict[str, str] = {kind: lossspec.KIND_SPECS[kind].short for kind in KINDS}
# The loss kinds the peers' own functions cover (optax, F.cross_entropy / F.kl_div); the others
# (entropy, jensen_shannon) are written for the eager / compiled peers from their formulas.
PEER_LIBRARY_KINDS: tuple[str, ...] = lossspec.KINDS
DTYPES = ("float32", "bfloat16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

FULL_SHAPES = [(n, v) for n in (1024, 4096, 16384) for v in (32768, 131072)]
QUICK_SHAPES = [(4096, 32768)]
# --head-quick: the fused-head figures (cross-entropy, N=4096 x V=32768, hidden 1024, both dtypes)
HEAD_QUICK_SHAPES = [(4096, 32768)]
HEAD_QUICK_HIDDEN = 1024
GPU_QUICK_SHAPES = [(16384, 131072)]
MASKED_FRACTION = 0.3  # the headline: 30% of the tokens masked (padding, prompts)
# Both ways: torchloss skips the masked rows of 16-bit logits on the CPU (the peers compute them),
# so in those cells every contender is also timed with no token masked (elsewhere, with --all-masks).
MASKED_FRACTIONS = (MASKED_FRACTION, 0.0)
MIN_REPS = 7  # fewer repetitions than this cannot show a spread worth a verdict (the report says so)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One contender.

    role: ``ours`` | ``peer`` | ``sol`` (the speed-of-light pass); group: ``loss`` (the loss on
    given logits) or ``head`` (LM head matmul + cross-entropy, for the fused-head peers);
    ``default_on``: devices where this is the library's default path (``impl="auto"``)."""

    name: str
    framework: str
    role: str
    group: str
    kinds: tuple[str, ...]
    devices: tuple[str, ...]
    label: str
    default_on: tuple[str, ...] = ()
    needs: str = ""  # an optional package; a worker that cannot import it reports "unavailable"
    # Rough peak extra memory in logits-sized buffers (cross-entropy, distillation), measured at
    # N=1024..4096 with a margin; mem_16bit overrides it for bf16/fp16 logits. Only used to skip
    # what cannot fit the machine (an out-of-memory kill on a shared machine hits others too).
    mem: tuple[float, float] = (3.0, 5.0)
    mem_16bit: tuple[float, float] | None = None
    # Rough CPU time of one forward+backward in ns per logits element (teacher elements counted
    # too), measured at 4096 x 32768 on an idle 2-core machine: only for the expected run time.
    cpu_ns: float = 3.0
    # Devices where this path skips the work on masked rows of 16-bit logits (the peers compute
    # them): its cells are measured at 0% masked too.
    skips_masked_16bit: tuple[str, ...] = ()
    # The logits dtypes it applies to (an opt-in 16-bit path: bf16 only).
    dtypes: tuple[str, ...] = tuple(ITEMSIZE)
    # The kinds for which it writes the gradient into the logits' buffer (Liger's cross-entropy,
    # our inplace=True): each of its calls gets fresh logits, copied from pristine ones before the
    # call and outside its timed region (and before its memory baseline), never its own last gradient.
    inplace_kinds: tuple[str, ...] = ()

    def writes_logits(self, kind: str) -> bool:
        return kind in self.inplace_kinds

    def skips_masked(self, dtype: str, device: str) -> bool:
        return device in self.skips_masked_16bit and ITEMSIZE[dtype] == 2

    def applies(self, kind: str, device: str, dtype: str | None = None) -> bool:
        return kind in self.kinds and device in self.devices and (dtype is None or dtype in self.dtypes)


_ALL = KINDS
_CPU_GPU = ("cpu", "gpu")
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        # ---- JAX --------------------------------------------------------------------------
        Backend("jaxloss-xla", "jax", "ours", "loss", _ALL, _CPU_GPU, 'jaxloss impl="xla"', ("cpu",), mem=(1.3, 1.3), mem_16bit=(2.3, 3.8), cpu_ns=2.0),
        Backend("jaxloss-pallas", "jax", "ours", "loss", _ALL, ("gpu",), 'jaxloss impl="pallas"', ("gpu",), mem=(1.3, 1.3)),
        Backend("jaxloss-pallas-inplace", "jax", "ours", "loss", _ALL, ("gpu",),
                'jaxloss impl="pallas", inplace=True, the logits donated (the gradient takes their buffer)', mem=(0.3, 0.3),
                inplace_kinds=_ALL),
        Backend("optax", "jax", "peer", "loss", _ALL, _CPU_GPU,
                "optax softmax_cross_entropy(_with_integer_labels) / kl_divergence (entropy, JSD: from those, by their formulas) under jax.grad", mem=(4.0, 6.0), mem_16bit=(4.0, 11.0), cpu_ns=4.5),
        Backend("jax-sol", "jax", "sol", "loss", _ALL, _CPU_GPU,
                "jitted elementwise pass: reads the logits (and teacher), writes a pre-faulted (donated) logits-sized buffer", mem=(1.1, 1.1), cpu_ns=0.3),
        # ---- torch ------------------------------------------------------------------------
        Backend("torchloss", "torch", "ours", "loss", _ALL, _CPU_GPU, 'torchloss impl="torch"', ("cpu",), mem=(1.3, 1.3), cpu_ns=1.5,
                skips_masked_16bit=("cpu",)),
        Backend("torchloss-triton", "torch", "ours", "loss", _ALL, ("gpu",), 'torchloss impl="triton"', ("gpu",),
                mem=(1.3, 1.3)),
        Backend("torchloss-triton-inplace", "torch", "ours", "loss", _ALL, ("gpu",),
                'torchloss impl="triton", inplace=True (the gradient written into the logits: no logits-sized output)',
                mem=(0.3, 0.3), inplace_kinds=_ALL),
        Backend("torch-eager", "torch", "peer", "loss", _ALL, _CPU_GPU,
                "F.cross_entropy (int or soft targets) / F.kl_div(log_target=True) (entropy, JSD: their formulas in torch ops)", mem=(3.5, 5.5), cpu_ns=5.0),
        Backend("torch-compile", "torch", "peer", "loss", _ALL, _CPU_GPU, "torch.compile of the torch-eager expression",
                mem=(2.0, 2.0), cpu_ns=1.8),
        Backend("liger", "torch", "peer", "loss", ("cross_entropy", "forward_kl"), ("gpu",),
                "Liger-Kernel liger_cross_entropy (writes the gradient into the logits) / liger_kl_div", needs="liger_kernel",
                mem=(1.5, 5.0), inplace_kinds=("cross_entropy",)),
        Backend("flash-attn-ce", "torch", "peer", "loss", ("cross_entropy",), ("gpu",),
                "flash-attn Triton cross_entropy_loss", needs="flash_attn_ce", mem=(2.0, 2.0)),
        Backend("torch-sol", "torch", "sol", "loss", _ALL, _CPU_GPU,
                "elementwise pass: reads the logits (and teacher), writes a pre-faulted logits-sized buffer (out=)", mem=(1.1, 1.1), cpu_ns=0.3),
        # ---- torch, LM head + cross-entropy (the fused-head peers) ------------------------------
        Backend("head-torchloss-fused", "torch", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "torchloss.linear_cross_entropy (the fused head: logits never materialised)", ("cpu", "gpu"),
                mem=(0.3, 0.3), cpu_ns=5.0),
        Backend("head-torchloss-fused-bf16mm", "torch", "ours", "head", ("cross_entropy",), ("gpu",),
                "torchloss.linear_cross_entropy, opted in to bf16 tensor-core matmuls (tuning=HeadTuning("
                "bf16_matmul_devices=('cuda',)): the Triton matmul, G as exact bf16 terms)", mem=(0.3, 0.3), dtypes=("bfloat16",)),
        Backend("head-torchloss-fused-tensor", "torch", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "torchloss.linear_cross_entropy(precision='tensor'): G rounded once to bf16, bf16 x bf16 products "
                "accumulated in fp32 (on the CPU from exact fp32 products)", mem=(0.3, 0.3), cpu_ns=5.0, dtypes=("bfloat16",)),
        Backend("head-torchloss-fused-recompute", "torch", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "torchloss.linear_cross_entropy(recompute_logits=True): the weight gradient formed in the backward, a "
                "vocabulary slice at a time (no fp32 [V, H] accumulator; one more matmul)", mem=(0.3, 0.3), cpu_ns=6.0),
        Backend("head-torchloss", "torch", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "F.linear + torchloss.cross_entropy(inplace=True) (unfused)", mem=(1.3, 1.3), cpu_ns=5.0,
                skips_masked_16bit=("cpu",)),
        Backend("head-eager", "torch", "peer", "head", ("cross_entropy",), _CPU_GPU, "F.linear + F.cross_entropy",
                mem=(3.5, 3.5), cpu_ns=7.0),
        Backend("head-linear_ce", "torch", "peer", "head", ("cross_entropy",), _CPU_GPU,
                "F.linear_cross_entropy (chunked, LinearCrossEntropyOptions())", mem=(1.0, 1.0), cpu_ns=25.0),
        Backend("head-cce", "torch", "peer", "head", ("cross_entropy",), _CPU_GPU,
                "Cut Cross-Entropy linear_cross_entropy (its Triton kernel on a GPU, impl='torch_compile' on the CPU; "
                "filter_eps=None: no gradient filtering)", needs="cut_cross_entropy", mem=(1.0, 1.0), cpu_ns=25.0),
        Backend("head-liger", "torch", "peer", "head", ("cross_entropy",), ("gpu",),
                "Liger-Kernel liger_fused_linear_cross_entropy", needs="liger_kernel", mem=(1.0, 1.0)),
        Backend("head-matmul-sol", "torch", "sol", "head", ("cross_entropy",), _CPU_GPU,
                "the three head matmuls alone (forward, grad of input, grad of weight), into pre-faulted buffers", mem=(1.1, 1.1), cpu_ns=4.0),
        # ---- JAX, LM head + cross-entropy ------------------------------------------------------
        Backend("head-jaxloss-fused", "jax", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "jaxloss.linear_cross_entropy (the fused head: logits never materialised)", ("cpu", "gpu"),
                mem=(0.3, 0.3), cpu_ns=8.0),
        Backend("head-jaxloss-fused-bf16mm", "jax", "ours", "head", ("cross_entropy",), ("gpu",),
                "jaxloss.linear_cross_entropy, opted in to bf16 tensor-core matmuls (tuning=HeadTuning("
                "bf16_matmul_devices=('cuda',)): XLA's dots, G as exact bf16 terms)", mem=(0.3, 0.3), dtypes=("bfloat16",)),
        Backend("head-jaxloss-fused-tensor", "jax", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "jaxloss.linear_cross_entropy(precision='tensor'): G rounded once to bf16, bf16 x bf16 dots with fp32 "
                "results", mem=(0.3, 0.3), cpu_ns=4.0, dtypes=("bfloat16",)),
        Backend("head-jaxloss-fused-recompute", "jax", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "jaxloss.linear_cross_entropy(recompute_logits=True): the weight gradient formed in the backward, a "
                "vocabulary slice at a time (no fp32 [V, H] accumulator; one more matmul)", mem=(0.3, 0.3), cpu_ns=10.0),
        Backend("head-jaxloss", "jax", "ours", "head", ("cross_entropy",), _CPU_GPU,
                "h @ w.T + jaxloss.cross_entropy (unfused)", mem=(2.3, 2.3), cpu_ns=6.0),
        Backend("head-tokamax", "jax", "peer", "head", ("cross_entropy",), _CPU_GPU,
                "tokamax.linear_softmax_cross_entropy_loss (its XLA implementation: the logits materialised; no mask, "
                "every token counted)", needs="tokamax", mem=(2.5, 2.5), cpu_ns=6.0),
        Backend("head-jax-matmul-sol", "jax", "sol", "head", ("cross_entropy",), _CPU_GPU,
                "the three head matmuls alone (forward, grad of input, grad of weight; products accumulated in fp32, "
                "fp32 logits), into donated buffers", mem=(1.1, 1.1), cpu_ns=4.0),
    ]
}


@dataclasses.dataclass
class Spec:
    """One measurement: a backend on one (N, V, dtype, kind) with a fraction ``masked`` of the
    tokens masked (None for the speed-of-light passes, which read no mask). The contenders of
    one cell share a process and are timed in interleaved rounds (see ``_worker.py``)."""

    backend: str
    kind: str
    n: int
    v: int
    dtype: str
    device: str = "cpu"
    hidden: int = 256
    masked: float | None = MASKED_FRACTION
    warmup: int = 1
    reps: int = MIN_REPS
    sol_reps: int = 3  # the speed-of-light pass runs this many times per round: its floor is the best of all
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def info(self) -> Backend:
        return BACKENDS[self.backend]

    @property
    def logits_bytes(self) -> int:
        return self.n * self.v * ITEMSIZE[self.dtype]

    def input_bytes(self) -> int:
        """Inputs held during the measurement (logits, teacher, head weights), in bytes."""
        total = self.logits_bytes
        if self.kind in DISTILL:
            total *= 2
        if self.info.group == "head":
            total = (self.n + self.v) * self.hidden * ITEMSIZE[self.dtype] * 2  # inputs and their grads
        return total

    def estimated_bytes(self) -> int:
        """Rough peak memory: the inputs plus the backend's extra (``mem`` logits-sized buffers)."""
        factors = self.info.mem_16bit if self.info.mem_16bit and ITEMSIZE[self.dtype] == 2 else self.info.mem
        factor = factors[1] if self.kind in DISTILL else factors[0]
        return int(self.input_bytes() + factor * self.logits_bytes)

    def bytes_moved(self) -> int | None:
        """What the speed-of-light pass moves: it reads the logits (and the teacher) and writes a
        logits-sized buffer. None for the head group (dominated by the matmuls)."""
        if self.info.group == "head":
            return None
        return self.logits_bytes * (3 if self.kind in DISTILL else 2)


def floor_bytes(n: int, v: int, dtype: str, kind: str, masked: float) -> int:
    """Bytes of the two-read-one-write floor of a fused forward+backward (issue 32) at N x V with a
    fraction ``masked`` of the tokens masked (``round(masked * n)``, as
    :func:`benchmarks._worker.token_mask`): each valid row reads its logits twice (the statistics,
    then the gradient; the teacher's too for the distillation kinds) and writes its gradient once; a
    masked row only writes zeros. At 16384 x 131072 bf16 with 30% masked: 10.3 GB for
    cross-entropy and entropy, 16.3 GB for the kinds with teacher logits."""
    row = v * ITEMSIZE[dtype]
    masked_rows = int(round(masked * n))
    reads = 2 * (2 if kind in DISTILL else 1)  # logits (and teacher) twice per valid row
    return (n - masked_rows) * row * (reads + 1) + masked_rows * row


def parse_shape(text: str) -> tuple[int, int]:
    try:
        n, v = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape must look like 4096x32768 (tokens x vocabulary); got {text!r}") from None
    if n <= 0 or v <= 0:
        raise ValueError(f"shape dims must be > 0; got {text!r}")
    return n, v


def nominal_hbm_bandwidth(gpu_name: str) -> float | None:
    """Nominal memory bandwidth in bytes/s from the GPU's name (vendor data sheets), or None."""
    name = gpu_name.upper()
    table = [
        ("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIE", 2.0e12), ("H100", 3.35e12),
        ("H800", 3.35e12), ("B200", 8.0e12), ("B100", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIE", 1.935e12),
        ("A100-PCIE-80GB", 1.935e12), ("A100", 1.555e12), ("A800", 2.039e12), ("L40S", 0.864e12), ("L40", 0.864e12),
        ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12),
        ("V100", 0.9e12), ("T4", 0.32e12),
    ]
    for key, bandwidth in table:
        if key in name:
            return bandwidth
    return None
