"""The `lossparity` command: built-in matrix, a perturbed backend caught, user files from JAX and
torch programs, and one-line errors for bad files and arguments."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

import lossspec
from lossparity import backends as backends_module
from lossparity.backends import Backend
from lossparity import cli as cli_module
from lossparity import inputs as inputs_module
from lossparity import matrix as matrix_module
from lossparity.cli import main

SMALL = ["--shape", "3x40", "--no-plot"]
# A progress line on a non-terminal stderr: one per kind, when its last case is done.
PROGRESS_LINE = re.compile(r"lossparity: \[ *\d+/\d+\] \w+: \d+ comparisons, (all pass|\d+ not passing) \(\d+ s\)$")


def test_builtin_matrix_passes_and_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["--kinds", "cross_entropy,reverse_kl", "--dtypes", "float32,bfloat16", "--backends", "jax-xla,torch",
                 "--shape", "2x5x70", "--out", str(tmp_path), "--verbose"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["passed"] is True
    names = {r["backend"] + "~" + r["reference"] for r in report["results"]}
    assert names == {"jax-xla~oracle", "torch~oracle", "jax-xla~torch"}
    assert all(r["loss_error"] <= 1 and r["grad_error"] <= 1 for r in report["results"])
    assert (tmp_path / "parity_report.png").stat().st_size > 10_000
    assert "PASS cross_entropy/random/valid_tokens/float32/2x5x70" in out


def test_builtin_matrix_covers_entropy_and_jensen_shannon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The six kinds are in the built-in matrix (entropy without a target, JSD's beta variant);
    a 1e-4 error in one backend's JSD gradient is a named failure."""
    code = main(["--kinds", "entropy,jensen_shannon", "--dtypes", "float32", "--backends", "jax-xla,torch",
                 "--out", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "parity_report.json").read_text())
    kinds = {r["case"].split("/")[0] for r in report["results"]}
    assert kinds == {"entropy", "jensen_shannon"}
    assert any("beta=0.3" in r["case"] for r in report["results"])
    assert all(r["loss_error"] <= 1 and r["grad_error"] <= 1 for r in report["results"])
    honest = backends_module.BACKENDS["torch"].run

    def perturbed(kind, inputs, options, grad_output):
        loss, grad = honest(kind, inputs, options, grad_output)
        return loss, grad * (1 + 1e-4) if kind == "jensen_shannon" else grad

    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", perturbed))
    code = main(["--kinds", "entropy,jensen_shannon", "--dtypes", "float32", "--backends", "jax-xla,torch",
                 "--normalizations", "valid_tokens", "--out", str(tmp_path / "again"), *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and "jensen_shannon/random/valid_tokens" in err and "entropy/" not in err


def _without_progress(err: str) -> str:
    """stderr less the progress lines (one per kind, naming it)."""
    return "\n".join(line for line in err.splitlines() if not PROGRESS_LINE.match(line))


PACKED = ["--shape", "2x9x40", "--no-plot"]  # two packed rows of 9 tokens


def test_packed_inputs_hold_the_hard_sequence_cases() -> None:
    """The built-in packed rows: documents of very different lengths, padding ids, an all-masked
    document, and sequences (row, id) that change both modes' loss against one sequence per row."""
    inputs = matrix_module.packed_inputs("cross_entropy", "float32", (2, 9), 40)
    ids, mask = inputs.segment_ids, np.asarray(inputs.loss_mask)
    assert ids.shape == (2, 9) and (ids < 0).any()
    lengths = [int((row == seq).sum()) for row in ids for seq in set(row.tolist()) if seq >= 0]
    assert max(lengths) >= 5 and min(lengths) == 1
    assert any(not mask[r][ids[r] == seq].any() for r in range(2) for seq in set(ids[r].tolist()) if seq >= 0)
    assert (inputs.target[ids < 0] == 40).all()  # out-of-range labels where the ids say padding
    for mode in lossspec.SEQUENCE_NORMALIZATIONS:
        packed = lossspec.oracle("cross_entropy", inputs.logits, inputs.target, mask, normalization=mode, segment_ids=ids)[0]
        per_row = lossspec.oracle("cross_entropy", inputs.logits, np.where(ids < 0, 0, inputs.target), np.where(ids < 0, False, mask),
                                  normalization=mode)[0]
        assert abs(packed - per_row) > 1e-3 * abs(packed), mode


def test_builtin_matrix_covers_the_sequence_modes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """sequence_mean/sequence_sum on packed rows (segment ids) and with one sequence per row; the
    oracle's losses are lossspec.oracle's with those ids; the JSON and the tables name both."""
    code = main(["--kinds", "cross_entropy,jensen_shannon", "--dtypes", "float32,float16", "--backends", "jax-xla,torch",
                 "--normalizations", "sequence_mean,sequence_sum", "--out", str(tmp_path), "--verbose", *PACKED])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS cross_entropy/packed/sequence_mean/float32/2x9x40[segment_ids]" in out
    assert "PASS jensen_shannon/packed/sequence_sum/float32/2x9x40[segment_ids,temperature=2.0" in out
    assert "PASS cross_entropy/random/sequence_mean/float32/2x9x40 " in out
    assert "PASS cross_entropy/packed/sequence_mean/float16/2x9x40[segment_ids]" in out
    assert "sequence_sum/float16" not in out  # the subset: sequence_sum in float32 and bfloat16 only
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert set(report["summary_by_normalization"]) == {"sequence_mean", "sequence_mean+segment_ids", "sequence_sum+segment_ids"}
    assert "sequence_mean+segment_ids" in out  # the console table
    assert all(r["loss_error"] <= 1 and r["grad_error"] <= 1 for r in report["results"])
    inputs = matrix_module.packed_inputs("cross_entropy", "float32", (2, 9), 40)
    oracle_loss = lossspec.oracle("cross_entropy", inputs.logits, inputs.target, inputs.loss_mask,
                                  normalization="sequence_mean", segment_ids=inputs.segment_ids)[0]
    row = next(r for r in report["results"] if r["case"] == "cross_entropy/packed/sequence_mean/float32/2x9x40[segment_ids]")
    assert row["segment_ids"] is True and row["reference_loss"] == oracle_loss
    assert abs(row["loss"] - oracle_loss) <= lossspec.LOSS_RTOL * abs(oracle_loss)


def _drops_segment_ids(inputs, options, loss, grad, honest, kind, grad_output):
    """A backend that ignores segment_ids (each row one sequence, padding counted)."""
    return honest(kind, dataclasses.replace(inputs, segment_ids=None), options, grad_output)


def _sequence_sum_grad_off(inputs, options, loss, grad, honest, kind, grad_output):
    """A 1e-4 relative error in the gradient of sequence_sum alone (25x the fp32 bound)."""
    return loss, grad * (1 + 1e-4) if options["normalization"] == "sequence_sum" else grad


@pytest.mark.parametrize("mutant, failing", [
    (_drops_segment_ids, {"packed/sequence_mean", "packed/sequence_sum"}),
    (_sequence_sum_grad_off, {"packed/sequence_sum"}),
])
def test_perturbed_sequence_mode_is_a_named_failure(mutant, failing: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    honest = backends_module.BACKENDS["torch"].run

    def perturbed(kind, inputs, options, grad_output):
        loss, grad = honest(kind, inputs, options, grad_output)
        return mutant(inputs, options, loss, grad, honest, kind, grad_output)

    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", perturbed))
    code = main(["--kinds", "cross_entropy,entropy", "--dtypes", "float32", "--backends", "jax-xla,torch",
                 "--normalizations", "valid_tokens,sequence_mean,sequence_sum", "--out", str(tmp_path), *PACKED])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    report = json.loads((tmp_path / "parity_report.json").read_text())
    failed = {(r["case"].split("/")[0], "/".join(r["case"].split("/")[1:3]), r["backend"], r["reference"])
              for r in report["results"] if not r["ok"]}
    # (Without its ids, torch reads cross-entropy's out-of-range padding labels and raises: a
    # crash has no output to compare with its twin, so that kind fails against the oracle only.)
    assert {(kind, case) for kind, case, backend, reference in failed if (backend, reference) == ("torch", "oracle")} \
        == {(kind, case) for kind in ("cross_entropy", "entropy") for case in failing}
    assert {case for _, case, _, _ in failed} == failing
    assert f"cross_entropy/{sorted(failing)[-1]}/float32/2x9x40[segment_ids" in captured.err
    assert report["summary_by_normalization"]["valid_tokens"]["failed"] == 0
    assert report["summary_by_normalization"]["sequence_mean"]["failed"] == 0  # one sequence per row: no ids to drop


def test_perturbed_backend_fails_and_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    honest = backends_module.BACKENDS["torch"].run

    def perturbed(kind, inputs, options, grad_output):
        loss, grad = honest(kind, inputs, options, grad_output)
        if kind == "forward_kl":
            grad = grad * (1 + 1e-4)  # a 1e-4 relative error: 25x the fp32 bound
        return loss, grad

    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", perturbed))
    code = main(["--kinds", "cross_entropy,forward_kl", "--dtypes", "float32", "--backends", "jax-xla,torch",
                 "--normalizations", "valid_tokens", "--out", str(tmp_path), *SMALL])
    captured = capsys.readouterr()
    assert code == 1
    assert "FAIL forward_kl/random/valid_tokens/float32/3x40" in captured.out
    assert "forward_kl/random/valid_tokens/float32/3x40 [torch vs oracle]: grad: worst error" in captured.err
    assert "cross_entropy" not in _without_progress(captured.err)  # the honest kind still passes
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["passed"] is False
    failed = {(r["kind"], r["backend"], r["reference"]) for r in report["results"] if not r["ok"]}
    assert failed == {("forward_kl", "torch", "oracle"), ("forward_kl", "jax-xla", "torch")}


def test_crashing_backend_is_a_named_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def broken(kind, inputs, options, grad_output):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(backends_module.BACKENDS, "jax-xla", Backend("jax-xla", "jax", broken))
    code = main(["--kinds", "soft_cross_entropy", "--dtypes", "float16", "--backends", "jax-xla",
                 "--normalizations", "sum", "--out", str(tmp_path), *SMALL])
    assert code == 1
    assert "RuntimeError: kernel exploded" in capsys.readouterr().err


def test_nothing_to_compare_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Only the oracle (or no importable framework): zero comparisons must not report a pass."""
    code = main(["--kinds", "cross_entropy", "--dtypes", "float32", "--backends", "oracle", "--out", str(tmp_path), *SMALL])
    assert code == 2
    assert "no backend to compare with the oracle" in capsys.readouterr().err
    monkeypatch.setattr(cli_module, "available", lambda names: ([], {name: "torch unavailable: test" for name in names}))
    code = main(["--kinds", "cross_entropy", "--dtypes", "float32", "--backends", "torch", "--out", str(tmp_path), *SMALL])
    assert code == 2
    assert not (tmp_path / "parity_report.json").exists()


def _jax_program(path: Path) -> str:
    """What a JAX user would do: dump a bf16 batch of their training step."""
    return f"""
import numpy as np, jax, jax.numpy as jnp
key = jax.random.PRNGKey(0)
logits = (3 * jax.random.normal(key, (2, 6, 50))).astype(jnp.bfloat16)
teacher = (3 * jax.random.normal(jax.random.PRNGKey(1), (2, 6, 50))).astype(jnp.bfloat16)
labels = jax.random.randint(key, (2, 6), 0, 50).at[0, 0].set(-100)
mask = jax.random.bernoulli(key, 0.7, (2, 6))
np.savez({str(path)!r}, logits=np.asarray(logits), labels=np.asarray(labels), teacher_logits=np.asarray(teacher),
         loss_mask=np.asarray(mask))
"""


def _torch_program(npz: Path, safetensors: Path) -> str:
    return f"""
import numpy as np, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
logits = 3 * torch.randn(4, 5, 70, generator=g)
labels = torch.randint(0, 70, (4, 5), generator=g); labels[1, 2] = -100
weights = torch.rand(4, 5, generator=g)
np.savez({str(npz)!r}, logits=logits.numpy(), labels=labels.numpy(), loss_mask=weights.numpy())
teacher = 3 * torch.randn(4, 5, 70, generator=g)
save_file({{"logits": logits.bfloat16(), "teacher_logits": teacher.bfloat16(), "loss_mask": weights > 0.3}}, {str(safetensors)!r})
"""


def _run_programs(*programs: str) -> None:
    """Run each program in its own interpreter (a JAX-only and a torch-only user program, as
    users have them), all at once: their framework imports overlap instead of adding up."""
    running = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for code in programs]
    for process in running:
        out, err = process.communicate()
        assert process.returncode == 0, (process.args, out, err)


def test_inputs_from_jax_and_torch_programs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    jax_file, torch_file, st_file = tmp_path / "jax_batch.npz", tmp_path / "torch_batch.npz", tmp_path / "torch.safetensors"
    _run_programs(_jax_program(jax_file), _torch_program(torch_file, st_file))
    backends = ["--backends", "jax-xla,torch", "--verbose"]
    assert main(["--inputs", str(jax_file), "--out", str(tmp_path), *backends, "--no-plot"]) == 0
    out = capsys.readouterr().out
    # labels and teacher logits in the file: all six kinds, all six normalisations, in bf16.
    assert "PASS cross_entropy/jax_batch.npz/valid_tokens/bfloat16/2x6x50" in out
    assert "PASS reverse_kl/jax_batch.npz/none/bfloat16/2x6x50" in out
    assert "PASS jensen_shannon/jax_batch.npz/sequence_mean/bfloat16/2x6x50[beta=0.5" in out
    assert "36 cases" in out
    assert main(["--inputs", str(torch_file), "--out", str(tmp_path), *backends, "--no-plot", "--label-smoothing", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "PASS cross_entropy/torch_batch.npz/tokens/float32/4x5x70[" in out and "12 cases" in out  # and entropy
    assert main(["--inputs", str(st_file), "--out", str(tmp_path), *backends, "--no-plot", "--temperature", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS forward_kl/torch.safetensors/sum/bfloat16/4x5x70[temperature=2.0" in out and "30 cases" in out


def test_inputs_with_entropy_jensen_shannon_and_segment_ids(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A packed batch (teacher logits, weights, segment ids with padding): every normalisation of
    entropy and JSD (--beta) passes, with the oracle's losses for those ids; a logits-only
    safetensors file checks entropy alone."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(11)
    logits = (3 * rng.normal(size=(2, 7, 23))).astype(np.float32)
    teacher = (3 * rng.normal(size=(2, 7, 23))).astype(np.float32)
    mask = np.where(rng.random((2, 7)) < 0.8, rng.uniform(0.5, 2.0, (2, 7)), 0.0).astype(np.float32)
    ids = np.array([[0, 0, 0, 0, 0, 1, 2], [5, 5, 9, 9, 9, -1, -1]], np.int32)
    np.savez(tmp_path / "packed.npz", logits=logits, teacher_logits=teacher, loss_mask=mask, segment_ids=ids)
    code = main(["--inputs", str(tmp_path / "packed.npz"), "--kinds", "entropy,jensen_shannon", "--beta", "0.3",
                 "--backends", "jax-xla,torch", "--no-plot", "--out", str(tmp_path), "--verbose"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "12 cases" in out
    assert "PASS jensen_shannon/packed.npz/sequence_mean/float32/2x7x23[segment_ids,beta=0.3," in out
    assert "PASS entropy/packed.npz/sequence_sum/float32/2x7x23[segment_ids,temperature=1.0,logit_scale=1.0]" in out
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert {r["normalization"] for r in report["results"]} == set(lossspec.ALL_NORMALIZATIONS)
    assert all(r["segment_ids"] for r in report["results"])
    for kind, target, options in (("jensen_shannon", teacher, {"beta": 0.3}), ("entropy", None, {})):
        for mode in lossspec.SEQUENCE_NORMALIZATIONS:
            expected = lossspec.oracle(kind, logits, target, mask, normalization=mode, segment_ids=ids, **options)[0]
            one_per_row = lossspec.oracle(kind, logits, target, mask, normalization=mode, **options)[0]
            assert abs(expected - one_per_row) > 1e-3 * abs(expected)  # the ids matter
            row = next(r for r in report["results"]
                       if r["case"].startswith(f"{kind}/packed.npz/{mode}/") and r["backend"] == "torch" and r["reference"] == "oracle")
            assert row["reference_loss"] == expected and abs(row["loss"] - expected) <= lossspec.LOSS_RTOL * abs(expected)
    save_file({"logits": logits, "segment_ids": ids.astype(np.int64)}, str(tmp_path / "logits.safetensors"))
    code = main(["--inputs", str(tmp_path / "logits.safetensors"), "--backends", "torch", "--no-plot",
                 "--normalizations", "sequence_mean", "--out", str(tmp_path), "--verbose"])
    out = capsys.readouterr().out
    assert code == 0 and "1 cases" in out and "PASS entropy/logits.safetensors/sequence_mean/float32/2x7x23[segment_ids," in out


def _write_bad_files(folder: Path) -> None:
    (folder / "junk.npz").write_bytes(b"not a zip")
    (folder / "empty.npz").write_bytes(b"")
    with open(folder / "npy.npz", "wb") as handle:  # np.save to a handle keeps the .npz name
        np.save(handle, np.zeros((3, 5), np.float32))
    np.savez(folder / "whole.npz", logits=np.zeros((3, 5), np.float32), labels=np.zeros(3, np.int64))
    whole = (folder / "whole.npz").read_bytes()
    (folder / "truncated.npz").write_bytes(whole[: len(whole) // 2])  # starts like a zip, is not one
    (folder / "short.safetensors").write_bytes(b"\x05")
    _write_safetensors(folder / "list_header.safetensors", [1, 2])
    _write_safetensors(folder / "past_end.safetensors",
                       {"logits": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]}}, body=b"\0" * 8)
    _write_safetensors(folder / "no_dtype.safetensors", {"logits": {"shape": [2], "data_offsets": [0, 8]}}, body=b"\0" * 8)
    _write_safetensors(folder / "wrong_size.safetensors",
                       {"logits": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 8]}}, body=b"\0" * 8)
    np.savez(folder / "no_logits.npz", labels=np.zeros(3, np.int64))
    np.savez(folder / "no_target.npz", logits=np.zeros((3, 5), np.float32), loss_mask=np.ones(3, bool))
    np.savez(folder / "teacher_only.npz", logits=np.zeros((3, 5), np.float32), teacher_logits=np.zeros((3, 5), np.float32))
    np.savez(folder / "bad_shapes.npz", logits=np.zeros((3, 5), np.float32), labels=np.zeros(4, np.int64))
    np.savez(folder / "bad_label.npz", logits=np.zeros((3, 5), np.float32), labels=np.array([0, 7, 1]))
    np.savez(folder / "ids_shape.npz", logits=np.zeros((2, 3, 5), np.float32), segment_ids=np.zeros((2, 4), np.int64))
    np.savez(folder / "ids_float.npz", logits=np.zeros((2, 3, 5), np.float32), segment_ids=np.zeros((2, 3), np.float32))
    np.savez(folder / "one_token.npz", logits=np.zeros(5, np.float32))
    (folder / "a_file").write_text("")
    # Hostile headers: sizes that wrap around in int64 ([2**32, 2**32] floats are 2**66 bytes, 0
    # modulo 2**64), JSON's true and 1e30 as sizes, a dtype that is not a name, a header of lists
    # nested 200k deep (past Python's recursion limit), and a .npy member declaring 37 GiB.
    for name, shape in (("wraps", [2**32, 2**32]), ("bool_shape", [True, 8]), ("float_shape", [1e30, 1])):
        _write_safetensors(folder / f"{name}.safetensors", {"logits": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    _write_safetensors(folder / "list_dtype.safetensors", {"logits": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
                       body=b"\0" * 8)
    _write_safetensors(folder / "deep.safetensors", b"[" * 200_000 + b"]" * 200_000)
    _write_npz_member(folder / "declares_37gib.npz", "logits", (10_000_000_000,), b"\0" * 64)


def _write_safetensors(path: Path, header: object, body: bytes = b"") -> None:
    """A safetensors file by hand: 8-byte little-endian header size, JSON header (or raw header
    bytes), raw bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def _npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """The .npy header np.save writes for an array of ``shape`` and dtype ``descr``."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _write_npz_member(path: Path, name: str, shape: tuple[int, ...], data: bytes) -> None:
    """An .npz whose one member's .npy header declares ``shape`` (float32) over ``data``."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}.npy", _npy_header(shape) + data)


# (arguments, given the folder holding the files of _write_bad_files; a piece of the one-line error)
BAD_CASES = {
    "missing_file": (lambda d: ["--inputs", str(d / "missing.npz")], "no such file"),
    "not_npz": (lambda d: ["--inputs", str(d / "junk.npz")], "not an .npz file (an .npz is a zip archive"),
    "empty_npz": (lambda d: ["--inputs", str(d / "empty.npz")], "empty.npz: empty file"),
    "npy_named_npz": (lambda d: ["--inputs", str(d / "npy.npz")], "a .npy file (one array), not an .npz"),
    "truncated_npz": (lambda d: ["--inputs", str(d / "truncated.npz")], "unreadable .npz archive (BadZipFile: File is not a zip file)"),
    "short_safetensors": (lambda d: ["--inputs", str(d / "short.safetensors")], "not a safetensors file (too short)"),
    "list_header_safetensors": (lambda d: ["--inputs", str(d / "list_header.safetensors")],
                                "not a safetensors file (the header is not a JSON object)"),
    "past_end_safetensors": (lambda d: ["--inputs", str(d / "past_end.safetensors")],
                             "tensor 'logits': data_offsets [0, 60] run past the end of the data (8 bytes)"),
    "no_dtype_safetensors": (lambda d: ["--inputs", str(d / "no_dtype.safetensors")],
                             "tensor 'logits': header entry needs 'dtype', 'shape' and 'data_offsets'"),
    "wrong_size_safetensors": (lambda d: ["--inputs", str(d / "wrong_size.safetensors")],
                               "tensor 'logits': shape [3, 5] of F32 needs 60 bytes; data_offsets hold 8"),
    "size_wraps_safetensors": (lambda d: ["--inputs", str(d / "wraps.safetensors")],
                               "shape [4294967296, 4294967296] of F32 needs 73786976294838206464 bytes; data_offsets hold 0"),
    "bool_shape_safetensors": (lambda d: ["--inputs", str(d / "bool_shape.safetensors")],
                               "tensor 'logits': shape must be a list of sizes; got [True, 8]"),
    "float_shape_safetensors": (lambda d: ["--inputs", str(d / "float_shape.safetensors")],
                                "tensor 'logits': shape must be a list of sizes; got [1e+30, 1]"),
    "list_dtype_safetensors": (lambda d: ["--inputs", str(d / "list_dtype.safetensors")],
                               "tensor 'logits' has unsupported dtype ['F32']"),
    "deep_header_safetensors": (lambda d: ["--inputs", str(d / "deep.safetensors")],
                                "not a safetensors file (the header is nested too deeply)"),
    "npz_member_declares_37_gib": (lambda d: ["--inputs", str(d / "declares_37gib.npz")],
                                   "the array 'logits' declares shape [10000000000] of float32 (40000000000 bytes); "
                                   "the archive holds 64"),
    "no_logits": (lambda d: ["--inputs", str(d / "no_logits.npz")], "no 'logits' array (found: labels)"),
    "no_target": (lambda d: ["--inputs", str(d / "no_target.npz"), "--kinds", "cross_entropy,forward_kl,reverse_kl"],
                  "cross_entropy needs 'labels'; forward_kl, reverse_kl need 'teacher_logits' (found: logits, loss_mask)"),
    # segment ids and the sequence modes: lossspec's checks and messages.
    "segment_ids_shape": (lambda d: ["--inputs", str(d / "ids_shape.npz")],
                          "ids_shape.npz: segment_ids must have the shape of the labels (the leading shape of logits) "
                          "[2, 3]; got [2, 4]"),
    "segment_ids_float": (lambda d: ["--inputs", str(d / "ids_float.npz"), "--normalizations", "sequence_sum"],
                          "ids_float.npz: segment_ids must be an integer array of shape [2, 3]; got dtype float32"),
    "sequence_mode_without_time_axis": (lambda d: ["--inputs", str(d / "one_token.npz"), "--normalizations", "sequence_mean"],
                                        "normalization 'sequence_mean' needs a time axis"),
    "beta_out_of_range": (lambda d: ["--inputs", str(d / "teacher_only.npz"), "--beta", "1.5"],
                          "teacher_only.npz: beta must be in [0, 1], got 1.5"),
    "kind_without_its_array": (lambda d: ["--inputs", str(d / "teacher_only.npz"), "--kinds", "cross_entropy"],
                               "cross_entropy needs 'labels' (found: logits, teacher_logits)"),
    "bad_shapes": (lambda d: ["--inputs", str(d / "bad_shapes.npz")], "labels must have the leading shape of logits [3]"),
    "bad_label": (lambda d: ["--inputs", str(d / "bad_label.npz")], "labels must lie in [0, 5)"),
    "unknown_kind": (lambda d: ["--kinds", "crossentropy"], "unknown kind crossentropy"),
    "bad_shape": (lambda d: ["--shape", "12"], "shape needs at least one leading dim"),
    "huge_shape": (lambda d: ["--shape", "1000000x1000000x1000"],
                   "argument --shape: shape '1000000x1000000x1000' has 1000000000000000 logits; the built-in matrix "
                   "takes at most 16777216"),
    "negative_seed": (lambda d: ["--seed", "-1"], "argument --seed: seed must be in [0, 2**63 - 1]; got -1"),
    "unknown_backend": (lambda d: ["--backends", "jax-xla,cuda"], "unknown backend cuda"),
    "full_and_backends": (lambda d: ["--full", "--backends", "torch"], "give --full or --backends, not both"),
    "unknown_option": (lambda d: ["--bogus"], "unrecognized arguments: --bogus"),
    # --out: checked before anything runs (a valid built-in run otherwise).
    "out_is_a_file": (lambda d: ["--kinds", "cross_entropy", "--out", str(d / "a_file")],
                      "--out {d}/a_file is a file; --out names the folder for parity_report.json"),
    "out_under_a_file": (lambda d: ["--kinds", "cross_entropy", "--out", str(d / "a_file" / "reports")],
                         "cannot write there ("),
}


def _assert_one_line_error(code: object, out: str, err: str, expected: str) -> None:
    assert code == 2, (code, out, err)
    assert out == "", out  # nothing on stdout: the error alone, on stderr
    assert err.strip().count("\n") == 0, err  # one line, no traceback, no usage dump
    assert err.startswith("lossparity: error:") and expected in err, err


@pytest.fixture
def no_backend_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend (the oracle too) replaced by one that fails the test: a bad argument, file or
    --out must be found before any case runs."""
    def ran(kind, inputs, options, grad_output):
        raise AssertionError("a backend ran before the bad argument was reported")

    for name, backend in list(backends_module.BACKENDS.items()):
        monkeypatch.setitem(backends_module.BACKENDS, name, Backend(name, backend.framework, ran))


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_files_and_arguments_give_one_line_errors(case: str, tmp_path: Path, capfd: pytest.CaptureFixture,
                                                      no_backend_may_run: None) -> None:
    """Every bad case through the command's own entry function, in this process (a fresh
    interpreter per case cost seconds of JAX and torch imports each); the console entry point
    itself is tested by test_bad_file_fails_before_jax_and_torch_are_imported."""
    _write_bad_files(tmp_path)
    make_argv, expected = BAD_CASES[case]
    capfd.readouterr()  # only what this call writes; capfd also sees output at the file-descriptor level
    try:  # the case's own --out, when it has one, comes last and wins
        code = main(["--no-plot", "--out", str(tmp_path), *make_argv(tmp_path)])
    except SystemExit as exit_:  # as `python -m lossparity` would turn it into a status
        code = 0 if exit_.code is None else exit_.code
    captured = capfd.readouterr()
    _assert_one_line_error(code, captured.out, captured.err, expected.replace("{d}", str(tmp_path)))


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: a read-only one of ours, or for root (who
    writes anywhere chmod allows) /sys, when it refuses too."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pass
    except OSError:
        return Path("/sys")
    pytest.skip("no folder here refuses writes to root")


def test_unwritable_out_is_a_one_line_error(tmp_path: Path, capfd: pytest.CaptureFixture, no_backend_may_run: None) -> None:
    folder = _unwritable_folder(tmp_path)
    try:
        code = main(["--kinds", "cross_entropy", "--no-plot", "--out", str(folder / "lossparity-reports")])
    finally:
        if folder != Path("/sys"):
            folder.chmod(0o700)
    captured = capfd.readouterr()
    _assert_one_line_error(code, captured.out, captured.err, f"--out {folder}/lossparity-reports: cannot write there (")
    assert not (folder / "lossparity-reports").exists()


def _write_zip_bomb(path: Path, inflated_bytes: int, name: str = "logits", chunk: int = 2**20) -> None:
    """An .npz of one deflated member, ``name.npy`` (float32 zeros), that inflates to
    ``inflated_bytes`` from about a thousandth of that: a real bomb, its sizes and CRC honest,
    which zipfile inflates whole. Each further chunk of zeros deflates (after a full flush) to the
    same bytes, so the stream is built without deflating gigabytes."""
    head = _npy_header(((inflated_bytes - 128) // 4,))
    assert len(head) == 128 and inflated_bytes % chunk == 0
    zeros = bytes(chunk)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate, as in a zip
    first = packer.compress(head + zeros[len(head):]) + packer.flush(zlib.Z_FULL_FLUSH)
    block = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    count = inflated_bytes // chunk
    body = first + block * (count - 1) + packer.flush()
    crc = zlib.crc32(head + zeros[len(head):])
    for _ in range(count - 1):
        crc = zlib.crc32(zeros, crc)
    member = f"{name}.npy".encode()
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, zipfile.ZIP_DEFLATED, 0, 0, crc, len(body), inflated_bytes,
                        len(member), 0) + member
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, zipfile.ZIP_DEFLATED, 0, 0, crc, len(body),
                          inflated_bytes, len(member), 0, 0, 0, 0, 0, 0) + member
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(body), 0)
    path.write_bytes(local + body + central + end)


@pytest.mark.parametrize("name, expected", [
    ("logits", "the array 'logits' would inflate from {packed} to 1992294400 bytes (more than 100 times): refused as a zip bomb"),
    ("extra", "no 'logits' array (found: extra)"),  # the names are checked first: a bomb under a wrong one too
])
def test_npz_zip_bomb_is_refused_before_it_inflates(name: str, expected: str, tmp_path: Path, capfd: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch, no_backend_may_run: None) -> None:
    """2 MB on disk, 1.9 GB inflated: refused from the sizes the zip's central directory declares,
    in well under a second and a few MiB of memory (inflating it takes seconds and 1.9 GB, more
    with tracemalloc: a reader that inflates it is stopped at 16 MiB by an assertion instead)."""
    bomb = tmp_path / "bomb.npz"
    _write_zip_bomb(bomb, 1900 * 2**20, name)
    packed = zipfile.ZipFile(bomb).getinfo(f"{name}.npy").compress_size
    assert bomb.stat().st_size < 2.1e6 and packed < 2.1e6
    inflated = {"bytes": 0}

    def capped(read):  # zipfile's reads (readinto goes through read), counted and capped
        def counting(self, *args):
            data = read(self, *args)
            inflated["bytes"] += len(data)
            assert inflated["bytes"] <= 16 * 2**20, "the reader inflates the bomb"
            return data
        return counting

    for method in ("read", "read1"):
        monkeypatch.setattr(zipfile.ZipExtFile, method, capped(getattr(zipfile.ZipExtFile, method)))
    capfd.readouterr()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        code = main(["--no-plot", "--out", str(tmp_path), "--inputs", str(bomb)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - started
    captured = capfd.readouterr()
    _assert_one_line_error(code, captured.out, captured.err, expected.format(packed=packed))
    assert inflated["bytes"] == 0
    assert peak < 16 * 2**20, peak
    assert seconds < 2, seconds


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_files_over_the_size_limit_are_refused_unread(suffix: str, tmp_path: Path, capfd: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch, no_backend_may_run: None) -> None:
    """MAX_INPUT_BYTES (8 GiB), lowered here to 1000 bytes: an .npz whose members declare more
    (uncompressed, from the zip's central directory) or a larger .safetensors file is refused."""
    monkeypatch.setattr(inputs_module, "MAX_INPUT_BYTES", 1000)
    logits = np.zeros((10, 50), np.float32)  # 2000 bytes
    path = tmp_path / f"big{suffix}"
    if suffix == ".npz":
        np.savez(path, logits=logits)
        expected = f"the arrays declare {2000 + len(_npy_header((10, 50)))} bytes uncompressed; lossparity reads input files of at most 1000 bytes"
    else:
        _write_safetensors(path, {"logits": {"dtype": "F32", "shape": [10, 50], "data_offsets": [0, 2000]}}, logits.tobytes())
        expected = f"{path.stat().st_size} bytes; lossparity reads input files of at most 1000 bytes"
    capfd.readouterr()
    code = main(["--no-plot", "--out", str(tmp_path), "--inputs", str(path)])
    captured = capfd.readouterr()
    _assert_one_line_error(code, captured.out, captured.err, expected)


def test_reports_replace_links_never_write_through_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """Symbolic links named parity_report.json (to a file of someone else's) and parity_report.png
    (to a path that does not exist yet) in --out: each is replaced by the report, and neither the
    file it pointed to is touched nor the missing one created."""
    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", backends_module.BACKENDS["oracle"].run))
    monkeypatch.setattr(cli_module, "available", lambda names: (list(names), {}))  # no framework import needed
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not yours")
    (out / "parity_report.json").symlink_to(elsewhere / "precious.txt")
    (out / "parity_report.png").symlink_to(elsewhere / "new.png")
    code = main(["--kinds", "cross_entropy", "--dtypes", "float32", "--backends", "torch", "--normalizations", "sum",
                 "--shape", "3x40", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    assert (elsewhere / "precious.txt").read_text() == "not yours"
    assert sorted(path.name for path in elsewhere.iterdir()) == ["precious.txt"]
    assert sorted(path.name for path in out.iterdir()) == ["parity_report.json", "parity_report.png"]  # no temporaries left
    assert not any(path.is_symlink() for path in out.iterdir())
    assert json.loads((out / "parity_report.json").read_text())["passed"] is True
    assert (out / "parity_report.png").read_bytes().startswith(b"\x89PNG")


def _imported_modules(importtime_log: str) -> set[str]:
    """Module names from `python -X importtime` lines: 'import time: self | cumulative | name'."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("bad", ["junk.npz", "bad_label.npz", "wrong_size.safetensors"])
def test_bad_file_fails_before_jax_and_torch_are_imported(bad: str, tmp_path: Path) -> None:
    """`python -m lossparity` in a fresh interpreter with `-X importtime`, which logs every module
    the interpreter imports on stderr: a bad file is reported (status 2, one line) with neither
    JAX nor torch in that log, i.e. before the seconds their imports take."""
    _write_bad_files(tmp_path)
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "lossparity", "--inputs", str(tmp_path / bad),
                             "--backends", "jax-xla,torch", "--no-plot", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    imported = _imported_modules(result.stderr)
    assert "lossparity.cli" in imported and "numpy" in imported, result.stderr[-2000:]  # the log is read right
    frameworks = sorted(m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "torch", "jaxloss", "torchloss"))
    assert frameworks == [], frameworks[:10]
    error = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    _assert_one_line_error(result.returncode, result.stdout, error, f"{tmp_path / bad}:")


def _user_files(folder: Path) -> dict[str, Path]:
    """Small user batches: cross-entropy only, distillation only, both, logits only (entropy)."""
    rng = np.random.default_rng(3)
    logits = (3 * rng.normal(size=(2, 3, 11))).astype(np.float32)
    labels = rng.integers(0, 11, (2, 3))
    teacher = (3 * rng.normal(size=(2, 3, 11))).astype(np.float32)
    files = {"ce": folder / "ce.npz", "distill": folder / "distill.npz", "both": folder / "both.npz",
             "logits_only": folder / "logits_only.npz"}
    np.savez(files["ce"], logits=logits, labels=labels)
    np.savez(files["logits_only"], logits=logits)
    np.savez(files["distill"], logits=logits, teacher_logits=teacher)
    np.savez(files["both"], logits=logits, labels=labels, teacher_logits=teacher)
    return files


# (file of _user_files or None for the built-in matrix, extra arguments, the warning or None)
WARN_CASES = {
    "label_smoothing_distill_file": ("distill", ["--label-smoothing", "0.1"],
                                     "--label-smoothing applies only to cross_entropy; ignored (this run checks "
                                     "soft_cross_entropy, forward_kl, reverse_kl, entropy, jensen_shannon)"),
    "ignore_index_distill_file": ("distill", ["--kinds", "reverse_kl", "--ignore-index", "0"],
                                  "--ignore-index applies only to cross_entropy; ignored (this run checks reverse_kl)"),
    "temperature_ce_file": ("ce", ["--kinds", "cross_entropy", "--temperature", "2"],
                            "--temperature applies only to soft_cross_entropy, forward_kl, reverse_kl, entropy, "
                            "jensen_shannon; ignored (this run checks cross_entropy)"),
    "beta_without_jsd": ("distill", ["--kinds", "forward_kl,entropy", "--beta", "0.3"],
                         "--beta applies only to jensen_shannon; ignored (this run checks forward_kl, entropy)"),
    "kinds_without_their_arrays": ("logits_only", ["--kinds", "entropy,cross_entropy,reverse_kl"],
                                   "skipping cross_entropy, reverse_kl: cross_entropy needs 'labels'; reverse_kl needs "
                                   "'teacher_logits' (found: logits)"),
    "kind_without_its_array": ("ce", ["--kinds", "cross_entropy,reverse_kl"],
                               "skipping reverse_kl: it needs 'teacher_logits' (found: labels, logits)"),
    "shape_with_inputs": ("ce", ["--shape", "2x3x4"], "--shape applies only to the built-in matrix; ignored with --inputs"),
    "seed_with_inputs": ("ce", ["--seed", "4"], "--seed applies only to the built-in matrix; ignored with --inputs"),
    "two_dtypes_with_inputs": ("ce", ["--dtypes", "float16,bfloat16"],
                               "--dtypes: with --inputs the file runs in one dtype; using float16, ignoring bfloat16"),
    "z_loss_builtin": (None, ["--kinds", "cross_entropy", "--dtypes", "float32", "--shape", "2x6", "--z-loss", "0.1"],
                       "--z-loss applies only with --inputs; ignored (the built-in matrix runs its own option variants)"),
    "all_options_apply": ("both", ["--label-smoothing", "0.1", "--temperature", "2", "--logit-scale", "1.5",
                                   "--beta", "0.3"], None),
    "beta_builtin": (None, ["--kinds", "jensen_shannon", "--dtypes", "float32", "--shape", "2x6", "--beta", "0.3"],
                     "--beta applies only with --inputs; ignored (the built-in matrix runs its own option variants)"),
}


@pytest.mark.parametrize("case", list(WARN_CASES))
def test_options_that_do_not_apply_warn(case: str, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    file, extra, warning = WARN_CASES[case]
    source = [] if file is None else ["--inputs", str(_user_files(tmp_path)[file])]
    capfd.readouterr()
    code = main([*source, "--backends", "torch", "--normalizations", "sum", "--no-plot", "--out", str(tmp_path), *extra])
    captured = capfd.readouterr()
    assert code == 0, captured
    expected = [] if warning is None else [f"lossparity: warning: {warning}"]
    assert _without_progress(captured.err).splitlines() == expected


def test_loss_values_are_printed_and_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each backend's loss and the oracle's, as numbers, in the line of the case and in the JSON;
    for "none" the sum of the per-token losses."""
    import torch

    import torchloss

    code = main(["--kinds", "cross_entropy", "--dtypes", "float32", "--backends", "jax-xla,torch",
                 "--normalizations", "valid_tokens,none", "--out", str(tmp_path), "--verbose", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    made = lossspec.make_case("cross_entropy", "random", lead_shape=(3,), vocab=40, dtype="float32", seed=0)
    results = json.loads((tmp_path / "parity_report.json").read_text())["results"]
    for normalization in ("valid_tokens", "none"):
        oracle_loss = float(np.sum(lossspec.oracle("cross_entropy", made.logits, made.target, made.loss_mask,
                                                   normalization=normalization)[0]))
        torch_loss = float(torchloss.cross_entropy(torch.from_numpy(made.logits), torch.from_numpy(made.target),
                                                   torch.from_numpy(made.loss_mask), normalization=normalization).double().sum())
        name = f"cross_entropy/random/{normalization}/float32/3x40"
        rows = {(r["backend"], r["reference"]): r for r in results if r["case"] == name}
        assert rows[("torch", "oracle")]["reference_loss"] == oracle_loss
        assert rows[("jax-xla", "oracle")]["reference_loss"] == oracle_loss
        assert rows[("torch", "oracle")]["loss"] == torch_loss  # the backend's own number, not the oracle's
        assert rows[("jax-xla", "torch")]["reference_loss"] == torch_loss
        assert abs(rows[("jax-xla", "oracle")]["loss"] - oracle_loss) <= lossspec.LOSS_RTOL * max(1, abs(oracle_loss))
        line = next(line for line in out.splitlines() if f"PASS {name}" in line)
        what = "loss" if normalization != "none" else "sum(loss)"
        assert f"oracle {what}={oracle_loss:.9g}" in line and f"torch {what}={torch_loss:.9g}" in line, line
        assert f"jax-xla {what}={rows[('jax-xla', 'oracle')]['loss']:.9g}" in line, line


def _nan_batch(path: Path) -> None:
    """A cross-entropy batch with one NaN logit in a valid row: SPEC gives that token a NaN loss."""
    rng = np.random.default_rng(5)
    logits = (2 * rng.normal(size=(2, 3, 13))).astype(np.float32)
    logits[1, 2, 4] = np.nan
    np.savez(path, logits=logits, labels=rng.integers(0, 13, (2, 3)))


def test_nan_that_the_oracle_shares_is_flagged_nonfinite_not_pass(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _nan_batch(tmp_path / "nan.npz")
    code = main(["--inputs", str(tmp_path / "nan.npz"), "--kinds", "cross_entropy", "--backends", "jax-xla,torch",
                 "--normalizations", "valid_tokens,none", "--out", str(tmp_path), "--no-plot"])
    captured = capsys.readouterr()
    assert code == 3, captured
    assert "PASS" not in captured.out
    assert "NONFINITE cross_entropy/nan.npz/valid_tokens/float32/2x3x13" in captured.out
    assert "oracle loss=nan" in captured.out
    assert "NONFINITE: 6 comparison(s)" in captured.err
    # Each line names whose values are non-finite too: the oracle's, or the twin backend's.
    assert "[torch vs oracle]: non-finite where the oracle's is too: loss 1 of 1" in captured.err
    assert "[jax-xla vs torch]: non-finite where torch's is too: loss 1 of 1" in captured.err
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["passed"] is False and report["status"] == "nonfinite"
    assert {r["status"] for r in report["results"]} == {"nonfinite"}
    assert all(r["ok"] is False for r in report["results"])
    # per-token: the NaN token alone; its gradient row NaN, the other rows finite and compared.
    none = next(r for r in report["results"] if r["case"].startswith("cross_entropy/nan.npz/none") and r["backend"] == "torch")
    assert none["loss"] == "nan" and none["reference_loss"] == "nan"
    assert 0 < none["grad_error"] <= 1


def _poisoned(where: str):
    honest = backends_module.BACKENDS["torch"].run

    def run(kind, inputs, options, grad_output):
        loss, grad = honest(kind, inputs, options, grad_output)
        if where == "loss":
            loss = np.full_like(loss, np.inf)
        else:
            grad = grad.copy()
            grad.flat[3] = np.nan
        return loss, grad

    return run


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_backend_where_the_oracle_is_finite_fails(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", _poisoned(where)))
    code = main(["--kinds", "forward_kl", "--dtypes", "float32", "--backends", "torch", "--normalizations", "sum",
                 "--out", str(tmp_path), *SMALL])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert "FAIL forward_kl/random/sum/float32/3x40" in captured.out
    value = "inf" if where == "loss" else "nan"
    assert f"[torch vs oracle]: {where} is non-finite ({value}) where the oracle's is finite" in captured.err
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["status"] == "fail" and {r["status"] for r in report["results"]} == {"fail"}


def test_report_is_strict_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN and inf (a crash's error, a NaN loss) are written as strings: any JSON reader takes it."""
    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", _poisoned("loss")))
    main(["--kinds", "forward_kl", "--dtypes", "float32", "--backends", "torch", "--normalizations", "sum",
          "--out", str(tmp_path), *SMALL])
    text = (tmp_path / "parity_report.json").read_text()

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    report = json.loads(text, parse_constant=refuse)
    assert report["results"][0]["loss"] == "inf" and report["results"][0]["loss_error"] == "inf"


def test_help_documents_the_options() -> None:
    result = subprocess.run([sys.executable, "-m", "lossparity", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--inputs", "--kinds", "--backends", "--full", "--dtypes", "--shape", "--normalizations", "--out",
                   "--verbose", "--quiet"):
        assert option in result.stdout
    assert "3 non-finite" in " ".join(result.stdout.split())


def _worst(rows: list[dict]) -> float:
    return max(max(r["loss_error"], r["grad_error"]) for r in rows)


def test_default_run_is_quick_and_compact(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """No --backends: the fast backends only (the interpreted kernels behind --full); no line per
    passing case; progress on stderr, one line per kind (stderr is not a terminal here); at the end
    one table of the worst error per kind and backend (the JSON's numbers) and a one-line summary."""
    code = main(["--kinds", "cross_entropy,entropy", "--dtypes", "float32", "--out", str(tmp_path), *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["backends"] == ["jax-xla", "torch"]
    assert {r["backend"] for r in report["results"]} == {"jax-xla", "torch"}
    lines = captured.out.splitlines()
    assert "; --full adds jax-pallas, torch-triton" in lines[0]
    assert not any(line.startswith(("[", "PASS")) or " PASS " in line for line in lines), captured.out
    assert len(lines) <= 10, captured.out
    header = next(line for line in lines if line.startswith("worst error / bound"))
    assert header.split()[4:] == ["jax-xla", "torch", "jax-xla~torch", "verdict"]
    results = report["results"]
    for kind in ("cross_entropy", "entropy"):
        row = next(line for line in lines if line.startswith(kind + " ")).split()
        names = ("jax-xla~oracle", "torch~oracle", "jax-xla~torch")
        expected = [f"{_worst([r for r in results if r['kind'] == kind and r['backend'] + '~' + r['reference'] == name]):.2g}"
                    for name in names]
        assert row[1:] == expected + ["pass"], (row, expected)
        summary = report["summary_by_kind"][kind]
        assert set(summary) == {"jax-xla", "torch", "jax-xla~torch"} and summary["torch"]["cases"] == 15  # 12 token-level cases, 3 per-sequence
    assert lines[-1].startswith(f"lossparity: PASS: all {len(results)} comparisons (30 cases x jax-xla, torch and twins)")
    assert f"worst {_worst(results):.2g} of the bound" in lines[-1]
    progress = captured.err.splitlines()
    assert len(progress) == 2 and all(PROGRESS_LINE.match(line) for line in progress), progress
    assert "cross_entropy: 45 comparisons, all pass" in progress[0] and "[30/30] entropy" in progress[1]


def test_failures_are_printed_in_full_and_marked_in_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """A failing case: its whole line (losses, errors) on stdout, its message on stderr, a ! in
    the table's cell and the kind's verdict FAIL (n); the honest kind stays quiet."""
    poisoned = _poisoned("grad")
    honest = backends_module.BACKENDS["torch"].run

    def run(kind, inputs, options, grad_output):
        return (poisoned if kind == "forward_kl" else honest)(kind, inputs, options, grad_output)

    monkeypatch.setitem(backends_module.BACKENDS, "torch", Backend("torch", "torch", run))
    code = main(["--kinds", "forward_kl,entropy", "--dtypes", "float32", "--normalizations", "sum,none", "--out", str(tmp_path),
                 *SMALL])
    captured = capsys.readouterr()
    assert code == 1, captured
    failing = [line for line in captured.out.splitlines() if line.startswith("[")]
    assert len(failing) == 4 and all("FAIL forward_kl/" in line and "oracle " in line and "torch loss=" in line or
                                     "torch sum(loss)=" in line for line in failing), captured.out
    lines = captured.out.splitlines()
    table = next(line for line in lines if line.startswith("forward_kl "))
    assert table.split()[2:] == ["inf!", "inf!", "FAIL", "(8)"], table  # torch~oracle and jax-xla~torch, 4 cases
    assert next(line for line in lines if line.startswith("entropy ")).endswith(" pass")
    assert captured.err.count("[torch vs oracle]: grad is non-finite (nan)") == 4
    assert lines[-1].startswith("lossparity: FAIL: 8 of 24 comparisons")


def test_quiet_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["--kinds", "reverse_kl", "--dtypes", "float32", "--normalizations", "sum", "--out", str(tmp_path), "--quiet",
                 *SMALL])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured
    assert captured.out.count("\n") == 1 and captured.out.startswith("lossparity: PASS: all 6 comparisons (2 cases x jax-xla, torch and twins)"), captured.out


def test_progress_on_a_terminal_is_one_line_rewritten(tmp_path: Path) -> None:
    """stderr a terminal: each case rewrites one line (\\r, no newline), cleared at the end."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    specs, _ = cli_module._builtin_cases(cli_module.build_parser().parse_args(
        ["--kinds", "entropy", "--dtypes", "float32", "--normalizations", "sum,tokens", "--shape", "3x40"]))
    terminal = Terminal()
    progress = cli_module.Progress(specs, verbose=False, quiet=False, stream=terminal)
    matrix_module.run_matrix(specs, ["torch"], on_result=progress)
    progress.finish()
    text = terminal.getvalue()
    assert "\n" not in text and text.count("\r") == 6  # four cases, then a clear and its return
    assert "lossparity: [4/4] entropy/neg_inf/tokens/float32/3x40" in text and text.endswith("\r")


@pytest.mark.parametrize("flags", [["--full"], ["--backends", "all"]])
def test_full_and_backends_all_name_every_backend(flags: list[str]) -> None:
    assert cli_module._backends(cli_module.build_parser().parse_args(flags)) == ["jax-xla", "jax-pallas", "torch", "torch-triton"]
    assert cli_module._backends(cli_module.build_parser().parse_args([])) == ["jax-xla", "torch"]


def test_full_matrix_every_backend(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--full``: the whole built-in matrix (6 kinds x 42 cases, every dtype and normalisation)
    on all four backends (the kernels interpreted on a CPU), each against the oracle and the
    three twin pairs, at a small shape."""
    code = main(["--full", "--shape", "2x4x40", "--no-plot", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.out[-3000:] + captured.err[-3000:]
    report = json.loads((tmp_path / "parity_report.json").read_text())
    names = {r["backend"] + "~" + r["reference"] for r in report["results"]}
    assert names == {"jax-xla~oracle", "jax-pallas~oracle", "torch~oracle", "torch-triton~oracle",
                     "jax-xla~torch", "jax-pallas~torch-triton", "jax-xla~torch-triton"}
    assert len({r["case"] for r in report["results"]}) == 6 * 42
    assert len(report["results"]) == 6 * 42 * 7
    assert all(r["status"] == "pass" for r in report["results"])
