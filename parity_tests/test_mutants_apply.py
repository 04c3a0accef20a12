"""Every mutant of scripts/mutants.py still applies: its function exists in its file and holds its
old line(s) exactly once, and the mutated file still parses. Moving or renaming code must move
the mutant with it; otherwise this test fails, instead of the mutant silently checking nothing."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants_module():
    spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants_module()


@pytest.mark.parametrize("mutant", MUTANTS.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_once_and_parses(mutant) -> None:
    source, where = MUTANTS.locate(mutant)
    assert not isinstance(where, str), f"mutant {mutant.name} no longer applies: {where}"
    mutated = MUTANTS.apply(mutant, source, where)
    assert mutated != source
    ast.parse(mutated)  # the re-indented replacement is valid Python


def test_names_are_unique_and_places_are_anchored() -> None:
    names = [m.name for m in MUTANTS.MUTANTS]
    assert len(names) == len(set(names))
    assert all("::" in m.where for m in MUTANTS.MUTANTS), "each mutant names path::function"


def test_a_moved_line_is_reported() -> None:
    """The check itself: a mutant whose line is not in its function does not apply."""
    mutant = MUTANTS.MUTANTS[0]
    moved = MUTANTS.Mutant(mutant.name, mutant.what, mutant.path + "::count_denominator", mutant.old, mutant.new, mutant.tests)
    _, where = MUTANTS.locate(moved)
    assert isinstance(where, str)
