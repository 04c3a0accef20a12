"""Labels and ``ignore_index`` are compared exactly, never after a conversion that wraps
(SPEC section 5: a valid label outside ``[0, V)`` is never used silently).

- A ``uint32`` label ``2**32 - 100`` is a valid, out-of-range label (``ValueError`` eagerly,
  NaN loss under ``jit``), never the ignore_index ``-100``.
- An ``ignore_index`` that the labels' dtype cannot hold (``2**40`` for int32 labels, ``-100``
  for unsigned ones) matches no label: no overflow, no wrapping; eagerly and under ``jit``,
  in the losses and in ``count_denominator``.
- NumPy int64 / uint64 labels (which JAX without x64 narrows to 32 bits) are compared on the
  host before anything is sent.

Every value is checked against the float64 oracle (NumPy compares exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloss
import lossspec

N, V = 6, 10
RNG = np.random.default_rng(11)
X = RNG.normal(size=(N, V)).astype(np.float32)
LABELS = np.array([1, 4, 2, 9, 0, 3])
IMPLS = ("xla", "pallas")


def _oracle(labels: np.ndarray, mask=None, **options) -> float:
    return lossspec.oracle("cross_entropy", X, labels, mask, **options)[0]


def jitted_mask(impl: str):
    return jax.jit(lambda x, y, m: jaxloss.cross_entropy(x, y, m, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_uint32_label_near_2_32_is_out_of_range_not_ignored(impl: str) -> None:
    labels = LABELS.astype(np.uint32)
    labels[2] = 2**32 - 100  # int32(2**32 - 100) == -100, the default ignore_index
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*got 4294967196 at position \(2,\)"):
        lossspec.oracle("cross_entropy", X, labels)
    for as_jax in (False, True):
        given = jnp.asarray(labels) if as_jax else labels
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*got 4294967196 at position \(2,\)"):
            jaxloss.cross_entropy(X, given, impl=impl)
    jitted = jax.jit(lambda x, y: jaxloss.cross_entropy(x, y, impl=impl))
    assert np.isnan(float(jitted(X, jnp.asarray(labels))))
    per_token = jax.jit(lambda x, y: jaxloss.cross_entropy(x, y, normalization="none", impl=impl))(X, jnp.asarray(labels))
    assert np.all(np.isnan(np.asarray(per_token)))
    # Masked, the same label is legal and unread.
    mask = np.arange(N) != 2
    lossspec.compare_loss(jitted_mask(impl)(X, jnp.asarray(labels), jnp.asarray(mask)), _oracle(labels, mask)).check()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int8, np.int16])
def test_narrow_and_unsigned_labels_match_the_oracle(dtype: type) -> None:
    """No label of an unsigned dtype equals -100: every token counts, eagerly and under jit."""
    labels = LABELS.astype(dtype)
    ref = _oracle(labels)
    lossspec.compare_loss(jaxloss.cross_entropy(X, jnp.asarray(labels)), ref).check()
    lossspec.compare_loss(jax.jit(jaxloss.cross_entropy)(X, jnp.asarray(labels)), ref).check()
    count = lossspec.count_denominator(labels)
    assert float(jaxloss.count_denominator(jnp.asarray(labels))) == count == N
    assert float(jax.jit(jaxloss.count_denominator)(jnp.asarray(labels))) == count
    if np.iinfo(dtype).min < 0:  # a signed dtype holds -100: it masks as usual
        labels[1] = -100
        ref = _oracle(labels)
        lossspec.compare_loss(jax.jit(jaxloss.cross_entropy)(X, jnp.asarray(labels)), ref).check()
        assert float(jax.jit(jaxloss.count_denominator)(jnp.asarray(labels))) == lossspec.count_denominator(labels) == N - 1


@pytest.mark.parametrize("impl", IMPLS)
def test_ignore_index_beyond_the_labels_dtype_matches_nothing(impl: str) -> None:
    labels = LABELS.astype(np.int32)
    for ignore_index in (2**40, -(2**40), 2**63 - 1, -(2**63)):
        ref = _oracle(labels, ignore_index=ignore_index)
        assert ref == _oracle(labels)  # nothing ignored
        eager = jaxloss.cross_entropy(X, labels, ignore_index=ignore_index, impl=impl)
        lossspec.compare_loss(eager, ref).check()
        traced = jax.jit(lambda x, y: jaxloss.cross_entropy(x, y, ignore_index=ignore_index, impl=impl))(X, jnp.asarray(labels))
        lossspec.compare_loss(traced, ref).check()
        assert float(jaxloss.count_denominator(labels, ignore_index=ignore_index)) == N
        count = jax.jit(lambda y: jaxloss.count_denominator(y, ignore_index=ignore_index))(jnp.asarray(labels))
        assert float(count) == lossspec.count_denominator(labels, ignore_index=ignore_index) == N
    # uint32 labels and an ignore_index that uint32 does hold: compared exactly.
    labels = LABELS.astype(np.uint32)
    labels[4] = 2**32 - 1
    ref = _oracle(labels, ignore_index=2**32 - 1)
    traced = jax.jit(lambda x, y: jaxloss.cross_entropy(x, y, ignore_index=2**32 - 1, impl=impl))(X, jnp.asarray(labels))
    lossspec.compare_loss(traced, ref).check()


def test_numpy_int64_labels_are_compared_on_the_host() -> None:
    """Without x64 JAX narrows int64 / uint64 to 32 bits (2**40 -> 0, 2**32 - 100 -> -100):
    eager calls compare NumPy labels before sending them."""
    labels = LABELS.astype(np.int64)
    labels[1] = 2**40  # the ignore_index below: masked
    labels[3] = 2**32 - 100  # masked by the loss_mask: any value is legal
    mask = np.arange(N) != 3
    for impl in IMPLS:
        ref = _oracle(labels, mask, ignore_index=2**40)
        lossspec.compare_loss(jaxloss.cross_entropy(X, labels, mask, ignore_index=2**40, impl=impl), ref).check()
        per_token = jaxloss.cross_entropy(X, labels, mask, ignore_index=2**40, normalization="none", impl=impl)
        lossspec.compare_loss(np.asarray(per_token), _oracle(labels, mask, ignore_index=2**40, normalization="none")).check()
    # NumPy labels closed over in a jitted function, with a traced mask: compared on the host
    # all the same, and an unmasked out-of-range one makes the loss NaN.
    fn = jax.jit(lambda x, m: jaxloss.cross_entropy(x, labels, m, ignore_index=2**40))
    lossspec.compare_loss(fn(X, jnp.asarray(mask)), _oracle(labels, mask, ignore_index=2**40)).check()
    assert np.isnan(float(fn(X, jnp.ones(N, bool))))
    count = jax.jit(lambda m: jaxloss.count_denominator(labels, m, ignore_index=2**40))(jnp.asarray(mask))
    assert float(count) == lossspec.count_denominator(labels, mask, ignore_index=2**40) == N - 2
    # count_denominator: 2**32 - 100 is a valid token (not -100), 2**40 with ignore_index=2**40 is not.
    wide = np.array([1, 2**32 - 100, 2**40, 3], np.int64)
    assert float(jaxloss.count_denominator(wide)) == lossspec.count_denominator(wide) == 4
    assert float(jaxloss.count_denominator(wide, ignore_index=2**40)) == lossspec.count_denominator(wide, ignore_index=2**40) == 3
    weights = np.array([0.5, 2.0, 1.0, 1.0], np.float32)
    assert float(jaxloss.count_denominator(wide.astype(np.uint64), weights)) == lossspec.count_denominator(wide.astype(np.uint64), weights) == 4.5


def test_64_bit_labels_under_x64() -> None:
    """With x64 on, int64 / uint64 labels reach the device as they are: compared exactly there."""
    with jax.enable_x64(True):
        signed = np.array([1, 2**40, 3, 4, 5, 6], np.int64)
        fn = jax.jit(lambda x, y: jaxloss.cross_entropy(x, y, ignore_index=2**40))
        lossspec.compare_loss(fn(X, jnp.asarray(signed)), _oracle(signed, ignore_index=2**40)).check()
        unsigned = LABELS.astype(np.uint64)
        unsigned[0] = 2**64 - 100  # not -100: out of range
        assert np.isnan(float(jax.jit(jaxloss.cross_entropy)(X, jnp.asarray(unsigned))))
        assert float(jax.jit(jaxloss.count_denominator)(jnp.asarray(unsigned))) == lossspec.count_denominator(unsigned) == N


def test_ignore_index_is_validated() -> None:
    for bad, error in ((2**64, ValueError), (-(2**63) - 1, ValueError), (True, TypeError), (-100.0, TypeError)):
        with pytest.raises(error, match="ignore_index must be"):
            jaxloss.cross_entropy(X, LABELS, ignore_index=bad)
        with pytest.raises(error, match="ignore_index must be"):
            jaxloss.count_denominator(LABELS, ignore_index=bad)
        with pytest.raises(error, match="ignore_index must be"):
            lossspec.oracle("cross_entropy", X, LABELS, ignore_index=bad)
