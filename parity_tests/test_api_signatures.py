"""The public losses, fused heads and module classes are written out in both frameworks (plain
``def`` / ``class`` statements, so that IDEs and type checkers see their signatures), with the
signatures the kind table implies (``lossspec.kinds.parameters``, ``lossspec.linear.head_parameters``),
the same in ``jaxloss`` and ``torchloss`` except the documented framework-only arguments (none
today: ``inplace`` is in both since issue 32). Annotations are not compared (they name each
framework's array type)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

import jaxloss
import jaxloss.nnx
import lossspec
import torchloss
import torchloss.nn
from lossspec import linear as spec_linear

P = inspect.Parameter
# The framework arguments after segment_ids, in order (docs/spec.md, section 3).
JAX_ARGS: tuple[tuple[str, Any], ...] = (("vocab_parallel", None), ("sequence_parallel", None), ("impl", "auto"), ("tuning", None),
                                         ("inplace", False))
TORCH_ARGS: tuple[tuple[str, Any], ...] = JAX_ARGS
TORCH_ONLY: tuple[str, ...] = ()  # torch-only arguments of the losses (inplace is in both: docs/spec.md section 7)
HEAD_ARGS: tuple[tuple[str, Any], ...] = (("vocab_parallel", None), ("tuning", None))  # both frameworks, after lossspec.linear.HEAD_ARGS
# Every function ends with **unexpected: any other keyword is a TypeError with lossspec's hint.
UNEXPECTED = P("unexpected", P.VAR_KEYWORD)
FRAMEWORKS = {"jaxloss": (jaxloss, jaxloss.nnx, JAX_ARGS), "torchloss": (torchloss, torchloss.nn, TORCH_ARGS)}
HEAD_KINDS = sorted(spec_linear.LINEAR_NAMES)


def _plain(parameters: Any) -> list[tuple[str, Any, Any]]:
    """``(name, kind, default)`` of each parameter: the signature without its annotations."""
    return [(p.name, p.kind, p.default) for p in parameters]


def _written_out(fn: Callable[..., Any], name: str, module: str) -> None:
    """``fn`` is a plain function defined under ``name`` in ``module`` (a ``def`` statement, not
    a function a factory made and renamed: its code object carries the name)."""
    assert inspect.isfunction(fn), f"{module}.{name} is not a plain function: {fn!r}"
    assert fn.__code__.co_name == name, f"{module}.{name} is made by {fn.__code__.co_name}(), not written out"
    assert (fn.__name__, fn.__qualname__, fn.__module__) == (name, name, module)


def _documented(fn: Callable[..., Any], formulas: tuple[str, ...]) -> None:
    """The docstring states the formulas and has an ``Args`` entry for every parameter."""
    doc = inspect.getdoc(fn) or ""
    flat = " ".join(doc.split())
    for formula in formulas:
        assert " ".join(formula.split()) in flat, f"{fn.__module__}.{fn.__name__}'s docstring lacks {formula!r}"
    args = doc.split("Args:", 1)[-1]
    for parameter in inspect.signature(fn).parameters.values():
        entry = ("**" if parameter.kind == P.VAR_KEYWORD else "") + parameter.name + ":"
        assert f"\n  {entry}" in args, f"{fn.__module__}.{fn.__name__}'s docstring does not document {entry}"


@pytest.mark.parametrize("kind", list(lossspec.KIND_SPECS))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_losses_are_written_out_with_the_tables_signature(framework: str, kind: str) -> None:
    package, _, extra = FRAMEWORKS[framework]
    spec = lossspec.KIND_SPECS[kind]
    fn = getattr(package, kind)
    _written_out(fn, kind, f"{framework}.api")
    expected = _plain(lossspec.kinds.parameters(spec, extra)) + _plain([UNEXPECTED])
    assert _plain(inspect.signature(fn).parameters.values()) == expected
    _documented(fn, (spec.loss, spec.grad))


@pytest.mark.parametrize("kind", HEAD_KINDS)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_heads_are_written_out_with_the_tables_signature(framework: str, kind: str) -> None:
    package = FRAMEWORKS[framework][0]
    spec = lossspec.KIND_SPECS[kind]
    name = spec_linear.LINEAR_NAMES[kind]
    fn = getattr(package, name)
    _written_out(fn, name, f"{framework}.head")
    expected = _plain(spec_linear.head_parameters(spec, HEAD_ARGS)) + _plain([UNEXPECTED])
    assert _plain(inspect.signature(fn).parameters.values()) == expected
    _documented(fn, (spec.loss, spec.grad))


def _module_classes(framework: str) -> list[tuple[type, str, list[inspect.Parameter]]]:
    """``(class, its function's name, the options its constructor takes)`` of every module class:
    a loss's module takes the function's keyword arguments but ``denominator`` and ``segment_ids``
    (given per call); a head's module takes them and ``recompute_logits``, ``precision``, ``vocab_parallel``, ``tuning``."""
    _, modules, extra = FRAMEWORKS[framework]
    out = []
    for kind, spec in lossspec.KIND_SPECS.items():
        options = [p for p in lossspec.kinds.parameters(spec, extra) if p.kind == P.KEYWORD_ONLY and p.name not in ("denominator", "segment_ids")]
        out.append((getattr(modules, spec.module), kind, options))
    for kind in HEAD_KINDS:
        spec = lossspec.KIND_SPECS[kind]
        head = [p for p in spec_linear.head_parameters(spec, HEAD_ARGS) if p.kind == P.KEYWORD_ONLY]
        order = [*spec.option_names, "normalization", "impl", "recompute_logits", "precision", "vocab_parallel", "tuning"]
        by_name = {p.name: p for p in head}
        out.append((getattr(modules, spec_linear.head_module_name(kind)), spec_linear.LINEAR_NAMES[kind], [by_name[n] for n in order]))
    return out


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_module_classes_are_written_out_with_the_tables_options(framework: str) -> None:
    """Each module class is a ``class`` statement of its own name with its own ``__init__``
    (defined in ``modules.py``, named by its public module), whose keyword-only options are the
    function's, with the same defaults."""
    classes = _module_classes(framework)
    assert len(classes) == len(lossspec.KIND_SPECS) + len(HEAD_KINDS)
    for cls, function, options in classes:
        assert "__init__" in vars(cls), f"{cls.__name__} inherits its constructor"
        init = vars(cls)["__init__"]
        # Compiled inside a class statement of that name (a type() call makes no such code).
        assert init.__code__.co_name == "__init__" and init.__qualname__ == f"{cls.__name__}.__init__"
        expected = _plain([P("self", P.POSITIONAL_OR_KEYWORD), *options, UNEXPECTED])
        assert _plain(inspect.signature(init).parameters.values()) == expected, cls.__name__
        assert f":func:`{framework}.{function}`" in (cls.__doc__ or ""), f"{cls.__name__}'s docstring names no function"


def test_frameworks_differ_only_in_their_documented_arguments() -> None:
    """The same names, order, kinds and defaults in jaxloss and torchloss, less the torch-only arguments (none)."""
    names = [*lossspec.KIND_SPECS, *(spec_linear.LINEAR_NAMES[kind] for kind in HEAD_KINDS)]
    for name in names:
        jax_params = _plain(inspect.signature(getattr(jaxloss, name)).parameters.values())
        torch_params = [p for p in _plain(inspect.signature(getattr(torchloss, name)).parameters.values()) if p[0] not in TORCH_ONLY]
        assert jax_params == torch_params, name
    for (jax_cls, _, _), (torch_cls, _, _) in zip(_module_classes("jaxloss"), _module_classes("torchloss")):
        assert jax_cls.__name__ == torch_cls.__name__
        jax_init = _plain(inspect.signature(jax_cls.__init__).parameters.values())
        torch_init = [p for p in _plain(inspect.signature(torch_cls.__init__).parameters.values()) if p[0] not in TORCH_ONLY]
        assert jax_init == torch_init, jax_cls.__name__
