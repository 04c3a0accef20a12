"""``torchloss.hf.for_causal_lm_loss`` against the float64 oracle and against the real
``transformers`` (the version pinned in pyproject's ``dev`` extra): its ``ForCausalLMLoss`` on the
same inputs, a tiny randomly initialised Llama trained with gradient accumulation, and ``Trainer``.

References: the oracle is given targets shifted here with NumPy (an implementation of the shift
independent of the library's); ``transformers``' own loss is the reference of the drop-in
equality. Every comparison uses the SPEC bounds of ``lossspec.tolerances``.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built from configs

import numpy as np
import pytest
import torch
import transformers
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

import lossspec
import torchloss
from torchloss.hf import for_causal_lm_loss

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def causal_targets(labels: np.ndarray, ignore_index: int) -> np.ndarray:
    """``labels[..., t + 1]`` at position t, ``ignore_index`` at the last position (NumPy)."""
    tail = np.full(labels.shape[:-1] + (1,), ignore_index, dtype=labels.dtype)
    return np.concatenate([labels[..., 1:], tail], axis=-1)


def make_batch(seed: int, shape: tuple[int, int], ignore_index: int = -100, dtype: str = "float32", scale: float = 3.0):
    """Logits ``[B, T, V]`` (exactly representable in ``dtype``) and labels ``[B, T]`` with a masked
    prompt, padding at the end of the rows and a few ignored tokens inside."""
    rng = np.random.default_rng(seed)
    logits = lossspec.round_to_dtype(rng.normal(0.0, scale, shape + (VOCAB,)), dtype)
    labels = rng.integers(0, VOCAB, shape)
    labels = np.where(labels == ignore_index, (labels + 1) % VOCAB, labels)  # ignore_index may be a vocab id
    rows, length = shape
    for row in range(rows):
        prompt, pad = rng.integers(0, length // 2), rng.integers(0, length // 3)
        labels[row, :prompt] = ignore_index
        labels[row, length - pad:] = ignore_index
    labels[rng.random(shape) < 0.1] = ignore_index
    return logits, labels


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).numpy() if tensor.is_floating_point() else tensor.numpy()


def loss_and_grad(loss_fn, logits: np.ndarray, dtype: str, *args: Any, **kwargs: Any) -> tuple[float, np.ndarray]:
    """``loss_fn(logits, *args, **kwargs)`` and its gradient w.r.t. the logits, as float64."""
    x = torch.from_numpy(logits).to(TORCH_DTYPES[dtype]).requires_grad_(True)
    loss = loss_fn(x, *args, **kwargs)
    # 0-d from torchloss; ForCausalLMLoss broadcasts to [1] with a [1]-shaped num_items_in_batch.
    expected_shape = () if loss_fn is for_causal_lm_loss else loss.shape
    assert loss.dtype == torch.float32 and loss.shape == expected_shape and loss.numel() == 1, (loss.dtype, loss.shape)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert grad.dtype == x.dtype
    return float(loss.detach().sum()), to_numpy(grad)


def oracle_for(logits: np.ndarray, targets: np.ndarray, ignore_index: int, count: float | None):
    """The float64 reference and its ``G0``: ``sum_valid l / count``, or the mean over the valid
    tokens when ``count`` is None."""
    options: dict[str, Any] = {"ignore_index": ignore_index}
    if count is not None:
        options["denominator"] = float(count)
    ref_loss, ref_grad = lossspec.oracle("cross_entropy", logits.astype(np.float64), targets, **options)
    valid = targets != ignore_index
    denominator = float(count) if count is not None else float(valid.sum())
    return ref_loss, ref_grad, lossspec.g0_for(None, valid, denominator, 1.0, 1.0, "valid_tokens")


def assert_drop_in(ours: tuple[float, np.ndarray], theirs: tuple[float, np.ndarray], dtype: str, g0: float, what: str) -> None:
    """Our loss and gradient equal ``transformers``' within the SPEC bounds (theirs as reference)."""
    lossspec.assert_close_to_oracle(*ours, *theirs, dtype=dtype, g0=g0, what=f"{what} vs ForCausalLMLoss")


# ----------------------------------------------------------------------------------------------
# The function: oracle and ForCausalLMLoss, every way of calling it
# ----------------------------------------------------------------------------------------------

NUM_ITEMS = {
    "none": lambda local: None,
    "int": lambda local: local + 17,  # the step's count: more tokens than this micro-batch's
    "int64_tensor": lambda local: torch.tensor(local + 17),
    "float_tensor": lambda local: torch.tensor(local + 17) / 2,  # Trainer divides by the TP/CP/SP size
    "one_element_tensor": lambda local: torch.tensor([local + 17]),  # a DataParallel replica's share
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_items", sorted(NUM_ITEMS))
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_matches_oracle_and_transformers(dtype: str, num_items: str, ignore_index: int) -> None:
    logits, labels = make_batch(seed=3, shape=(3, 11), ignore_index=ignore_index, dtype=dtype)
    targets = causal_targets(labels, ignore_index)
    count_arg = NUM_ITEMS[num_items](int((targets != ignore_index).sum()))
    count = None if count_arg is None else float(torch.as_tensor(count_arg).reshape(()))
    ref_loss, ref_grad, g0 = oracle_for(logits, targets, ignore_index, count)
    call = dict(labels=torch.from_numpy(labels), vocab_size=VOCAB, num_items_in_batch=count_arg, ignore_index=ignore_index)

    ours = loss_and_grad(for_causal_lm_loss, logits, dtype, **call)
    lossspec.assert_close_to_oracle(*ours, ref_loss, ref_grad, dtype=dtype, g0=g0, what="for_causal_lm_loss")
    theirs = loss_and_grad(ForCausalLMLoss, logits, dtype, **call)
    assert_drop_in(ours, theirs, dtype, g0, "for_causal_lm_loss")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shift_labels_are_used_as_given(dtype: str) -> None:
    """A pre-shifted ``shift_labels`` (a padding-free collator's) is the target as is; ``labels``
    is then not read (garbage, or None)."""
    logits, labels = make_batch(seed=5, shape=(2, 9), dtype=dtype)
    shifted = labels.copy()  # any targets aligned with the logits: no shift may be applied to them
    ref_loss, ref_grad, g0 = oracle_for(logits, shifted, -100, 10)
    garbage = torch.full(labels.shape, 3)
    for given_labels in (garbage, None):
        call = dict(labels=given_labels, vocab_size=VOCAB, num_items_in_batch=10, shift_labels=torch.from_numpy(shifted))
        ours = loss_and_grad(for_causal_lm_loss, logits, dtype, **call)
        lossspec.assert_close_to_oracle(*ours, ref_loss, ref_grad, dtype=dtype, g0=g0, what="shift_labels")
    theirs = loss_and_grad(ForCausalLMLoss, logits, dtype, torch.from_numpy(shifted), VOCAB, 10, shift_labels=torch.from_numpy(shifted))
    assert_drop_in(ours, theirs, dtype, g0, "shift_labels")


def test_flattened_shift_labels_and_extra_kwargs() -> None:
    """``ForCausalLMLoss`` flattens logits and targets, so ``shift_labels`` may come flat; the
    keyword arguments a model's forward passes on are ignored by both."""
    logits, labels = make_batch(seed=6, shape=(2, 8))
    targets = causal_targets(labels, -100)
    ref_loss, ref_grad, g0 = oracle_for(logits, targets, -100, None)
    extra = {"output_attentions": False, "position_ids": torch.arange(8)[None], "cu_seq_lens_q": None}
    flat = torch.from_numpy(targets.reshape(-1))
    ours = loss_and_grad(for_causal_lm_loss, logits, "float32", None, VOCAB, shift_labels=flat, **extra)
    lossspec.assert_close_to_oracle(*ours, ref_loss, ref_grad, dtype="float32", g0=g0, what="flat shift_labels")
    theirs = loss_and_grad(ForCausalLMLoss, logits, "float32", None, VOCAB, shift_labels=flat, **extra)
    assert_drop_in(ours, theirs, "float32", g0, "flat shift_labels")


def test_the_logits_are_neither_copied_nor_upcast() -> None:
    """The autograd path from the loss to bf16 logits holds no copy (``.float()``, slice, pad):
    only the kernel's Function and views."""
    logits, labels = make_batch(seed=7, shape=(2, 6), dtype="bfloat16")
    x = torch.from_numpy(logits).to(torch.bfloat16).requires_grad_(True)
    loss = for_causal_lm_loss(x, torch.from_numpy(labels), VOCAB)
    names, node = [], loss.grad_fn
    while node is not None and type(node).__name__ != "AccumulateGrad":
        names.append(type(node).__name__)
        node = next((n for n, _ in node.next_functions if n is not None), None)
    assert node is not None and node.variable is x, names
    assert all(re.fullmatch(r"CrossEntropyFunctionBackward|(View|Reshape\w*|Unsafe\w*)Backward\d*", n) for n in names), names


def test_where_forcausallmloss_gives_nan_we_give_zero() -> None:
    """No valid token (mean of nothing) or ``num_items_in_batch == 0``: ForCausalLMLoss divides 0
    by 0; torchloss returns loss 0 and gradient 0 (SPEC: D == 0). The one documented difference."""
    logits, _ = make_batch(seed=8, shape=(2, 5))
    all_ignored = torch.full((2, 5), -100)
    for num_items in (None, 0, torch.tensor(0)):
        loss, grad = loss_and_grad(for_causal_lm_loss, logits, "float32", all_ignored, VOCAB, num_items)
        assert loss == 0.0 and not grad.any()
        theirs = ForCausalLMLoss(torch.from_numpy(logits), all_ignored, VOCAB, num_items)
        assert torch.isnan(theirs), theirs


@pytest.mark.parametrize("num_items", [0, torch.tensor(0), torch.tensor([0])], ids=["int", "tensor", "one_element_tensor"])
def test_zero_num_items_with_valid_tokens_gives_zero(num_items: Any) -> None:
    """``num_items_in_batch == 0`` is a denominator of 0 (SPEC: loss 0, gradient 0), not "no
    count given" (the mean over this batch's valid tokens): here the batch has valid tokens, so
    the two differ (with every token ignored, both give 0)."""
    logits, labels = make_batch(seed=9, shape=(2, 6))
    targets = causal_targets(labels, -100)
    assert (targets != -100).sum() > 0
    ref_loss, ref_grad = lossspec.oracle("cross_entropy", logits.astype(np.float64), targets, denominator=0.0)
    assert ref_loss == 0.0 and not ref_grad.any()  # the oracle's D == 0
    loss, grad = loss_and_grad(for_causal_lm_loss, logits, "float32", torch.from_numpy(labels), VOCAB, num_items)
    assert loss == ref_loss and np.array_equal(grad, ref_grad)


def test_bad_arguments_are_named() -> None:
    logits = torch.zeros(2, 4, VOCAB)
    labels = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"vocab_size must equal the last dimension of logits; got vocab_size=64"):
        for_causal_lm_loss(logits, labels, 64)
    with pytest.raises(ValueError, match="labels must be a tensor when shift_labels is None"):
        for_causal_lm_loss(logits, None, VOCAB)
    with pytest.raises(ValueError, match="labels"):  # torchloss.cross_entropy's own shape error
        for_causal_lm_loss(logits, None, VOCAB, shift_labels=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="denominator"):
        for_causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=torch.tensor([3, 4]))


# ----------------------------------------------------------------------------------------------
# A tiny Llama, gradient accumulation as Trainer does it
# ----------------------------------------------------------------------------------------------

SEQ, MICRO_ROWS, MICRO_BATCHES, STEPS = 10, 2, 3, 3


def tiny_llama() -> transformers.LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (hidden 32, vocabulary 128): no weights downloaded."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """One optimizer step's micro-batches, uneven valid counts, the last one all masked at step 1."""
    batches = []
    for index in range(MICRO_BATCHES):
        _, labels = make_batch(seed=100 * step + index, shape=(MICRO_ROWS, SEQ))
        input_ids = np.random.default_rng(100 * step + index).integers(0, VOCAB, (MICRO_ROWS, SEQ))
        if step == 1 and index == MICRO_BATCHES - 1:
            labels[:] = -100
        batches.append({"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)})
    return batches


def trainer_count(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``num_items_in_batch`` as Trainer computes it for a causal LM: valid targets of the step."""
    return sum(batch["labels"][..., 1:].ne(-100).sum() for batch in batches)


def test_tiny_llama_gradient_accumulation_matches_transformers() -> None:
    """Three SGD steps of three micro-batches each: per micro-batch, our loss and logits gradient
    meet the oracle's bounds; per step, the losses and every parameter's accumulated gradient
    equal those of the same model with transformers' own loss."""
    theirs = tiny_llama()
    ours = copy.deepcopy(theirs)
    ours.loss_function = torchloss.hf.for_causal_lm_loss  # the documented one-liner
    assert theirs.loss_function is ForCausalLMLoss
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (theirs, ours)]
    for step in range(STEPS):
        batches = micro_batches(step)
        num_items = trainer_count(batches)
        losses: dict[str, list[float]] = {"theirs": [], "ours": []}
        for batch in batches:
            for name, model in (("theirs", theirs), ("ours", ours)):
                out = model(**batch, num_items_in_batch=num_items)
                out.logits.retain_grad()
                out.loss.backward()
                losses[name].append(float(out.loss.detach()))
            targets = causal_targets(batch["labels"].numpy(), -100)
            ref_loss, ref_grad, g0 = oracle_for(to_numpy(out.logits), targets, -100, float(num_items))
            lossspec.assert_close_to_oracle(
                float(out.loss.detach()), to_numpy(out.logits.grad), ref_loss, ref_grad, dtype="float32", g0=g0, what=f"step {step}"
            )
        for mine, reference in zip(losses["ours"], losses["theirs"]):
            lossspec.compare_loss(mine, reference, f"step {step} micro-batch loss").check()
        lossspec.compare_loss(sum(losses["ours"]), sum(losses["theirs"]), f"step {step} loss").check()
        for (name, p_theirs), p_ours in zip(theirs.named_parameters(), ours.parameters()):
            lossspec.compare_grad(to_numpy(p_ours.grad), to_numpy(p_theirs.grad), "float32", 0.0, f"step {step} {name}").check()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_tiny_llama_bf16_logits() -> None:
    """A bf16 model: the LM head's bf16 logits go to the kernel as they are; loss and logits
    gradient meet the oracle's bounds and equal those of transformers' upcast loss."""
    model = tiny_llama().to(torch.bfloat16)
    batch = micro_batches(0)[0]
    results = {}
    for name, loss_function in (("ours", for_causal_lm_loss), ("theirs", ForCausalLMLoss)):
        model.loss_function = loss_function
        out = model(**batch, num_items_in_batch=torch.tensor(25))
        out.logits.retain_grad()
        out.loss.backward()
        assert out.logits.dtype == torch.bfloat16 and out.logits.grad.dtype == torch.bfloat16
        results[name] = (float(out.loss.detach()), to_numpy(out.logits.grad))
        model.zero_grad()
    targets = causal_targets(batch["labels"].numpy(), -100)
    ref_loss, ref_grad, g0 = oracle_for(to_numpy(out.logits), targets, -100, 25.0)
    lossspec.assert_close_to_oracle(*results["ours"], ref_loss, ref_grad, dtype="bfloat16", g0=g0, what="bf16 llama")
    assert_drop_in(results["ours"], results["theirs"], "bfloat16", g0, "bf16 llama")


# ----------------------------------------------------------------------------------------------
# Trainer (end to end, slow)
# ----------------------------------------------------------------------------------------------


def train_with_trainer(tmp_path: Path, loss_function: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three optimizer steps of Trainer (two micro-batches of 2 rows each), with ``loss_function``
    set on the model (None: transformers' own); the logged losses and the final parameters."""
    model = tiny_llama()
    if loss_function is not None:
        model.loss_function = loss_function
    rows = [dict(input_ids=b["input_ids"][r], labels=b["labels"][r]) for step in range(STEPS) for b in micro_batches(step) for r in range(MICRO_ROWS)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_trainer_with_our_loss_trains_like_transformers(tmp_path: Path) -> None:
    calls: list[Any] = []

    def recording_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("num_items_in_batch"))
        return for_causal_lm_loss(*args, **kwargs)

    reference_losses, reference_params = train_with_trainer(tmp_path / "theirs", None)
    losses, params = train_with_trainer(tmp_path / "ours", recording_loss)
    assert len(calls) == 2 * STEPS and all(torch.is_tensor(count) for count in calls), calls
    assert len(losses) == len(reference_losses) == STEPS
    for step, (mine, reference) in enumerate(zip(losses, reference_losses)):
        lossspec.compare_loss(mine, reference, f"Trainer step {step} loss").check()
    # Each step's gradients agree within GRAD_RTOL * S; three SGD steps on slightly different
    # trajectories: the parameters agree within 25 GRAD_RTOL of the size of their total update
    # (measured: 2.4 GRAD_RTOL).
    initial = tiny_llama().state_dict()
    for name, reference in reference_params.items():
        update = float((reference - initial[name]).abs().max())
        error = float((params[name] - reference).abs().max())
        assert update > 0 and error <= 25 * lossspec.GRAD_RTOL * update, (name, error, update)


@pytest.mark.slow
def test_replacing_loss_mapping_breaks_trainers_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the docs set ``model.loss_function`` and not ``LOSS_MAPPING["ForCausalLM"]``: Trainer
    counts ``labels[..., 1:]`` only when the model's loss is ``ForCausalLMLoss`` itself, so through
    the mapping it would count position 0 too and scale the loss down."""
    counts: dict[str, list[int]] = {"loss_function": [], "LOSS_MAPPING": []}

    def recorder(route: str):
        def recording_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            counts[route].append(int(kwargs["num_items_in_batch"]))
            return for_causal_lm_loss(*args, **kwargs)

        return recording_loss

    train_with_trainer(tmp_path / "a", recorder("loss_function"))
    monkeypatch.setitem(LOSS_MAPPING, "ForCausalLM", recorder("LOSS_MAPPING"))
    train_with_trainer(tmp_path / "b", None)
    assert counts["loss_function"] and len(counts["LOSS_MAPPING"]) == len(counts["loss_function"])
    assert any(b > a for a, b in zip(counts["loss_function"], counts["LOSS_MAPPING"])), counts


@pytest.mark.slow
def test_vocab_size_must_be_an_int() -> None:
    """``vocab_size=None`` (or a float): lossspec's TypeError naming it, not ``int(None)``'s."""
    logits = torch.zeros(2, 3, 5)
    labels = torch.zeros(2, 3, dtype=torch.long)
    for bad in (None, 5.0):
        with pytest.raises(TypeError) as want:
            lossspec.check_vocab_size_arg(bad)
        with pytest.raises(TypeError) as got:
            for_causal_lm_loss(logits, labels, vocab_size=bad)
        assert str(got.value) == str(want.value) and "vocab_size must be an int" in str(got.value)


@pytest.mark.slow  # a subprocess that imports torch: ~4 s
def test_importing_torchloss_does_not_import_transformers() -> None:
    code = "import sys, torchloss, torchloss.hf; assert 'transformers' not in sys.modules, 'imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# The docs' examples run as written
# ----------------------------------------------------------------------------------------------

DOC_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "huggingface.md").read_text(), flags=re.S)


def test_docs_have_examples() -> None:
    assert len(DOC_BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS)))
def test_docs_example_runs(index: int) -> None:
    exec(compile(DOC_BLOCKS[index], f"docs/huggingface.md block {index}", "exec"), {"__name__": "__docs__"})
