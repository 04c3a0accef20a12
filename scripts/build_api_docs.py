"""Write the API reference, docs/api/<package>.md, from the public names, signatures and docstrings.

    python scripts/build_api_docs.py            # (re)write docs/api/*.md
    python scripts/build_api_docs.py --check    # exit 1, naming the stale pages, if they differ

One page per package (:data:`PAGES`); each page documents the modules listed for it, in order.
A module that does not exist (e.g. an optional module that has not landed yet; a submodule is
looked for only inside its imported parent package) is skipped without error; a module that exists
but fails to import is an error, so that a broken module never silently drops out of the reference.

Public names: the module's ``__all__`` in its order; without ``__all__``, the names without a
leading underscore that the module defines (a package: that any of its submodules defines), in
order of defining module and name. For each: the signature (``inspect.signature``; constructors:
``__init__`` without ``self``), the object's own docstring (cleaned, never inherited; Sphinx roles
turned into Markdown code), and for classes the public methods the project defines (``__call__`` and
``forward`` included).

The output is deterministic: no addresses, dates or installed versions; constants are shown with
their ``repr`` only when it is short and address-free, else by type and size. The test
``parity_tests/test_api_docs.py`` regenerates the pages in memory and compares them with the
committed ones.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API_DIR = ROOT / "docs" / "api"
REGENERATE = "python scripts/build_api_docs.py"

# One page per package: (page file name, title, modules in the order they appear). Add a module
# here to document it; modules that do not exist when the script runs are skipped.
PAGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("lossspec.md", "lossspec", ("lossspec",)),
    ("jaxloss.md", "jaxloss", ("jaxloss", "jaxloss.nnx", "jaxloss.distributed")),
    ("torchloss.md", "torchloss", ("torchloss", "torchloss.nn", "torchloss.distributed", "torchloss.hf")),
)

# Methods that frameworks call on a user's behalf: documented although the base class has them.
CALLED_METHODS = ("__call__", "forward")
MAX_CONSTANT_REPR = 120
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|data|attr|obj|exc|const):`~?([^`]+)`")
_DOUBLE_BACKTICKS = re.compile(r"``(.+?)``")
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Attributes|Example|Examples|Note|Notes):\s*$")
_ENTRY_SECTIONS = ("Args", "Arguments", "Parameters", "Raises", "Attributes")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)( \([^)]*\))?:\s*(.*)$")


def existing_modules(names: tuple[str, ...]) -> list[types.ModuleType]:
    """The modules of ``names`` that exist, imported; missing ones are left out."""
    present = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if not parent:
            if importlib.util.find_spec(name) is not None:
                present.append(importlib.import_module(name))
            continue
        if importlib.util.find_spec(parent) is None:
            continue
        # Look only inside the imported parent package: an editable install's finder would
        # otherwise supply a submodule from another checkout of the project.
        search_path = getattr(importlib.import_module(parent), "__path__", None)
        if search_path is None or importlib.machinery.PathFinder.find_spec(name, list(search_path)) is None:
            continue
        present.append(importlib.import_module(name))
    return present


def _defined_in(obj: Any, module: types.ModuleType) -> bool:
    """Whether ``obj`` belongs to ``module`` (a package: to the package or one of its submodules).
    Values without ``__module__`` (numbers, strings, tuples, dicts) count as the module's own."""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return not callable(obj)
    if hasattr(module, "__path__"):
        return owner == module.__name__ or owner.startswith(module.__name__ + ".")
    return owner == module.__name__


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__`` in its order, else the public names ``module`` defines (see the module doc)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    names = [
        name for name, obj in vars(module).items()
        if not name.startswith("_") and not isinstance(obj, types.ModuleType) and _defined_in(obj, module)
    ]
    return sorted(names, key=lambda name: (str(getattr(vars(module)[name], "__module__", "")), name))


def markdown_docstring(doc: str | None) -> str:
    """A docstring as Markdown: Sphinx roles and ``literals`` become `code`; a paragraph ending
    in ``::`` introduces an indented block, which becomes a fenced text block."""
    if not doc:
        return "*(no docstring)*"
    doc = _ROLE.sub(r"`\1`", doc)
    doc = _DOUBLE_BACKTICKS.sub(r"`\1`", doc)
    out: list[str] = []
    lines = google_sections(doc.splitlines())
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1])  # "Example::" -> "Example:"
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_end = j
            while block_end < len(lines) and (not lines[block_end].strip() or lines[block_end].startswith((" ", "\t"))):
                block_end += 1
            block = lines[j:block_end]
            while block and not block[-1].strip():
                block.pop()
            if block:
                out += ["", "```text", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
                i = block_end
                continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def google_sections(lines: list[str]) -> list[str]:
    """Google-style ``Args:``/``Returns:``/``Raises:`` sections as Markdown: a bold heading, and
    each ``name: text`` entry (continuation lines indented deeper) as one bullet; other indented
    text of a section as a paragraph."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        heading = _SECTION.match(lines[i])
        if not heading:
            out.append(lines[i])
            i += 1
            continue
        out += [f"**{heading.group(1)}:**", ""]
        i += 1
        body: list[str] = []
        while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
            if not lines[i].strip() and (i + 1 == len(lines) or not lines[i + 1].startswith((" ", "\t"))):
                break
            body.append(lines[i])
            i += 1
        body = textwrap.dedent("\n".join(body)).splitlines()
        entries = [line for line in body if line and not line[0].isspace()]
        if heading.group(1) in _ENTRY_SECTIONS and entries and all(_ENTRY.match(line) for line in entries):
            for line in body:
                entry = _ENTRY.match(line) if line and not line[0].isspace() else None
                if entry:
                    out.append(f"- `{entry.group(1)}`{entry.group(2) or ''}: {entry.group(3)}")
                elif line.strip():
                    out[-1] += " " + line.strip()
        else:
            out += [line.strip() for line in body]
    return out


def _annotation(annotation: Any) -> str:
    # Modules written with `from __future__ import annotations` store annotations as strings.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def format_signature(signature: inspect.Signature, drop_first: bool = False) -> str:
    """``(a: int, *, b='x') -> float`` with annotations unquoted; ``drop_first`` drops ``self``."""
    parameters = list(signature.parameters.values())[1 if drop_first else 0:]
    parts: list[str] = []
    keyword_only_marked = False
    for index, parameter in enumerate(parameters):
        kind = parameter.kind
        if kind == parameter.KEYWORD_ONLY and not keyword_only_marked:
            parts.append("*")
            keyword_only_marked = True
        if kind == parameter.VAR_POSITIONAL:
            keyword_only_marked = True
        prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(kind, "")
        text = prefix + parameter.name
        if parameter.annotation is not parameter.empty:
            text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not parameter.empty:
            text += (" = " if parameter.annotation is not parameter.empty else "=") + repr(parameter.default)
        parts.append(text)
        following = parameters[index + 1].kind if index + 1 < len(parameters) else None
        if kind == parameter.POSITIONAL_ONLY and following != parameter.POSITIONAL_ONLY:
            parts.append("/")
    result = f"({', '.join(parts)})"
    if signature.return_annotation is not signature.empty:
        result += f" -> {_annotation(signature.return_annotation)}"
    return result


def _signature_or_none(obj: Any, drop_first: bool = False, constructor: bool = False) -> str | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    if constructor:  # `-> None` says nothing about a class
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    return format_signature(signature, drop_first)


def own_doc(obj: Any) -> str | None:
    """``obj``'s own docstring, cleaned; never one inherited from a framework's base class
    (whose text would change with the installed version)."""
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    return inspect.cleandoc(doc) if doc else None


def project_init(cls: type, root: str) -> Any:
    """The ``__init__`` that the nearest project class in ``cls``'s MRO defines (a dataclass's
    generated one included), or ``None`` when only framework bases define it."""
    for base in cls.__mro__:
        if base.__module__.startswith(root) and "__init__" in vars(base):
            return vars(base)["__init__"]
    return None


def _project_root(module: types.ModuleType) -> str:
    return module.__name__.split(".")[0]


def class_methods(cls: type, root: str) -> list[tuple[str, Any]]:
    """The public methods the project's classes in ``cls``'s MRO define (nearest first), plus
    :data:`CALLED_METHODS`; overrides of a framework base's method (``extra_repr``) are left out."""
    foreign = set()
    for base in cls.__mro__:
        if not base.__module__.startswith(root):
            foreign |= set(vars(base))
    found: dict[str, Any] = {}
    for base in cls.__mro__:
        if not base.__module__.startswith(root) or base is cls.__mro__[-1]:
            continue
        for name, member in vars(base).items():
            if name in found or name == "__init__":
                continue
            public = not name.startswith("_") and name not in foreign
            if public or name in CALLED_METHODS:
                function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if inspect.isfunction(function):
                    found[name] = member
    return sorted(found.items())


def render_constant(qualified: str, value: Any) -> str:
    # Sets print in hash order, which changes with PYTHONHASHSEED: print them sorted.
    text = f"{type(value).__name__}({sorted(value, key=repr)!r})" if isinstance(value, (set, frozenset)) else repr(value)
    if len(text) > MAX_CONSTANT_REPR or _ADDRESS.search(text):
        size = f", {len(value)} entries" if hasattr(value, "__len__") else ""
        text = f"<{type(value).__name__}{size}>"
    return f"### `{qualified}`\n\n```python\n{qualified} = {text}\n```"


def render_callable(qualified: str, obj: Any, root: str) -> str:
    parts = [f"### `{qualified}`"]
    if inspect.isclass(obj):
        init = project_init(obj, root)
        signature = _signature_or_none(init, drop_first=True, constructor=True) if init else ""
        parts.append(f"```python\nclass {qualified}{signature or ''}\n```")
        parts.append(markdown_docstring(own_doc(obj)))
        for name, member in class_methods(obj, root):
            function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            drop = not isinstance(member, staticmethod)
            signature = _signature_or_none(function, drop_first=drop) or "(...)"
            parts.append(f"#### `{qualified}.{name}`\n\n```python\n{name}{signature}\n```")
            parts.append(markdown_docstring(own_doc(function)))
    else:
        parts.append(f"```python\n{qualified}{_signature_or_none(obj) or '(...)'}\n```")
        parts.append(markdown_docstring(own_doc(obj)))
    return "\n\n".join(parts)


def render_module(module: types.ModuleType, documented: set[str]) -> str:
    """One module's section: its docstring, then every public name."""
    parts = [f"## Module `{module.__name__}`", markdown_docstring(own_doc(module))]
    root = _project_root(module)
    names = public_names(module)
    if not hasattr(module, "__all__"):
        parts.append("*(No `__all__`: the public names this module defines.)*")
    for name in names:
        obj = getattr(module, name)
        qualified = f"{module.__name__}.{name}"
        if isinstance(obj, types.ModuleType):
            where = "below" if obj.__name__ in documented else "in its own section"
            parts.append(f"### `{qualified}`\n\nSubmodule `{obj.__name__}`, documented {where}.")
        elif inspect.isclass(obj) or callable(obj):
            parts.append(render_callable(qualified, obj, root))
        else:
            parts.append(render_constant(qualified, obj))
    return "\n\n".join(parts)


def render_page(title: str, modules: list[types.ModuleType]) -> str:
    documented = {module.__name__ for module in modules}
    header = (
        f"# `{title}` API reference\n\n"
        f"Generated from the docstrings by `scripts/build_api_docs.py`; do not edit by hand: run\n"
        f"`{REGENERATE}` after changing a public name, signature or docstring\n"
        f"(`parity_tests/test_api_docs.py` fails until the pages match).\n\n"
        f"Modules: " + ", ".join(f"[`{m.__name__}`](#module-{m.__name__.replace('.', '')})" for m in modules) + "."
    )
    text = "\n\n".join([header, *(render_module(module, documented) for module in modules)]) + "\n"
    if _ADDRESS.search(text):  # an address would change on every run: fix the renderer instead
        raise RuntimeError(f"docs/api/{title}.md would contain a memory address: {_ADDRESS.search(text).group(0)}")
    return text


def render_pages() -> dict[str, str]:
    """Every page of docs/api/ by file name, as it should be committed."""
    pages = {file: render_page(title, existing_modules(modules)) for file, title, modules in PAGES}
    index = ["# API reference", "",
             "Generated from the public names, signatures and docstrings by `scripts/build_api_docs.py`.", ""]
    for file, title, modules in PAGES:
        present = [m.__name__ for m in existing_modules(modules)]
        index.append(f"- [`{title}`]({file}): " + ", ".join(f"`{name}`" for name in present))
    pages["README.md"] = "\n".join(index) + "\n"
    return pages


def stale_pages(pages: dict[str, str], api_dir: Path = API_DIR) -> list[str]:
    """File names whose committed text differs from ``pages`` (missing ones included), and
    committed pages that are no longer generated."""
    differ = [name for name, text in pages.items()
              if not (api_dir / name).exists() or (api_dir / name).read_text() != text]
    extra = [path.name for path in sorted(api_dir.glob("*.md")) if path.name not in pages]
    return sorted(differ + extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with docs/api/, exit 1 if stale")
    args = parser.parse_args(argv)
    pages = render_pages()
    if args.check:
        stale = stale_pages(pages)
        if stale:
            print(f"stale API pages: {', '.join(stale)}; run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    API_DIR.mkdir(parents=True, exist_ok=True)
    for path in API_DIR.glob("*.md"):
        if path.name not in pages:
            path.unlink()
    for name, text in pages.items():
        (API_DIR / name).write_text(text)
        print(f"docs/api/{name}: {len(text.splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # document this checkout's packages, not an installed copy
    raise SystemExit(main())
