"""docs/api/*.md is what scripts/build_api_docs.py generates from this checkout's docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_api_docs", ROOT / "scripts" / "build_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return builder.render_pages()


def test_committed_api_pages_are_up_to_date(pages: dict[str, str]) -> None:
    stale = builder.stale_pages(pages)
    assert not stale, (
        f"docs/api/ is stale ({', '.join(stale)}): a public name, signature or docstring changed. "
        f"Run `{builder.REGENERATE}` and commit docs/api/."
    )


def test_every_public_name_has_a_section(pages: dict[str, str]) -> None:
    for file, _, module_names in builder.PAGES:
        for module in builder.existing_modules(module_names):
            for name in builder.public_names(module):
                assert f"### `{module.__name__}.{name}`" in pages[file], f"{module.__name__}.{name} missing from {file}"


def _changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(name for name in before if before[name] != after.get(name))


def test_a_changed_docstring_changes_its_page(monkeypatch: pytest.MonkeyPatch, pages: dict[str, str]) -> None:
    import jaxloss.distributed

    monkeypatch.setattr(jaxloss.distributed.split_microbatches, "__doc__", "Reshape every leaf, differently.")
    assert _changed(pages, builder.render_pages()) == ["jaxloss.md"]


def test_a_changed_signature_changes_its_page(monkeypatch: pytest.MonkeyPatch, pages: dict[str, str]) -> None:
    import inspect

    import torchloss

    signature = inspect.signature(torchloss.cross_entropy)
    changed = signature.replace(parameters=[p.replace(default=-1) if p.name == "ignore_index" else p
                                            for p in signature.parameters.values()])
    # A written-out function has no __signature__ of its own: inspect.signature reads one when set.
    monkeypatch.setattr(torchloss.cross_entropy, "__signature__", changed, raising=False)
    assert _changed(pages, builder.render_pages()) == ["torchloss.md"]


def test_missing_modules_are_skipped() -> None:
    found = builder.existing_modules(("lossspec", "lossspec.no_such_module", "no_such_package.sub"))
    assert [module.__name__ for module in found] == ["lossspec"]


def test_a_missing_page_and_a_leftover_page_are_reported(tmp_path: Path, pages: dict[str, str]) -> None:
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    assert builder.stale_pages(pages, tmp_path) == []
    (tmp_path / "lossspec.md").unlink()
    (tmp_path / "old_module.md").write_text("# gone\n")
    assert builder.stale_pages(pages, tmp_path) == ["lossspec.md", "old_module.md"]


def test_docstring_markdown() -> None:
    doc = "Sum :func:`count` of ``x``.\n\nArgs:\n  x: the input,\n    continued.\n  y: other.\n\nDo::\n\n    a = 1\n\nEnd."
    assert builder.markdown_docstring(doc) == (
        "Sum `count` of `x`.\n\n**Args:**\n\n- `x`: the input, continued.\n- `y`: other.\n\n"
        "Do:\n\n```text\na = 1\n```\n\nEnd."
    )
