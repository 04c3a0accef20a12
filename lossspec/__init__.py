"""lossspec: the framework-free contract of the masked loss kernels (NumPy only).

- :mod:`lossspec.config`: loss kinds, normalisations and the validated :class:`LossConfig`;
- :mod:`lossspec.checks`: shape/dtype checks over plain metadata, shared by JAX and torch;
- :mod:`lossspec.stats`: the per-row statistics every backend computes (one formulation);
- :mod:`lossspec.kinds`: the per-kind table the public functions' and modules' signatures follow;
- :mod:`lossspec.tuning`: :class:`Tuning`, the block and tile sizes of a call (``tuning=``), read by every backend;
- :mod:`lossspec.causal`: the causal-LM shift (``causal_shift=True``): the rule and its checks;
- :mod:`lossspec.sequences`: ``segment_ids`` and the per-sequence normalisations (the rule, checks, reference);
- :mod:`lossspec.microbatches`: how a batch splits into micro-batches (uneven sizes included);
- :mod:`lossspec.oracle`: the float64 reference with analytic gradients, and its vocab-parallel twin;
- :mod:`lossspec.tolerances`: the bounds of SPEC section 6 and comparisons in units of the bound;
- :mod:`lossspec.generators`: seeded inputs used by every test.
"""

from .causal import (
    check_causal_shift,
    check_count_time_axis,
    check_loss_time_axis,
    scored_positions,
    shift_left,
    shift_targets,
)
from .checks import (
    FP32_MAX,
    FP32_TINY,
    REDUCTION_TO_NORMALIZATION,
    ArrayMeta,
    begin_call,
    broadcast_mask,
    class_axis_hint,
    count_shape,
    foreign_keyword_hint,
    mask_broadcasts,
    squeezed_mask_shape,
    check_count_args,
    check_inplace,
    inplace_refusal,
    check_denominator_allowed,
    check_denominator_shape,
    check_denominator_type,
    check_denominator_value,
    check_inputs,
    check_labels,
    check_loss_mask_dtype,
    check_vocab_size_arg,
    check_weights,
    ignore_index_in_dtype,
    meta,
    numpy_meta,
)
from .sequences import (
    SEQUENCE_NORMALIZATIONS,
    check_segment_ids,
    check_sequence_parallel_axis,
    check_sequence_time_axis,
    compact_segment_ids,
    first_positions,
    scored_segment_ids,
    sequence_coefficients,
    sequence_weight_sums,
    signed_segment_ids,
)
from .config import (
    ALL_KINDS,
    ALL_NORMALIZATIONS,
    COUNTED_NORMALIZATIONS,
    ENTROPY_JSD_KINDS,
    HEAD_KINDS,
    TARGETLESS_KINDS,
    DISTILL_KINDS,
    JAX_IMPLS,
    KINDS,
    NORMALIZATIONS,
    TORCH_IMPLS,
    LossConfig,
    check_ignore_index,
    check_impl,
    check_kind,
    check_normalization,
    make_config,
)
from .microbatches import batch_rows, check_num_microbatches, check_shifted_microbatch, microbatch_sizes
from . import accumulation
from .accumulation import check_accumulation
from .kinds import KIND_SPECS, KindSpec
from .tuning import DEFAULT_TUNING, Tuning, check_tuning
from .linear import DEFAULT_HEAD_TUNING, HEAD_PRECISIONS, HeadTuning, check_head_precision, check_head_tuning
from .stats import FINAL_STAT_INDEX, FINAL_STATS, KIND_IDS, MIXTURE_STATS, ROW_STAT_INDEX, ROW_STATS, final_used, stats_used
from .generators import SCENARIOS, Case, Reference, all_cases, make_case
from .oracle import count_denominator, oracle, oracle_vocab_parallel, per_token_oracle, token_weights
from .tolerances import (
    GRAD_RTOL,
    GRAD_ULPS_16BIT,
    LOSS_RTOL,
    Comparison,
    assert_close_to_oracle,
    compare_grad,
    compare_loss,
    g0_for,
    gradient_floor,
    round_to_dtype,
    ulp,
)

__version__ = "0.1.0"
