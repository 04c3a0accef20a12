"""The fused LM head in torch (the torch path): ``linear_<kind>`` for every kind of the table with a head.

``linear_<kind>(hidden [..., H], weight [V, H], <target>, loss_mask, *, bias, ...)`` equals
``<kind>(hidden @ weight.T + bias, ...)`` with the logits in the compute dtype (fp32; fp64 for
fp64 inputs). Signatures, checks and the float64 reference: :mod:`lossspec.linear`; the twin
is ``jaxloss.head``.

How (``R``, ``B`` from :func:`lossspec.linear.head_plan`): the tokens are processed in chunks
of ``R`` rows. When a whole row fits the block budget (``B = V``, the common case) a chunk is
one matmul ``z = h W^T + b`` ``[R, V]``, the block math of the unfused torch path
(:mod:`torchloss._block`) writes the logits' gradient ``G = coef * c * dl/dz`` over ``z`` in
place, then ``dh = G W``, ``dW += G^T h``, ``db += sum G``: three matmuls, no
recompute. Otherwise the chunk runs over vocabulary blocks of ``B`` columns twice with the
block math of :mod:`torchloss._block` (``block_stats``, ``combine``, ``finalize``,
``block_grad``): an online softmax, then each block's gradient from its recomputed logits. A
kind with the mixture pass (``jensen_shannon``, the kind table's ``mixture_pass``) sums its
mixture terms from the rows' final statistics in between (``_block.mixture_sums``: on the
chunk's logits when a row fits, else over the blocks once more, two more matmuls).
16-bit inputs are upcast to fp32 (exact; the weight a slice at a time into one reused buffer,
:class:`WeightRows`) so every product is accumulated in fp32; the fp32 gradients are rounded
once to the parameters' dtypes. (On CUDA, torch's ``allow_tf32`` switches apply to these
matmuls as to any other.) Opt-in (``tuning=lossspec.HeadTuning(bf16_matmul_devices=("cuda",))``): bf16 inputs go to the matmuls
as they are (fp32 results: :func:`mm_f32`) and the backward multiplies the fp32 ``G`` as three
exact bf16 terms (:func:`split_bf16`): the same exact products, accumulated in fp32. On CUDA
these matmuls are one Triton kernel (:mod:`torchloss.backends.triton_matmul`, the split in registers):
through cuBLAS (``out_dtype``) the path was correct on an H200 but slower than fp32 with torch
2.11; the kernel has not run on a GPU yet (docs/linear_head.md).

Differentiation: an autograd Function. Reduced normalisations: the forward computes the fp32
gradients of hidden, weight and bias, the backward scales them by the upstream scalar and
rounds once. ``"none"``: the upstream gradient is per token and enters the weight gradient
inside the sum over tokens, so the backward recomputes the head with ``coef * upstream``.
First order only. Under ``torch.compile`` the head runs eagerly behind one graph break.

``recompute_logits=True`` (:func:`head_backward`): the forward keeps the rows' ``Final``
statistics (``[N]`` vectors) and the backward runs over vocabulary slices, each recomputing the
logits of all tokens chunk by chunk and summing its ``G^T h`` in a ``[B, H]`` buffer of the
compute dtype rounded once into the slice's rows: no ``[V, H]`` gradient in the compute dtype
for a 16-bit weight, one more matmul (two with a teacher).

Vocab parallel (``vocab_parallel=<ProcessGroup>``; :class:`Shards`): the weight is this rank's
``[V_local, H]`` slice; each chunk's shard statistics are combined over the group
(``torchloss.backends.vocab_parallel.combine_shards``: ``[R]`` vectors, never logits) before the local
gradient, and ``dh`` is all-reduced once (docs/linear_head.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Never, Optional

import torch
from torch import Tensor

import lossspec
from lossspec import LossConfig
from lossspec import linear as spec_linear

from . import _autodiff, _block, _prepare, backends
from .backends import torch as _torch, vocab_parallel as _vocab_parallel
from ._block import compute_dtype

__all__ = [
    "linear_cross_entropy",
    "linear_soft_cross_entropy",
    "linear_forward_kl",
    "linear_reverse_kl",
    "linear_entropy",
    "linear_jensen_shannon",
    "LinearHeadFunction",
]

Head = tuple  # (hidden [N, H], weight WeightRows [V, H], bias [V] | None), in the compute dtype


class Shards(NamedTuple):
    """A head split along ``V`` over the ranks of ``group`` (``vocab_parallel``): this rank's
    weight holds the rows ``[offset, offset + V_local)`` of the ``vocab`` rows of the whole head
    (labels are global ids)."""

    group: Any
    offset: int
    vocab: int
    widest: int  # the largest V_local of the group: every rank chunks the tokens alike


def _label_logit(z: Tensor, y: Tensor, first: int) -> Tensor:
    """The label's raw logit where the block of columns ``[first, first + B)`` holds it, else 0
    (``y``: label ids in the numbering of ``first``)."""
    local = y - first
    owned = (local >= 0) & (local < z.shape[1])
    return torch.where(owned, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


def _whole_row(config: LossConfig, local: Any, shards: Optional[Shards], vocab: int) -> Any:
    """The final statistics of whole rows: a shard's statistics are first combined over the
    group (one ``all_gather`` of the maxima, one ``all_reduce`` of the sums for the chunk's rows,
    :func:`torchloss.backends.vocab_parallel.combine_shards`); the global ``V`` enters ``finalize``."""
    if shards is None:
        return _block.finalize(config, local, vocab)
    return _block.finalize(config, _vocab_parallel.combine_shards(config, local, shards.group), shards.vocab)


def _with_mixture(config: LossConfig, fin: Any, sums: Tensor, shards: Optional[Shards]) -> Any:
    """The rows' final statistics with the mixture pass's loss (lossspec.stats), from the sums
    ``[2, R]`` (``kl_qm``, ``kl_pm``) of this head's (or this shard's, then all-reduced) columns."""
    if shards is None:
        return _block.stats.finalize_mixture(torch, config, fin, sums[0], sums[1])
    return _vocab_parallel.reduce_mixture(config, fin, sums, shards.group)


# ``HeadTuning.bf16_matmul_devices``: the devices whose head matmuls read bf16 operands as they
# are (fp32 results) with the backward's ``G`` multiplied as exact bf16 terms. None by default: on
# an H200 with torch 2.11 the head ran slower this way through cuBLAS (16384 x 4096 x 131072 CE:
# 6057 ms against 2445 ms in fp32; ``mm(out_dtype=float32)`` ran at ~20 TFLOP/s, no faster than
# fp32 GEMMs); the Triton kernel that replaced it there (``HeadTuning.triton_matmul_devices``,
# ``("cuda",)`` by default) has not run on a GPU yet. Correct on that GPU
# (parity_tests/test_linear_head_bf16_matmuls.py); ``("cuda",)`` opts in. Elsewhere than on the
# ``triton_matmul_devices`` the bf16 matmuls are ``torch.mm`` (CUDA without Triton: ``out_dtype``;
# the CPU: exact fp32 upcasts); the tests add ``"cpu"`` to run the kernel in the Triton interpreter.


def bf16_matmuls(device: torch.device, tuning: spec_linear.HeadTuning, *dtypes: torch.dtype) -> bool:
    """Whether the head's matmuls read bf16 operands as they are (fp32 results) instead of fp32
    upcasts: on the ``tuning.bf16_matmul_devices`` when every operand is bf16 (with TF32 off,
    torch's default, the fp32 matmuls ran the head at ~30x its bf16 matmuls on an H200). On the CPU
    torch has no bf16 matmul with an fp32 result (``mm``'s ``out_dtype`` has no CPU kernel in torch
    2.13), and rounding the result to bf16 is what the fused head exists to avoid."""
    if device.type not in tuning.bf16_matmul_devices or not all(d == torch.bfloat16 for d in dtypes):
        return False
    if device.type == "cuda":
        return _triton_matmuls(device, tuning) or _cuda_mm_out_dtype(device)
    # Elsewhere each bf16 matmul upcasts its operands (mm_f32), once per call: what the tests use
    # to run the GPU's data flow on the CPU. G as one bf16 term (precision="tensor") takes the fp32
    # flow instead, every operand upcast once, G rounded before its products (_add_head_grads):
    # the same numbers, without a chunk's hidden rows widened again for every weight slice.
    return tuning.split_terms > 1 or _triton_matmuls(device, tuning)


def _triton_matmuls(device: torch.device, tuning: spec_linear.HeadTuning) -> bool:
    """Whether the bf16 matmuls on ``device`` use the Triton kernel (``tuning.triton_matmul_devices``,
    with Triton installed)."""
    if device.type not in tuning.triton_matmul_devices:
        return False
    try:
        from .backends import triton_matmul as _triton_matmul  # noqa: F401
    except ImportError:
        return False
    return True


_MM_OUT_DTYPE: dict[str, bool] = {}


def _cuda_mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch has ``mm(bf16, bf16, out_dtype=float32)`` on ``device`` (probed once;
    without it the head widens to fp32 as on the CPU)."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        probe = torch.ones((16, 16), dtype=torch.bfloat16, device=device)
        try:
            _MM_OUT_DTYPE[key] = bool(torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


def mm_f32(
    a: Tensor, b: Tensor, out: Optional[Tensor] = None, *, accumulate: bool = False, tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING
) -> Tensor:
    """``a @ b`` (``out + a @ b`` with ``accumulate``) in fp32 from bf16 ``b`` and ``a`` bf16, or
    fp32 multiplied as ``tuning.split_terms`` exact bf16 terms (:func:`split_bf16`): each product
    exact, accumulated and returned in fp32 (into ``out`` when given). On the
    ``tuning.triton_matmul_devices`` one Triton kernel (the split in registers); else cuBLAS with
    fp32 compute (``out_dtype``) on CUDA, exact fp32 upcasts elsewhere (the same numbers; the tests
    exercise this path on the CPU)."""
    if a.dtype == torch.float32 and tuning.split_terms == 1:
        # one term: ``a`` rounded to bf16 here, to nearest even on every device (the Triton
        # interpreter's cast in the kernel would truncate); precision="tensor" runs this way
        a = a.to(torch.bfloat16)
    if _triton_matmuls(a.device, tuning):
        from .backends import triton_matmul as _triton_matmul

        return _triton_matmul.matmul_f32(a, b, out, accumulate=accumulate, split_terms=tuning.split_terms)
    terms = split_bf16(a, tuning.split_terms) if a.dtype == torch.float32 else [a]
    if a.is_cuda:
        parts = [torch.mm(term, b, out_dtype=torch.float32) for term in terms]
    else:
        parts = [torch.mm(term.float(), b.float()) for term in terms]
    total = parts[0]
    for part in parts[1:]:
        total += part
    if out is None:
        return total
    return out.add_(total) if accumulate else out.copy_(total)


def split_bf16(g: Tensor, terms: int = spec_linear.HEAD_SPLIT_TERMS) -> list[Tensor]:
    """``g`` fp32 as ``terms`` bf16 tensors whose fp32 sum is ``g``: each term but the last is the
    remainder's top 8 significant bits (its low 16 bits masked off: exact in bf16), the remainder
    after it exact in fp32; three terms carry the whole 24-bit significand. Bit masks, not
    fp32 -> bf16 -> fp32 conversions, which a compiler may fold away (XLA's GPU compiler did)."""
    parts = []
    rest = g
    for _ in range(terms - 1):
        head = (rest.view(torch.int32) & -65536).view(torch.float32)
        parts.append(head.to(torch.bfloat16))
        rest = rest - head
    parts.append(rest.to(torch.bfloat16))
    return parts


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], out: Optional[Tensor], tuning: spec_linear.HeadTuning) -> Tensor:
    """``h @ w.T + b`` ``[R, B]``, contiguous, in the compute dtype (into ``out`` when given);
    bf16 ``h`` and ``w`` (:func:`bf16_matmuls`) give an fp32 result (:func:`mm_f32`)."""
    if h.dtype == torch.bfloat16:
        z = mm_f32(h, w.t(), out, tuning=tuning)
        return z if b is None else z.add_(b)
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)


class WeightRows:
    """A head weight ``[V, H]`` read in the compute dtype, a vocabulary slice at a time: the
    weight itself when it has that dtype, else slices of at most ``slice_rows`` rows upcast
    (exactly) into one reused buffer, so a 16-bit weight never has a whole fp32 copy. (Measured
    at R = 256, V = 32768, H = 1024 bf16 on the CPU: the same forward time, 5% more backward.)"""

    def __init__(self, weight: Tensor, acc: torch.dtype, slice_rows: int, as_is: bool = False) -> None:
        # as_is (bf16 matmuls): slices of the weight itself, no upcast; still sliced, since the
        # backward splits each slice's gradient into bf16 terms (temporaries of its size).
        self.weight, self.acc = weight.detach(), (weight.dtype if as_is else acc)
        self.step = weight.shape[0] if (weight.dtype == acc and not as_is) else max(1, slice_rows)
        self.buf: Optional[Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def slices(self, v0: int, v1: int) -> Any:
        """``(a, b, rows a:b in the compute dtype)`` covering ``[v0, v1)``."""
        if self.weight.dtype == self.acc:
            for a in range(v0, v1, self.step):
                yield a, min(v1, a + self.step), self.weight[a : min(v1, a + self.step)]
            return
        for a in range(v0, v1, self.step):
            b = min(v1, a + self.step)
            if self.buf is None:
                self.buf = torch.empty((self.step, self.weight.shape[1]), dtype=self.acc, device=self.weight.device)
            yield a, b, self.buf[: b - a].copy_(self.weight[a:b])


class _ChunkRows:
    """Rows ``r0:r1`` of hidden states ``[N, H]`` in the matmuls' dtype, for the recompute
    backward's token chunks of ``rows`` rows: the tensor itself when it has that dtype (or the
    bf16 matmuls read it as is), else widened once when one chunk holds every token, else
    widened chunk by chunk into one reused buffer (a fresh tensor per chunk would hold two
    chunks at once, the new one and the one it replaces)."""

    def __init__(self, hidden: Tensor, rows: int, acc: torch.dtype, as_is: bool) -> None:
        self.hidden, self.whole = hidden.detach(), None
        self.buf: Optional[Tensor] = None
        if not (as_is or hidden.dtype == acc):
            if rows >= hidden.shape[0]:
                self.whole = self.hidden.to(acc)
            else:
                self.buf = torch.empty((rows, hidden.shape[1]), dtype=acc, device=hidden.device)

    def __call__(self, r0: int, r1: int) -> Tensor:
        if self.whole is not None:
            return self.whole
        if self.buf is not None:
            return self.buf[: r1 - r0].copy_(self.hidden[r0:r1])
        return self.hidden[r0:r1]


def _head_logits(
    h: Tensor, w: WeightRows, b: Optional[Tensor], v0: int, v1: int, out: Optional[Tensor] = None,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
) -> Tensor:
    """Columns ``[v0, v1)`` of ``h @ w.T + b``, ``[R, v1 - v0]`` (into ``out`` when given;
    ``tuning``: the bf16 matmuls' settings, :func:`mm_f32`)."""
    if out is None:
        out = torch.empty((h.shape[0], v1 - v0), dtype=compute_dtype(h.dtype), device=h.device)
    for a, c, rows in w.slices(v0, v1):
        _logits(h, rows, None if b is None else b[a:c], out[:, a - v0 : c - v0], tuning)
    return out


def _add_head_grads(
    g: Tensor, h: Tensor, w: WeightRows, v0: int, dh: Tensor, dw: Tensor, db: Optional[Tensor], first: bool,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
) -> None:
    """``dh (+)= g W[v0:v1]``, ``dW[v0:v1] += g^T h``, ``db[v0:v1] += sum g`` for the block
    ``g`` ``[R, v1 - v0]`` (``first``: ``dh`` is written, not added to; ``tuning``: the bf16
    matmuls' settings, :func:`mm_f32`)."""
    v1 = v0 + g.shape[1]
    # precision="tensor" on the fp32 flow (bf16_matmuls: the CPU): G rounded once to bf16, as the
    # bf16 matmuls' one term would be, then multiplied exactly in fp32
    round_g = tuning.split_terms == 1 and w.weight.dtype == torch.bfloat16 and g.device.type in tuning.bf16_matmul_devices
    for a, c, rows in w.slices(v0, v1):
        part = g[:, a - v0 : c - v0]
        if rows.dtype == torch.bfloat16:  # bf16 matmuls: G as exact bf16 terms (mm_f32)
            mm_f32(part, rows, dh, accumulate=not first, tuning=tuning)
            mm_f32(part.t(), h, dw[a:c], accumulate=True, tuning=tuning)
        else:
            product = part.to(torch.bfloat16).to(part.dtype) if round_g else part
            if first:
                torch.mm(product, rows, out=dh)
            else:
                dh.addmm_(product, rows)
            dw[a:c].addmm_(product.t(), h)
        first = False
        if db is not None:
            db[a:c] += part.sum(dim=0)


class _Blocks:
    """Scratch blocks reused from token chunk to token chunk: ``take(shape)`` hands out the next
    one (made on first use, as large as the first chunk's), ``reset()`` starts a chunk. A new
    tensor per chunk would be faulted in anew by every chunk (on this CPU writing 1 MiB took 265 us
    into new pages against 15 us into touched ones: ~1 us per 4 KiB page)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.buffers: list[Tensor] = []
        self.used = 0

    def reset(self) -> "_Blocks":
        self.used = 0
        return self

    def take(self, shape: tuple[int, int]) -> Tensor:
        count = shape[0] * shape[1]
        if self.used == len(self.buffers):
            self.buffers.append(torch.empty(count, dtype=self.dtype, device=self.device))
        buffer = self.buffers[self.used]
        self.used += 1
        return buffer[:count].view(shape)


def _chunk_whole(
    config: LossConfig, z: Tensor, t: Optional[Tensor], y: Optional[Tensor], cc: Tensor, need_grad: bool, blocks: _Blocks
) -> tuple[Tensor, Optional[Tensor]]:
    """Rows whose whole vocabulary is one block: the block math of the unfused torch path
    (:mod:`torchloss._block`, as ``torchloss.backends.torch``'s whole-row tiles) with the chunk's logits
    ``z`` as scratch, the gradient written over them. Cross-entropy needs no other block;
    soft CE and forward KL also use ``t`` as scratch (two more blocks); reverse KL reads the
    teacher after the shift, so it takes two fresh blocks. Returns ``(loss [R], G or None,
    the rows' Final statistics)``. A kind with the mixture pass sums its terms on the block
    (from ``block_stats``' cache: ``z`` and ``t`` are scratch by then)."""
    rows, vocab = z.shape
    fresh = lambda: blocks.take((rows, vocab))  # noqa: E731
    x_y = None if y is None else z.gather(1, y[:, None])[:, 0]
    bufs = _block.chunk_buffers(config.kind, z, t, fresh)
    stats, cache = _block.block_stats(config, z, t, bufs, x_y=x_y, slope_buf=fresh() if config.logit_softcap is not None else None)
    fin = _block.finalize(config, stats, vocab)
    if config.mixture_pass:  # its second pass (lossspec.stats), on the cached block
        fin = _with_mixture(config, fin, torch.stack(_block.mixture_sums(config, fin, z, t, cache)), None)
    loss = torch.where(cc != 0, fin.l, 0.0)
    if not need_grad:
        return loss, None, fin
    _block.block_grad(config, fin, cc, z, t, y, 0, vocab, z, [], cache)
    return loss, z, fin


def _chunk_shard(
    config: LossConfig, z: Tensor, t: Optional[Tensor], y: Optional[Tensor], cc: Tensor, need_grad: bool, shards: Shards, blocks: _Blocks
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`_chunk_whole` for a vocabulary shard ``z`` ``[R, V_local]``: its statistics
    (scratch blocks beside ``z`` and ``t``, which stay intact), combined over the group, then
    its gradient from the rows' final statistics written over ``z`` (the shard's exponentials
    are relative to its own maxima, so they are recomputed, not reused)."""
    bufs = [blocks.take(z.shape) for _ in range(_block.buffers_needed(config.kind))]
    x_y = None if y is None else _label_logit(z, y, shards.offset)
    stats, _ = _block.block_stats(config, z, t, bufs, x_y=x_y, slope_buf=blocks.take(z.shape) if config.logit_softcap is not None else None)
    fin = _whole_row(config, stats, shards, z.shape[1])
    if config.mixture_pass:  # the shard's sums from the rows' global lse's, all-reduced
        fin = _with_mixture(config, fin, torch.stack(_block.mixture_sums(config, fin, z, t, None)), shards)
    loss = torch.where(cc != 0, fin.l, 0.0)
    if not need_grad:
        return loss, None, fin
    _block.block_grad(config, fin, cc, z, t, y, shards.offset, shards.vocab, z, bufs, None)
    return loss, z, fin


def _chunk_blocked(
    config: LossConfig, block: int, hc: Tensor, student: Head, teacher: Optional[Head], y: Optional[Tensor], cc: Tensor,
    need_grad: bool, dh: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor], shards: Optional[Shards] = None,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
) -> tuple[Tensor, Any]:
    """Rows ``hc`` over vocabulary blocks of ``block`` columns: pass 1 folds the blocks'
    statistics, pass 2 writes each block's gradient over its recomputed logits and adds its
    products to ``dh`` (this chunk's rows), ``dw`` and ``db``. Returns ``(loss [R], the rows'
    Final statistics)``.
    ``shards``: the weight is a vocabulary shard (columns from ``shards.offset`` on); its folded
    statistics are combined over the group between the two passes."""
    _, w, b = student
    n, vocab = hc.shape[0], w.shape[0]
    offset = 0 if shards is None else shards.offset
    acc = compute_dtype(hc.dtype)
    flat = [torch.empty(n * block, dtype=acc, device=hc.device) for _ in range(_block.buffers_needed(config.kind))]
    stats = _block.empty_stats(config, n, acc, hc.device)
    x_y = None if y is None else torch.zeros(n, dtype=acc, device=hc.device)

    def window(v0: int, v1: int) -> tuple[Tensor, Optional[Tensor]]:
        z = _head_logits(hc, w, b, v0, v1, tuning=tuning)
        t = None if teacher is None else _head_logits(teacher[0], teacher[1], teacher[2], v0, v1, tuning=tuning)
        return z, t

    for v0 in range(0, vocab, block):
        v1 = min(vocab, v0 + block)
        z, t = window(v0, v1)
        if y is not None:
            x_y += _label_logit(z, y, offset + v0)
        part, _ = _block.block_stats(config, z, t, _torch.row_views(flat, n, v1 - v0), x_y=None if y is None else torch.zeros_like(x_y))
        stats = _block.combine(config, stats, part)
    if y is not None:
        stats = stats._replace(x_y=x_y)
    fin = _whole_row(config, stats, shards, vocab)
    if config.mixture_pass:
        # The second pass (lossspec.stats): log M needs the rows' global lse's of pass 1.
        sums = torch.zeros((2, n), dtype=acc, device=hc.device)
        for v0 in range(0, vocab, block):
            z, t = window(v0, min(vocab, v0 + block))
            kl_qm, kl_pm = _block.mixture_sums(config, fin, z, t, None)
            sums[0] += kl_qm
            sums[1] += kl_pm
        fin = _with_mixture(config, fin, sums, shards)
    loss = torch.where(cc != 0, fin.l, 0.0)
    if not need_grad:
        return loss, fin
    assert dh is not None and dw is not None
    dh.zero_()
    for v0 in range(0, vocab, block):
        v1 = min(vocab, v0 + block)
        z, t = window(v0, v1)
        _block.block_grad(config, fin, cc, z, t, y, offset + v0, vocab if shards is None else shards.vocab, z, _torch.row_views(flat, n, v1 - v0), None)
        _add_head_grads(z, hc, w, v0, dh, dw, db, False, tuning)
    return loss, fin


def head_forward(
    config: LossConfig,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Optional[Tensor],
    teacher: Optional[tuple],
    coef: Tensor,
    *,
    need_grad: bool,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
    shards: Optional[Shards] = None,
    keep_final: bool = False,
) -> tuple:
    """Per-token loss and the gradients of the head, in the compute dtype.

    Args:
      config: the call's options.
      hidden: ``[N, H]``; weight ``[V, H]``; bias ``[V]`` or ``None``.
      labels: safe labels ``[N]`` int64 (cross-entropy) or ``None``.
      teacher: ``(teacher_hidden [N, Ht], teacher_weight [V, Ht], teacher_bias | None)`` or ``None``.
      coef: ``[N]`` per-token coefficient (compute dtype).
      need_grad: also compute the gradients.
      tuning: the call's :class:`lossspec.HeadTuning`: the plan's budget ``block_elements``,
        ``blocked_rows`` (:func:`lossspec.linear.head_plan`) and the opt-in bf16 matmuls
        (``bf16_matmul_devices``, ``triton_matmul_devices``, ``split_terms``).
      shards: ``vocab_parallel``: ``weight`` ``[V_local, H]`` (and bias, the teacher's weight and
        bias) is this rank's contiguous slice of the head along ``V`` (Megatron's column-parallel
        head), ``hidden`` is the same on every rank of ``shards.group``, labels are global ids.
        Each chunk computes the shard's statistics from its local logits, combines them over the
        group (``[R]`` vectors, never the logits), then the local gradient; ``dh`` is summed over
        the group once at the end (``all_reduce``); ``dW``, ``db`` stay local.
      keep_final: (without ``need_grad``) also return the rows' ``Final`` statistics, what
        :func:`head_backward` needs (``recompute_logits``).

    Returns:
      ``(l [N], dh [N, H], dW [V, H], db [V] | None)``: the per-token loss (0 where
      ``coef == 0``, not multiplied by ``coef``) and, with ``need_grad``, the gradients of
      ``sum_i coef_i l_i`` (``G = coef * c * dl/dz``: ``dh = G W``, ``dW = G^T h``, ``db = sum G``;
      with ``shards``, ``dW`` and ``db`` of the local slice and ``dh`` the whole ``sum_k G_k W_k``).
      With ``keep_final``: ``(l [N], Final of [N] vectors)``.
    """
    n, width = hidden.shape
    vocab = weight.shape[0]
    acc = compute_dtype(hidden.dtype)
    device = hidden.device
    rows, block = _plan(config, hidden, weight, tuning, shards)
    # A 16-bit weight is read in fp32 slices whose buffer is at most a quarter block (WeightRows).
    slice_rows = max(1, (rows * block) // (4 * max(1, width)))
    up = lambda a: None if a is None else a.detach().to(acc)  # noqa: E731  (16-bit: exact)
    operands = [hidden.dtype, weight.dtype] + ([] if teacher is None else [teacher[0].dtype, teacher[1].dtype])
    as_is = bf16_matmuls(device, tuning, *operands)
    rows_in = (lambda a: a.detach()) if as_is else up  # the matmuls' hidden rows
    student = (None, WeightRows(weight, acc, slice_rows, as_is), up(bias))
    teacher_acc = None if teacher is None else (None, WeightRows(teacher[1], acc, slice_rows, as_is), up(teacher[2]))
    loss = torch.zeros(n, dtype=acc, device=device)
    final: dict[str, Tensor] = {}
    dh = torch.empty((n, width), dtype=acc, device=device) if need_grad else None
    dw = torch.zeros((vocab, width), dtype=acc, device=device) if need_grad else None
    db = torch.zeros(vocab, dtype=acc, device=device) if (need_grad and bias is not None) else None
    z_buf: Optional[Tensor] = None
    blocks = _Blocks(acc, device)
    t_buf: Optional[Tensor] = None
    with torch.no_grad(), _torch.no_autocast(device):
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            hc = rows_in(hidden[r0:r1])
            cc = coef[r0:r1]
            y = None if labels is None else labels[r0:r1]
            tt = None
            if teacher is not None:
                tt = (rows_in(teacher[0][r0:r1]),) + teacher_acc[1:]
            dh_c = None if dh is None else dh[r0:r1]
            if block < vocab:
                loss[r0:r1], fin = _chunk_blocked(config, block, hc, student, tt, y, cc, need_grad, dh_c, dw, db, shards, tuning)
                if keep_final:
                    _keep_final(final, fin, n, r0)
                continue
            # One buffer per chunk role, reused: a fresh one per chunk would hold two chunks'
            # logits at once (the previous chunk's until its name is rebound).
            if z_buf is None:
                z_buf = torch.empty(rows * vocab, dtype=acc, device=device)
                t_buf = None if tt is None else torch.empty(rows * vocab, dtype=acc, device=device)
            z = _head_logits(hc, student[1], student[2], 0, vocab, z_buf[: (r1 - r0) * vocab].view(r1 - r0, vocab), tuning)
            t = None if tt is None else _head_logits(*tt, 0, vocab, t_buf[: (r1 - r0) * vocab].view(r1 - r0, vocab), tuning)
            if shards is None:
                part, g, fin = _chunk_whole(config, z, t, y, cc, need_grad, blocks.reset())
            else:
                part, g, fin = _chunk_shard(config, z, t, y, cc, need_grad, shards, blocks.reset())
            loss[r0:r1] = part
            if keep_final:
                _keep_final(final, fin, n, r0)
            if g is not None:
                _add_head_grads(g, hc, student[1], 0, dh_c, dw, db, True, tuning)
        if shards is not None and dh is not None and n > 0:
            # hidden feeds every shard: its gradient is the sum of the shards' G_k W_k.
            import torch.distributed as dist

            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the stored gradient's
    if keep_final:
        return loss, _block.Final(**final)
    return loss, dh, dw, db


def _softcapped(config: LossConfig) -> bool:
    """Whether a soft cap of the student or the teacher is set (more live blocks: ``_block.head_live_blocks``)."""
    return config.logit_softcap is not None or config.teacher_logit_softcap is not None


def _plan(config: LossConfig, hidden: Tensor, weight: Tensor, tuning: spec_linear.HeadTuning, shards: Optional[Shards]) -> tuple[int, int]:
    """``(R, B)`` of :func:`lossspec.linear.head_plan` (of the widest shard with ``shards``) for
    these inputs: the blocks fit 1/8 of the logits buffer in the inputs' dtype (half as many
    fp32 elements for 16-bit), or ``tuning.block_elements``; ``tuning.blocked_rows``."""
    block_elements, blocked_rows = tuning.block_elements, spec_linear.head_blocked_rows(tuning)
    n, vocab = hidden.shape[0], weight.shape[0]
    live = _block.head_live_blocks(config.kind, shards is not None, _softcapped(config))
    sizes = (torch.promote_types(hidden.dtype, weight.dtype).itemsize, compute_dtype(hidden.dtype).itemsize)
    if shards is None:
        whole = _block.head_live_blocks(config.kind, False, _softcapped(config), whole_rows=True)
        return spec_linear.head_plan(n, vocab, block_elements, blocked_rows, live, *sizes, whole_row_live_blocks=whole)
    return spec_linear.head_plan_shard(n, vocab, shards.widest, block_elements, blocked_rows, live, *sizes)


def _keep_final(final: dict[str, Tensor], fin: Any, n: int, r0: int) -> None:
    """Rows ``r0 :`` of the ``[N]`` buffers in ``final`` (made on first use) take the chunk's
    :class:`Final` statistics ``fin``."""
    for name, value in fin._asdict().items():
        if value is not None:
            if name not in final:
                final[name] = torch.empty(n, dtype=value.dtype, device=value.device)
            final[name][r0 : r0 + value.shape[0]] = value


def head_backward(
    config: LossConfig,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Optional[Tensor],
    teacher: Optional[tuple],
    coef: Tensor,
    final: Any,
    *,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
    shards: Optional[Shards] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The gradients of ``sum_i coef_i l_i`` from the rows' statistics (``recompute_logits``).

    The vocabulary is the outer loop: for each slice of ``B`` columns the logits of all tokens
    are recomputed chunk by chunk (``[R, B]`` blocks, :func:`lossspec.linear.head_plan_recompute`),
    ``G = coef * c * dl/dz`` follows from ``final`` (``_block.block_grad``), ``dh += G W_slice``
    and the slice's ``dW = G^T h`` is summed over all tokens in the compute dtype ``[B, H]``,
    then rounded once to the weight's dtype and written. No ``[V, H]`` buffer in the compute
    dtype exists for a 16-bit weight; one more matmul than :func:`head_forward` with
    ``need_grad`` (two with a teacher).

    Args:
      config, hidden, weight, bias, labels, teacher, tuning, shards: as for :func:`head_forward`
        (the same plan's budget; ``tuning.recompute_plan``: this pass's ``(R, B)`` instead of the
        planned ones).
      coef: ``[N]``, the per-token coefficient times the upstream gradient (compute dtype).
      final: the rows' ``Final`` statistics (``head_forward(..., keep_final=True)``).

    Returns:
      ``(dh [N, H] compute dtype, dW [V, H] in weight.dtype, db [V] in bias.dtype | None)``;
      with ``shards``, ``dh`` summed over the group, ``dW`` and ``db`` of the local slice.
    """
    n, width = hidden.shape
    vocab = weight.shape[0]
    acc = compute_dtype(hidden.dtype)
    device = hidden.device
    plan_rows, plan_block = _plan(config, hidden, weight, tuning, shards)
    # The forward's live blocks' elements, shared by this pass's blocks (the logits, the
    # teacher's, block_grad's scratch: none for cross-entropy, whose gradient forms in place)
    # and [B, H] slices (the gradient, the widened weight rows, the teacher's).
    scratch = _block.grad_scratch_blocks(config.kind)
    blocks = 1 + (teacher is not None) + scratch
    live = _block.head_live_blocks(config.kind, shards is not None, _softcapped(config), whole_rows=plan_block == vocab)
    operands = [hidden.dtype, weight.dtype] + ([] if teacher is None else [teacher[0].dtype, teacher[1].dtype])
    as_is = bf16_matmuls(device, tuning, *operands)
    # 16-bit hidden states: the fp32 dh [N, H] and each chunk's rows widened to fp32 share the
    # budget too (fp32 inputs: dh is the result, rows are not copied).
    budget = spec_linear.head_recompute_budget(plan_rows * plan_block * live, n, width, hidden.dtype != acc)
    row_elements = 0 if as_is else sum(h.shape[1] for h in (hidden, None if teacher is None else teacher[0]) if h is not None and h.dtype != acc)
    rows, cols = tuning.recompute_plan or spec_linear.head_plan_recompute(n, vocab, width, budget, blocks, 2 + (teacher is not None), row_elements)
    rows, cols = min(rows, max(1, n)), min(cols, max(1, vocab))
    student_rows = WeightRows(weight, acc, cols, as_is)
    teacher_rows = None if teacher is None else WeightRows(teacher[1], acc, cols, as_is)
    offset, vocab_total = (0, vocab) if shards is None else (shards.offset, shards.vocab)
    dh = torch.zeros((n, width), dtype=acc, device=device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=device)
    db = None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device=device)
    dw_j = torch.empty((cols, width), dtype=acc, device=device)
    db_j = None if bias is None else torch.empty(cols, dtype=acc, device=device)
    flat = [torch.empty(rows * cols, dtype=acc, device=device) for _ in range(blocks)]
    with torch.no_grad(), _torch.no_autocast(device):
        hidden_rows = _ChunkRows(hidden, rows, acc, as_is)
        teacher_rows_in = None if teacher is None else _ChunkRows(teacher[0], rows, acc, as_is)
        for v0 in range(0, vocab, cols):
            v1 = min(vocab, v0 + cols)
            # This slice's weight rows in the matmuls' dtype, read once for all token chunks.
            w_j = WeightRows(next(student_rows.slices(v0, v1))[2], acc, cols, as_is)
            b_j = None if bias is None else bias[v0:v1].to(acc)
            t_j = None
            if teacher is not None:
                assert teacher_rows is not None
                t_b = None if teacher[2] is None else teacher[2][v0:v1].to(acc)
                t_j = (WeightRows(next(teacher_rows.slices(v0, v1))[2], acc, cols, as_is), t_b)
            dw_j.zero_()
            if db_j is not None:
                db_j.zero_()
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                views = _torch.row_views(flat, r1 - r0, v1 - v0)
                hc = hidden_rows(r0, r1)
                z = _head_logits(hc, w_j, b_j, 0, v1 - v0, views[0], tuning)
                t = None
                if t_j is not None:
                    assert teacher is not None
                    assert teacher_rows_in is not None
                    tc = teacher_rows_in(r0, r1)
                    t = _head_logits(tc, t_j[0], t_j[1], 0, v1 - v0, views[1], tuning)
                fin = _block.Final(**{name: None if value is None else value[r0:r1] for name, value in final._asdict().items()})
                y = None if labels is None else labels[r0:r1]
                _block.block_grad(config, fin, coef[r0:r1], z, t, y, offset + v0, vocab_total, z, views[1 + (t is not None) :], None)
                _add_head_grads(z, hc, w_j, 0, dh[r0:r1], dw_j[: v1 - v0], None if db_j is None else db_j[: v1 - v0], False, tuning)
            # The one rounding of the slice's gradients.
            dw[v0:v1] = dw_j[: v1 - v0]
            if db is not None:
                db[v0:v1] = db_j[: v1 - v0]
        if shards is not None and n > 0:
            import torch.distributed as dist

            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the recompute backward's
    return dh, dw, db


def _save_inputs(
    ctx: Any, config: LossConfig, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Optional[Tensor],
    t_hidden: Optional[Tensor], t_weight: Optional[Tensor], t_bias: Optional[Tensor], coef: Tensor,
) -> None:
    """Keep the inputs that a backward recomputing the head reads (``recompute_logits``, and
    ``"none"``) through autograd's saved tensors: an in-place update between forward and backward
    (an optimizer step on the weight) then raises autograd's "modified by an inplace operation"
    error instead of giving gradients of the new values."""
    ctx.config = config
    ctx.save_for_backward(hidden, weight, bias, labels, t_hidden, t_weight, t_bias, coef)


def _saved_inputs(ctx: Any) -> tuple[tuple[Any, ...], Tensor]:
    """``((config, hidden, weight, bias, labels, teacher), coef)`` of :func:`_save_inputs`
    (autograd checks their versions here)."""
    hidden, weight, bias, labels, t_hidden, t_weight, t_bias, coef = ctx.saved_tensors
    teacher = None if t_hidden is None else (t_hidden, t_weight, t_bias)
    return (ctx.config, hidden, weight, bias, labels, teacher), coef


class LinearHeadFunction(torch.autograd.Function):
    """Autograd Function of the ``linear_*`` losses.

    ``forward(hidden [N, H], weight, bias, labels, teacher_hidden, teacher_weight,
    teacher_bias, coef, config, need_grad, plan, shards)`` returns ``sum_i coef_i l_i``
    (reduced) or the per-token ``coef_i l_i`` (``"none"``) in the compute dtype. ``plan``:
    :class:`lossspec.linear.HeadPlan`; ``shards``:
    :class:`Shards` (``vocab_parallel``) or ``None``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Optional[Tensor], t_hidden: Optional[Tensor],
        t_weight: Optional[Tensor], t_bias: Optional[Tensor], coef: Tensor, config: LossConfig, need_grad: bool, plan: spec_linear.HeadPlan,
        shards: Optional[Shards], anchor: Optional[Tensor] = None,
    ) -> Tensor:
        reduced = config.normalization != "none"
        ctx.anchor = anchor
        teacher = None if t_hidden is None else (t_hidden, t_weight, t_bias)
        args = (config, hidden, weight, bias, labels, teacher)
        ctx.recompute, ctx.dtypes = plan.recompute_logits, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        if plan.recompute_logits:  # recompute_logits: the rows' statistics only; the backward computes the gradients
            per_token, final = head_forward(*args, coef, need_grad=False, tuning=plan.tuning, shards=shards, keep_final=True)
            if need_grad:
                _save_inputs(ctx, config, hidden, weight, bias, labels, t_hidden, t_weight, t_bias, coef)
                ctx.final, ctx.plan, ctx.shards = final, plan, shards
            contribution = torch.where(coef != 0, coef * per_token, 0.0)
            return contribution.sum() if reduced else contribution
        per_token, dh, dw, db = head_forward(
            *args, coef, need_grad=need_grad and reduced, tuning=plan.tuning, shards=shards
        )
        ctx.reduced = reduced
        ctx.grads = (dh, dw, db)
        if need_grad and not reduced:  # "none": the backward recomputes with coef * upstream
            _save_inputs(ctx, config, hidden, weight, bias, labels, t_hidden, t_weight, t_bias, coef)
            ctx.plan, ctx.shards = plan, shards
        contribution = torch.where(coef != 0, coef * per_token, 0.0)
        return contribution.sum() if reduced else contribution

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        create_graph = torch.is_grad_enabled()  # backward(create_graph=True)
        with torch.no_grad():
            grads = LinearHeadFunction._gradients(ctx, grad_loss)
        if create_graph:  # first order only: differentiating these raises (torchloss.api)
            grads = _autodiff.first_order_only(grads, ctx.anchor)
        return grads + (None,) * 10

    @staticmethod
    def _gradients(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """``(dh, dw, db)`` in the inputs' dtypes for the upstream gradient ``grad_loss``."""
        if ctx.recompute:  # the gradients of sum_i coef_i g_i l_i, dW and db already rounded
            args, coef = _saved_inputs(ctx)
            scaled = torch.where(coef != 0, coef * grad_loss.reshape(-1).to(coef.dtype), 0.0)
            dh, dw, db = head_backward(
                *args, scaled, ctx.final, tuning=ctx.plan.tuning, shards=ctx.shards,
            )
            return (dh.to(ctx.dtypes[0]), dw, db)
        if ctx.reduced:
            dh, dw, db = ctx.grads
            scale: Any = grad_loss.to(dh.dtype)
        else:
            args, coef = _saved_inputs(ctx)
            scaled = torch.where(coef != 0, coef * grad_loss.reshape(-1).to(coef.dtype), 0.0)
            _, dh, dw, db = head_forward(
                *args, scaled, need_grad=True, tuning=ctx.plan.tuning, shards=ctx.shards
            )
            scale = None
        # Scaled in place unless the graph is kept for another backward (retain_graph=True),
        # then the one rounding of each gradient to its parameter's dtype.
        keep = ctx.reduced and _autodiff.graph_is_kept()
        if ctx.reduced and not keep:
            ctx.grads = None

        def cast(a: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
            if a is None:
                return None
            if scale is not None:
                a = a * scale if keep else a.mul_(scale)
            return a.to(dtype)

        h_dtype, w_dtype, b_dtype = ctx.dtypes
        return (cast(dh, h_dtype), cast(dw, w_dtype), cast(db, b_dtype))


# --------------------------------------------------------------------------------------------
# Public functions: the unfused losses' argument handling (torchloss.api) on stand-ins of the
# logits, which are never formed
# --------------------------------------------------------------------------------------------


def _stand_in(lead: tuple[int, ...], vocab: int, like: Tensor) -> Tensor:
    """A ``[..., V]`` tensor of ``like``'s dtype and device that holds only ``V`` elements (a
    broadcast row): what the unfused checks and ``_prepare`` read of the logits is their shape,
    dtype and device."""
    return torch.zeros(vocab, dtype=like.dtype, device=like.device).expand(*lead, vocab)


def _optional(name: str, value: Any) -> Optional[Tensor]:
    return None if value is None else _prepare.require_tensor(name, value)


def _check_devices(hidden: Tensor, named: dict[str, Optional[Tensor]]) -> None:
    for name, tensor in named.items():
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(spec_linear.device_message(name, tensor.device, hidden.device))


def _widest_shard(vocab_local: int, group: Any, device: torch.device) -> int:
    """The largest ``V_local`` of the group (one ``all_reduce(MAX)`` and a host read): the
    shards' token chunks must agree (:func:`lossspec.linear.head_plan_shard`)."""
    import torch.distributed as dist

    widest = torch.tensor([vocab_local], dtype=torch.int64, device=device)
    dist.all_reduce(widest, op=dist.ReduceOp.MAX, group=group)
    return int(widest.item())


@torch.compiler.disable(reason="torchloss.head runs eagerly (one graph break)")
def _linear_loss(kind: str, **args: Any) -> Tensor:
    """Body of the ``linear_*`` functions (signatures: :mod:`lossspec.linear`)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    # jensen_shannon at beta = 0 / 1 is computed as forward / reverse KL, exactly (LossConfig.formula).
    config = lossspec.make_config(kind, normalization=args["normalization"], **options).kernel_config()
    tuning = lossspec.check_head_tuning(args["tuning"])
    ce = config.has_labels
    hidden, weight = _prepare.require_tensor("hidden", args["hidden"]), _prepare.require_tensor("weight", args["weight"])
    bias = _optional("bias", args["bias"])
    teacher = None
    if spec.has_teacher:
        teacher = (
            _prepare.require_tensor("teacher_hidden", args["teacher_hidden"]),
            _prepare.require_tensor("teacher_weight", args["teacher_weight"]),
            _optional("teacher_bias", args["teacher_bias"]),
        )
    meta = lambda a: None if a is None else _prepare.array_meta(a)  # noqa: E731
    spec_linear.check_head(kind, meta(hidden), meta(weight), meta(bias), None if teacher is None else tuple(meta(a) for a in teacher), args["precision"])
    named = {"weight": weight, "bias": bias}
    if teacher is not None:
        named.update(teacher_hidden=teacher[0], teacher_weight=teacher[1], teacher_bias=teacher[2])
    _check_devices(hidden, named)
    lead, vocab = tuple(hidden.shape[:-1]), int(weight.shape[0])
    logits = _stand_in(lead, vocab, hidden)
    target = args["labels"] if ce else (None if teacher is None else _stand_in(lead, vocab, teacher[0]))
    # The unfused losses' validation and coefficients (segment_ids, the label range against the
    # global V of a vocab_parallel group); no sequence_parallel for the head (yet).
    vocab_parallel = args["vocab_parallel"]
    plain = backends.IMPLEMENTATIONS[backends.PLAIN]  # the stand-in logits' checks and coefficients; the head's impl is resolved below
    call = _prepare.validate(config, logits, target, args["loss_mask"], args["segment_ids"], args["denominator"], vocab_parallel, None, plain, False)
    prepared = _prepare.prepare(call)
    shards = None if vocab_parallel is None else Shards(vocab_parallel, call.kernels.offset, call.vocab, _widest_shard(vocab, vocab_parallel, hidden.device))
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    rows = math.prod(lead)
    t_args = (None, None, None) if teacher is None else (teacher[0].reshape(rows, teacher[0].shape[-1]), teacher[1], teacher[2])
    backend = backends.resolve(args["impl"], hidden, head=True)  # the one resolution
    recompute = spec_linear.check_recompute_logits(args["recompute_logits"])
    loss = LinearHeadFunction.apply(
        hidden.reshape(rows, hidden.shape[-1]), weight, bias, prepared.target if ce else None, *t_args, prepared.coef, config, need_grad,
        spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(tuning, args["precision"]), args["precision"]), shards,
        _autodiff.second_order_anchor(hidden, weight, bias) if need_grad else None,
    )
    return _prepare.finish(call, prepared, loss)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + cross_entropy: ``cross_entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked cross-entropy with integer labels, label smoothing and z-loss.

        l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2
        dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      labels: ``[...]`` integers, the leading shape of ``hidden``; masked tokens' labels are never read as indices.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      ignore_index: label value of ignored tokens: an ``int`` in the int64 range, compared exactly (a label equals it
        only if the labels' dtype can hold it).
      label_smoothing: ``eps`` in ``[0, 1]``.
      z_loss: ``lam >= 0``.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_cross_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "cross_entropy",
        hidden=hidden, weight=weight, labels=labels, loss_mask=loss_mask, bias=bias, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_scale=logit_scale, logit_softcap=logit_softcap,
        causal_shift=causal_shift, normalization=normalization, denominator=denominator, segment_ids=segment_ids,
        impl=impl, recompute_logits=recompute_logits, precision=precision, vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_soft_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + soft_cross_entropy: ``soft_cross_entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked cross-entropy against the teacher's distribution p.

        l = lse - sum_v p_v z_v
        dl/dz = q - p

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_soft_cross_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "soft_cross_entropy",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_forward_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + forward_kl: ``forward_kl(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked forward KL, KL(p || q), of the student q from the teacher p (mean seeking).

        l = sum_v p_v (log p_v - log q_v)
        dl/dz = q - p

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_forward_kl", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "forward_kl",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_reverse_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + reverse_kl: ``reverse_kl(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked reverse KL, KL(q || p), of the student q from the teacher p (mode seeking).

        l = sum_v q_v (log q_v - log p_v)
        dl/dz = q (log q - log p - l)   (0 where q == 0)

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_reverse_kl", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "reverse_kl",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_entropy(
    hidden: Tensor,
    weight: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + entropy: ``entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked entropy of the student's distribution q (the entropy regulariser of policy-gradient trainers).

        l = -sum_v q_v log q_v
        dl/dz = -q (log q + l)   (0 where q == 0)

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      temperature: ``T > 0``, divides the student's logits.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "entropy",
        hidden=hidden, weight=weight, loss_mask=loss_mask, bias=bias, temperature=temperature, logit_scale=logit_scale,
        logit_softcap=logit_softcap, causal_shift=causal_shift, normalization=normalization, denominator=denominator,
        segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision, vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_jensen_shannon(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: _prepare.Denominator = None,
    segment_ids: Optional[Tensor] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[torch.distributed.ProcessGroup] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Tensor:
    """Fused LM head + jensen_shannon: ``jensen_shannon(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked generalised Jensen-Shannon divergence of the student q and the teacher p (on-policy distillation).

        l = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q;
        beta = 0: KL(p || q) (forward KL), beta = 1: KL(q || p) (reverse KL), computed as those kinds
        dl/dz = (1 - beta) q (log q - log M - KL(q || M))   (0 where q == 0; the KL kinds' at beta = 0, 1)

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      beta: ``beta`` in ``[0, 1]``, the teacher's share of the mixture ``M = beta p + (1 - beta) q`` (TRL's GKD and
        Liger-Kernel's JSD): 0.5 the symmetric JSD, 0 forward KL ``KL(p || q)``, 1 reverse KL ``KL(q || p)``.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or a ``torch.distributed`` ``ProcessGroup`` over which the head is split along ``V``
        (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``, ``teacher_bias``) is this
        rank's contiguous slice ``[V_local, H]`` (shards in rank order, sizes may differ, each >= 1), ``hidden`` (and
        ``teacher_hidden``) the same on every rank, labels global ids. The loss is the same on every rank; the gradient
        of ``hidden`` is the whole one (all-reduced over the group inside the call: do not add Megatron's
        all-reduce-in-backward copy in front of the head), those of ``weight`` and ``bias`` the rank's slices. Only
        ``[N]`` row statistics cross the group, never logits; every rank of the group must make the call.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_jensen_shannon", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "jensen_shannon",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, beta=beta, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )
