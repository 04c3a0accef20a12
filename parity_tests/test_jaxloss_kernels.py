"""Internals of the two implementations: the XLA path's row chunks and vocabulary blocks, the
online-statistics algebra (the future vocab-parallel combine), Pallas block shapes, and the
Pallas kernels' GPU (Triton) lowering, checked without a GPU through ``jax.export``."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxloss
import lossspec
from jaxloss.backends import pallas as _pallas, xla as _xla
from lossspec import KINDS, assert_close_to_oracle, compare_loss, make_case

FNS = {
    "cross_entropy": jaxloss.cross_entropy,
    "soft_cross_entropy": jaxloss.soft_cross_entropy,
    "forward_kl": jaxloss.forward_kl,
    "reverse_kl": jaxloss.reverse_kl,
}
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 0.7, "teacher_logit_scale": 1.3},
    "reverse_kl": {"logit_scale": 0.8},
}


def check(case: lossspec.Case, impl: str, tuning: Optional[lossspec.Tuning] = None, **options: Any) -> None:
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = case.target if case.kind == "cross_entropy" else jnp.asarray(case.target).astype(case.dtype)
    fn = FNS[case.kind]
    loss, vjp = jax.vjp(lambda x: fn(x, target, case.loss_mask, impl=impl, tuning=tuning, **options), x)
    (grad,) = vjp(jnp.ones_like(loss))
    ref = case.reference(**options)
    assert_close_to_oracle(
        np.asarray(loss), np.asarray(grad.astype(jnp.float32)), ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=case.name
    )
    if case.dtype == "float32":
        # The loss alone (no gradient requested) takes the statistics-only path.
        compare_loss(np.asarray(fn(x, target, case.loss_mask, impl=impl, **options)), ref.loss).check()


# Rows in chunks of 6 (the last chunk moved back to overlap its neighbour), vocabulary in blocks
# of 48 (the last one overlapping too): every branch of the XLA driver on small inputs.
SMALL_XLA = lossspec.Tuning(chunk_elements=6 * 48, single_block_vocab=64, vocab_block=48)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", KINDS)
def test_xla_vocabulary_blocks_and_row_chunks(kind: str, dtype: str) -> None:
    scenarios = ("random", "confident", "huge", "neg_inf", "all_masked") if dtype == "float32" else ("confident", "huge")
    for scenario in scenarios:
        case = make_case(kind, scenario, dtype=dtype, lead_shape=(2, 7), vocab=257)
        options = {} if scenario == "neg_inf" else OPTIONS[kind]
        for normalization in ("valid_tokens", "none") if dtype == "float32" else ("none",):
            check(case, "xla", SMALL_XLA, normalization=normalization, **options)


def test_xla_single_block_row_chunks() -> None:
    """Whole-row blocks, several overlapping row chunks (13 rows in chunks of 4)."""
    tuning = lossspec.Tuning(chunk_elements=4 * 100)
    for kind, dtype in zip(KINDS, ("float32", "bfloat16", "float16", "bfloat16")):
        check(make_case(kind, "float_weights", dtype=dtype, lead_shape=(13,), vocab=100), "xla", tuning, **OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_pallas_small_blocks(kind: str) -> None:
    """Row blocks of 2 and vocabulary blocks of 32: many programs, many blocks, ragged tails."""
    tuning = lossspec.Tuning(block_rows=2, vocab_block=32)
    for dtype, scenario in (("float32", "huge"), ("bfloat16", "neg_inf")):
        case = make_case(kind, scenario, dtype=dtype, lead_shape=(7,), vocab=100)
        check(case, "pallas", tuning, **({} if scenario == "neg_inf" else OPTIONS[kind]))


@pytest.mark.slow
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_pallas_masked_rows_write_zeros_only(kind: str) -> None:
    """Rows with ``coef == 0`` are never read: two whole row blocks masked (both passes skipped,
    zeros written), a masked row beside a live one (its lanes masked off the loads), a live row
    alone in the ragged last block. NaN / +inf in the masked rows leak nowhere; the loss and the
    gradient are the oracle's, the masked rows' gradient exactly 0."""
    n, vocab = 9, 70
    rng = np.random.default_rng(32)
    x = rng.normal(0.0, 2.0, (n, vocab)).astype(np.float32)
    teacher = rng.normal(0.0, 2.0, (n, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, n).astype(np.int32)
    mask = np.ones(n, dtype=bool)
    mask[[0, 1, 2, 3, 5]] = False
    ref_loss, ref_grad = lossspec.oracle(kind, x.astype(np.float64), labels if kind == "cross_entropy" else teacher.astype(np.float64), mask)
    x[1, 3], x[5, :], teacher[2, 7], teacher[3, :] = np.nan, np.inf, np.nan, np.inf  # masked rows only
    spec = lossspec.KIND_SPECS[kind]
    target = jnp.asarray(labels) if spec.target == "labels" else jnp.asarray(teacher)
    fn = getattr(jaxloss, kind)
    tuning = lossspec.Tuning(block_rows=2, vocab_block=32)

    def loss_of(x: jax.Array) -> jax.Array:
        if spec.target is None:
            return fn(x, jnp.asarray(mask), impl="pallas", tuning=tuning)
        return fn(x, target, jnp.asarray(mask), impl="pallas", tuning=tuning)

    loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(x))
    grad = np.asarray(grad)
    assert np.all(grad[~mask] == 0.0), kind
    compare_loss(np.asarray(loss), ref_loss).check()
    np.testing.assert_allclose(grad[mask], ref_grad[mask], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_pallas_persistent_programs(kind: str, dtype: str) -> None:
    """``Tuning(programs=P)``: ``P`` programs each taking every ``P``-th block of rows (4 blocks of
    2 rows here; 3 programs, then 1 for all): the loss and the gradient against the oracle, and
    bit for bit the default grid's (the same blocks, computed alike); for 16-bit logits with an
    upstream gradient of 0.5 too (the backward's recompute is a second launch)."""
    case = make_case(kind, "float_weights", dtype=dtype, lead_shape=(7,), vocab=100, seed=4)
    spec = lossspec.KIND_SPECS[kind]
    x = jnp.asarray(case.logits).astype(dtype)
    target = None if spec.target is None else (jnp.asarray(case.target) if spec.target == "labels" else jnp.asarray(case.target).astype(dtype))
    fn = getattr(jaxloss, kind)

    def loss_of(x: jax.Array, tuning: lossspec.Tuning, scale: float) -> jax.Array:
        args = (x, case.loss_mask) if target is None else (x, target, case.loss_mask)
        return scale * fn(*args, impl="pallas", tuning=tuning)

    ref = case.reference()
    for scale in (1.0, 0.5):
        base = jax.value_and_grad(loss_of)(x, lossspec.Tuning(block_rows=2, vocab_block=32), scale)
        for programs in (3, 1):
            loss, grad = jax.value_and_grad(loss_of)(x, lossspec.Tuning(block_rows=2, vocab_block=32, programs=programs), scale)
            assert_close_to_oracle(np.asarray(loss) / scale, np.asarray(grad.astype(jnp.float32)) / scale, ref.loss, ref.grad,
                                   dtype=dtype, g0=ref.g0, what=f"{case.name} programs={programs} x{scale}")
            assert np.array_equal(np.asarray(loss), np.asarray(base[0])) and np.array_equal(np.asarray(grad), np.asarray(base[1]))


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_combine_like_shards(kind: str) -> None:
    """Per-shard statistics of uneven vocabulary shards, combined in either order, give the
    oracle's per-token losses: the algebra vocab-parallel will use between pmax and psum."""
    options = OPTIONS[kind]
    config = lossspec.make_config(kind, **options)
    cfg = _xla.KernelConfig(kind, config.student_scale, config.teacher_scale, config.label_smoothing, config.z_loss)
    for scenario in ("random", "huge", "neg_inf", "confident"):
        case = make_case(kind, scenario, lead_shape=(6,), vocab=101)
        if scenario == "neg_inf":
            cfg = _xla.KernelConfig(kind, cfg.scale, cfg.teacher_scale, 0.0, cfg.z_loss)
            config = lossspec.make_config(kind, **{k: v for k, v in options.items() if k != "label_smoothing"})
        x = jnp.asarray(case.logits)
        ce = kind == "cross_entropy"
        labels = np.where(np.asarray(case.target) >= 0, case.target, 0).clip(0, 100) if ce else None
        teacher = None if ce else jnp.asarray(case.target)
        shards = [(0, 13), (13, 60), (60, 101)]
        parts = []
        for lo, hi in shards:
            hit = jnp.asarray((np.arange(lo, hi)[None, :] == labels[:, None])) if ce else None
            stats, _, _ = _xla.block_stats(cfg, x[:, lo:hi], None if ce else teacher[:, lo:hi], hit=hit)
            parts.append(stats)
        forward = _xla.combine(cfg, _xla.combine(cfg, parts[0], parts[1]), parts[2])
        backward = _xla.combine(cfg, parts[2], _xla.combine(cfg, parts[1], parts[0]))
        ref, _ = lossspec.per_token_oracle(config, case.logits, labels if ce else case.target)
        for stats in (forward, backward):
            got = _xla.finalize(cfg, stats, 101).l
            compare_loss(np.asarray(got), ref, f"{kind}/{scenario}").check()


def test_unknown_kernel_mode() -> None:
    cfg = _xla.KernelConfig("cross_entropy")
    with pytest.raises(NotImplementedError, match="kernel mode .stats. in fused"):
        _pallas.fused(cfg, jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), jnp.ones((2,)), mode="stats")


def test_block_sizes_must_be_powers_of_two() -> None:
    tuning = lossspec.Tuning(block_rows=3)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        _pallas.fused(_xla.KernelConfig("cross_entropy"), jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), jnp.ones((2,)), tuning=tuning)


def test_xla_memory_is_one_logits_buffer() -> None:
    """Forward + backward keeps one logits-sized buffer, the gradient in the logits' dtype (the
    output); temporaries are a few row chunks, never an fp32 copy of ``[N, V]``. 16-bit logits
    additionally travel as a uint16 view (XLA's CPU backend upcasts bf16/fp16 dynamic slices to
    fp32, which would copy the whole array in fp32): one 16-bit copy per ``[N, V]`` input; and
    their backward's ``lax.cond`` (recompute for a non-unit upstream gradient) has its own
    logits-sized result buffer when the upstream gradient is not a compile-time 1."""
    n, vocab = 16384, 4096  # 256 MiB in fp32 (only compiled, never allocated); a row chunk is 8 MiB
    chunk_bytes = _xla.DEFAULTS.chunk_elements * 4
    for kind in KINDS:
        for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
            x = jax.ShapeDtypeStruct((n, vocab), jnp.dtype(dtype))
            target = jax.ShapeDtypeStruct((n,), jnp.int32) if kind == "cross_entropy" else x
            compiled = jax.jit(jax.value_and_grad(lambda x, t: FNS[kind](x, t, impl="xla", **OPTIONS[kind]))).lower(x, target).compile()
            memory = compiled.memory_analysis()
            assert memory.output_size_in_bytes <= n * vocab * itemsize + 64
            views = 0 if dtype == "float32" else (2 if kind == "cross_entropy" else 3) * n * vocab * itemsize
            assert memory.temp_size_in_bytes <= views + 6 * chunk_bytes, (kind, dtype, memory)
            assert memory.temp_size_in_bytes < views + n * vocab * 4 // 2, (kind, dtype, memory)


def test_xla_plain_fp32_cross_entropy_takes_every_row_at_once() -> None:
    """Plain cross-entropy on fp32 logits (no label smoothing, no soft cap) runs over all rows at
    once by default (``jaxloss.backends.xla.blocking``'s ``whole``: no chunk loop, whose zeroed
    gradient buffer and one-thread update cost 25-30% of the time on a CPU): its only temporaries
    are a few ``[N]`` vectors, not even one row chunk; and it gives the oracle's numbers at a size
    the default chunks would split (300 x 4096 rows: 1.2 x 2**20 elements)."""
    n, vocab = 16384, 4096  # only compiled, never allocated
    chunk_bytes = _xla.DEFAULTS.chunk_elements * 4
    x = jax.ShapeDtypeStruct((n, vocab), jnp.float32)
    labels = jax.ShapeDtypeStruct((n,), jnp.int32)
    for options in ({}, {"z_loss": 1e-3, "logit_scale": 0.8}):
        compiled = jax.jit(jax.value_and_grad(lambda x, y: jaxloss.cross_entropy(x, y, impl="xla", **options))).lower(x, labels).compile()
        memory = compiled.memory_analysis()
        assert memory.output_size_in_bytes <= n * vocab * 4 + 64
        assert memory.temp_size_in_bytes < chunk_bytes // 4, (options, memory)
    assert _xla.blocking(None, n, vocab, whole=True) == (False, vocab, n)
    assert _xla.blocking(lossspec.Tuning(chunk_elements=1 << 20), n, vocab, whole=True) == (False, vocab, 256)  # asked for
    for options in ({}, {"z_loss": 1e-3}):
        check(make_case("cross_entropy", "random", dtype="float32", lead_shape=(300,), vocab=4096), "xla", **options)


# --------------------------------------------------------------------------------------------
# The GPU lowering (Triton), without a GPU
# --------------------------------------------------------------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"


def _export_cuda(fn: Any, *args: Any) -> str:
    exported = export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    )(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("kind", KINDS)
def test_pallas_lowers_to_triton(kind: str) -> None:
    """The kernels lower through Pallas' Triton backend (forward and backward of the loss):
    one kernel for fp32 logits; for 16-bit logits a second one, the backward's recompute for a
    non-unit upstream gradient (under ``lax.cond``)."""
    n, vocab = 37, 50257
    fn = FNS[kind]
    for dtype, kernels in ((jnp.float32, 1), (jnp.bfloat16, 2)):
        x = jax.ShapeDtypeStruct((n, vocab), dtype)
        target = jax.ShapeDtypeStruct((n,), jnp.int32) if kind == "cross_entropy" else x
        module = _export_cuda(jax.value_and_grad(lambda x, t: fn(x, t, impl="pallas", **OPTIONS[kind])), x, target)
        assert module.count(TRITON_CALL) == kernels
        assert f"jaxloss_{kind}" in module


def test_pallas_uses_64_bit_offsets_for_large_arrays(capsys: pytest.CaptureFixture[str]) -> None:
    """Offsets are 64-bit once an operand exceeds 2**32 bytes (N * V beyond int32 elements), 32-bit
    below; the kernel never forms ``row * V`` itself."""
    cfg = _xla.KernelConfig("cross_entropy")
    tuning = lossspec.Tuning(interpret=False, debug=True)
    pointers = {}
    for n in (1000, 70000):  # 1000 x 32768 bf16 = 64 MiB; 70000 x 32768 bf16 = 4.3 GiB
        x = jax.ShapeDtypeStruct((n, 32768), jnp.bfloat16)
        labels = jax.ShapeDtypeStruct((n,), jnp.int32)
        coef = jax.ShapeDtypeStruct((n,), jnp.float32)
        capsys.readouterr()
        _export_cuda(lambda x, t, c: _pallas.fused(cfg, x, t, c, tuning=tuning), x, labels, coef)
        triton_ir = capsys.readouterr().out
        pointers[n] = [line for line in triton_ir.splitlines() if "tt.addptr" in line and "bf16" in line]
    # the blocks' pointers, pass 1's [rows x lanes x VEC] (VEC = 8 bf16 columns, one 16-byte load)
    # and pass 2's [rows x columns], and cross-entropy's label logits' [rows] (one per row)
    rows, cols = _pallas.GPU_DEFAULTS.block_rows, _pallas.GPU_DEFAULTS.vocab_block
    for n, width in ((1000, "i32"), (70000, "i64")):
        offsets = {line.rsplit(", tensor<", 1)[1].split(">")[0] for line in pointers[n]}
        assert offsets == {f"{rows}x{cols // 8}x8x{width}", f"{rows}x{cols}x{width}", f"{rows}x{width}"}, pointers[n]


def test_pallas_skips_masked_row_blocks_in_the_triton_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU kernel branches on its rows' coefficients: a block with a live row runs both passes,
    a block of masked rows only stores zeros (two ``scf.if`` regions); the stats-only mode of the
    vocab-parallel shards has no coefficients and no branch."""
    cfg = _xla.KernelConfig("cross_entropy")
    tuning = lossspec.Tuning(interpret=False, debug=True)
    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)
    coef = jax.ShapeDtypeStruct((64,), jnp.float32)
    capsys.readouterr()
    _export_cuda(lambda x, t, c: _pallas.fused(cfg, x, t, c, tuning=tuning), x, labels, coef)
    assert capsys.readouterr().out.count("scf.if") == 2
    _export_cuda(lambda x, t: _pallas.shard_stats(cfg, x, t, tuning=tuning), x, labels)
    assert capsys.readouterr().out.count("scf.if") == 0


def test_pallas_persistent_programs_lower_to_a_row_loop(capsys: pytest.CaptureFixture[str]) -> None:
    """For a GPU, ``Tuning(programs=4)`` lowers to one loop more than the default grid's (the
    blocks of rows each program takes in turn, around the same two ``scf.if`` branches), and
    4 programs for the 64 rows' blocks (one program per block by default)."""
    cfg = _xla.KernelConfig("cross_entropy")
    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)
    coef = jax.ShapeDtypeStruct((64,), jnp.float32)
    found = {}
    for programs in (None, 4):
        tuning = lossspec.Tuning(interpret=False, debug=True, programs=programs)
        capsys.readouterr()
        module = _export_cuda(lambda x, t, c: _pallas.fused(cfg, x, t, c, tuning=tuning), x, labels, coef)
        triton_ir = capsys.readouterr().out
        found[programs] = (triton_ir.count("scf.for"), triton_ir.count("scf.if"), module)
    assert found[4][0] == found[None][0] + 1 and found[4][1] == found[None][1] == 2
    assert f"grid_x = {64 // _pallas.GPU_DEFAULTS.block_rows}" in found[None][2] and "grid_x = 4" in found[4][2]


# The two mesh tests lower for CUDA from a CPU machine's 8 host devices (parity_tests/conftest.py);
# a machine with one GPU has no such mesh, and runs the kernels themselves instead.
CPU_MESH = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (the CPU's 8 host devices); on a 1-GPU machine the kernels run for real")


@CPU_MESH
def test_pallas_in_shard_map_lowers_with_varying_axes_checked() -> None:
    """Under ``shard_map`` with the default ``check_vma=True`` the kernel's operands and results
    carry the mesh's varying axes, so the GPU lowering goes through (only the CPU interpreter
    needs ``check_vma=False``, see test_jaxloss_transforms)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",))

    def local(x: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        denominator = jax.lax.psum(jaxloss.count_denominator(t, m), "data")
        return jax.lax.psum(jaxloss.cross_entropy(x, t, m, denominator=denominator, impl="pallas"), "data")

    step = jax.value_and_grad(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P()))
    sharded = NamedSharding(mesh, P("data"))
    args = (
        jax.ShapeDtypeStruct((8, 3, 130), jnp.float32, sharding=sharded),
        jax.ShapeDtypeStruct((8, 3), jnp.int32, sharding=sharded),
        jax.ShapeDtypeStruct((8, 3), jnp.bool_, sharding=sharded),
    )
    assert _export_cuda(step, *args).count(TRITON_CALL) == 1


@CPU_MESH
@pytest.mark.parametrize("kind", KINDS)
def test_pallas_vocab_parallel_lowers_to_triton(kind: str) -> None:
    """Vocab-parallel on a ("data", "model") mesh, check_vma on: the "stats" and "grad" kernels
    lower through the Triton backend with the collectives between them (psum / pmax in the
    module, outside the kernels)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    ce = kind == "cross_entropy"
    fn = getattr(jaxloss, kind)

    def local(x: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        denominator = jax.lax.psum(jaxloss.count_denominator(t if ce else None, m), "data")
        loss = fn(x, t, m, denominator=denominator, vocab_parallel="model", impl="pallas")
        return jax.lax.psum(loss, "data")

    target_spec = P("data") if ce else P("data", None, "model")
    step = jax.value_and_grad(jax.shard_map(local, mesh=mesh, in_specs=(P("data", None, "model"), target_spec, P("data")),
                                            out_specs=P()))
    args = (
        jax.ShapeDtypeStruct((8, 3, 260), jnp.float32, sharding=NamedSharding(mesh, P("data", None, "model"))),
        jax.ShapeDtypeStruct((8, 3), jnp.int32, sharding=NamedSharding(mesh, P("data")))
        if ce else jax.ShapeDtypeStruct((8, 3, 260), jnp.float32, sharding=NamedSharding(mesh, target_spec)),
        jax.ShapeDtypeStruct((8, 3), jnp.bool_, sharding=NamedSharding(mesh, P("data"))),
    )
    module = _export_cuda(step, *args)
    assert module.count(TRITON_CALL) == 2
    assert f"jaxloss_{kind}_stats" in module and f"jaxloss_{kind}_grad" in module
    assert "all_reduce" in module


def test_auto_picks_xla_off_gpu_and_pallas_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if jax.default_backend() == "gpu":  # a GPU machine: the other half of the rule
        assert jaxloss.resolve_impl("auto") == "pallas"
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert jaxloss.resolve_impl("auto") == "xla"
    case = make_case("forward_kl", "random", lead_shape=(5,), vocab=60)
    auto = jaxloss.forward_kl(case.logits, case.target, case.loss_mask)
    xla = jaxloss.forward_kl(case.logits, case.target, case.loss_mask, impl="xla")
    assert np.asarray(auto).tobytes() == np.asarray(xla).tobytes()
    compare_loss(np.asarray(auto), case.reference().loss, "impl='auto'").check()  # and the value is right
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert jaxloss.resolve_impl("auto") == "pallas"
    assert jaxloss.resolve_impl("xla") == "xla"
