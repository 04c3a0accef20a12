"""The `lossparity` command: built-in matrix, a perturbed backend caught, user files from JAX and
torch programs, and one-line errors for bad files and arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lossparity import backends as backends_module
from lossparity.backends import Backend
from lossparity.cli import main

SMALL = ["--shape", "3x40", "--no-plot"]


def test_builtin_matrix_passes_and_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["--kinds", "cross_entropy,reverse_kl", "--dtypes", "float32,bfloat16", "--backends", "jax-xla,torch",
                 "--shape", "2x5x70", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["passed"] is True
    names = {r["backend"] + "~" + r["reference"] for r in report["results"]}
    assert names == {"jax-xla~oracle", "torch~oracle", "jax-xla~torch"}
    assert all(r["loss_error"] <= 1 and r["grad_error"] <= 1 for r in report["results"])
    assert (tmp_path / "parity_report.png").stat().st_size > 10_000
    assert "PASS cross_entropy/random/valid_tokens/float32/2x5x70" in out


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
    assert "cross_entropy" not in captured.err  # the honest kind still passes
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
    backends = ["--backends", "jax-xla,torch"]
    assert main(["--inputs", str(jax_file), "--out", str(tmp_path), *backends, "--no-plot"]) == 0
    out = capsys.readouterr().out
    # labels and teacher logits in the file: all four kinds, all four normalisations, in bf16.
    assert "PASS cross_entropy/jax_batch.npz/valid_tokens/bfloat16/2x6x50" in out
    assert "PASS reverse_kl/jax_batch.npz/none/bfloat16/2x6x50" in out
    assert "16 cases" in out
    assert main(["--inputs", str(torch_file), "--out", str(tmp_path), *backends, "--no-plot", "--label-smoothing", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "PASS cross_entropy/torch_batch.npz/tokens/float32/4x5x70[" in out and "4 cases" in out
    assert main(["--inputs", str(st_file), "--out", str(tmp_path), *backends, "--no-plot", "--temperature", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS forward_kl/torch.safetensors/sum/bfloat16/4x5x70[temperature=2.0" in out and "12 cases" in out


def _write_bad_files(folder: Path) -> None:
    (folder / "junk.npz").write_bytes(b"not a zip")
    np.savez(folder / "no_logits.npz", labels=np.zeros(3, np.int64))
    np.savez(folder / "bad_shapes.npz", logits=np.zeros((3, 5), np.float32), labels=np.zeros(4, np.int64))
    np.savez(folder / "bad_label.npz", logits=np.zeros((3, 5), np.float32), labels=np.array([0, 7, 1]))


# (arguments, given the folder holding the files of _write_bad_files; a piece of the one-line error)
BAD_CASES = {
    "missing_file": (lambda d: ["--inputs", str(d / "missing.npz")], "no such file"),
    "not_npz": (lambda d: ["--inputs", str(d / "junk.npz")], "not a readable .npz file"),
    "no_logits": (lambda d: ["--inputs", str(d / "no_logits.npz")], "no 'logits' array (found: labels)"),
    "bad_shapes": (lambda d: ["--inputs", str(d / "bad_shapes.npz")], "labels must have the leading shape of logits [3]"),
    "bad_label": (lambda d: ["--inputs", str(d / "bad_label.npz")], "labels must lie in [0, 5)"),
    "unknown_kind": (lambda d: ["--kinds", "crossentropy"], "unknown kind crossentropy"),
    "bad_shape": (lambda d: ["--shape", "12"], "shape needs at least one leading dim"),
    "unknown_backend": (lambda d: ["--backends", "jax-xla,cuda"], "unknown backend cuda"),
    "unknown_option": (lambda d: ["--bogus"], "unrecognized arguments: --bogus"),
}


def _assert_one_line_error(code: object, out: str, err: str, expected: str) -> None:
    assert code == 2, (code, out, err)
    assert out == "", out  # nothing on stdout: the error alone, on stderr
    assert err.strip().count("\n") == 0, err  # one line, no traceback, no usage dump
    assert err.startswith("lossparity: error:") and expected in err, err


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_files_and_arguments_give_one_line_errors(case: str, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Every bad case through the command's own entry function, in this process (a fresh
    interpreter per case cost seconds of JAX and torch imports each); the console entry point
    itself is tested by test_console_entry_point_gives_one_line_error_and_status_2."""
    _write_bad_files(tmp_path)
    make_argv, expected = BAD_CASES[case]
    capfd.readouterr()  # only what this call writes; capfd also sees output at the file-descriptor level
    try:
        code = main([*make_argv(tmp_path), "--no-plot", "--out", str(tmp_path)])
    except SystemExit as exit_:  # as `python -m lossparity` would turn it into a status
        code = 0 if exit_.code is None else exit_.code
    captured = capfd.readouterr()
    _assert_one_line_error(code, captured.out, captured.err, expected)


def test_console_entry_point_gives_one_line_error_and_status_2(tmp_path: Path) -> None:
    """`python -m lossparity` in a fresh interpreter: a bad file passes the argument parsing and
    the JAX and torch imports, so stderr must hold the one error line and nothing those print."""
    _write_bad_files(tmp_path)
    make_argv, expected = BAD_CASES["bad_label"]
    result = subprocess.run([sys.executable, "-m", "lossparity", *make_argv(tmp_path), "--no-plot", "--out", str(tmp_path)],
                            capture_output=True, text=True)
    _assert_one_line_error(result.returncode, result.stdout, result.stderr, expected)


def test_help_documents_the_options() -> None:
    result = subprocess.run([sys.executable, "-m", "lossparity", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--inputs", "--kinds", "--backends", "--dtypes", "--shape", "--normalizations", "--out"):
        assert option in result.stdout
