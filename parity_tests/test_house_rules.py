"""The house rules of docs/DESIGN.md that the code itself can be checked for (a scan of the
sources, no import of the frameworks):

- kinds are chosen by the kind table's traits (``lossspec.KIND_SPECS``): a kind's name is compared
  only in the table's home (lossspec/kinds.py, lossspec/config.py), the statistics and oracle math
  (lossspec/stats.py, lossspec/oracle.py), the block math (jaxloss/_block.py, torchloss/_block.py),
  the kernels, and the benchmark worker's peer formulas;
- no module of the library reads another module's private names (``from .api import _prepare``,
  ``_xla._load``): what one module offers another has a public name (private *modules*, such as
  ``jaxloss.backends.xla``, are the packages' internals and may be imported);
- ``impl=`` is resolved in one place per framework, the backend registries
  (jaxloss/backends/__init__.py, torchloss/backends/__init__.py): no other module of the frameworks
  compares a string with an impl name;
- tests never import another test module and never edit ``sys.path``: shared helpers live in
  ``parity_tests.support``;
- the ranks of a ``torch.distributed`` suite are launched once per run
  (``ranks.launch_once`` / ``launch_dir_once``), never by a direct ``ranks.launch`` in a test
  module, whose module fixture would run them again in every xdist worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lossspec

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("lossspec", "jaxloss", "torchloss", "lossparity", "benchmarks")
NAMES_KINDS = {
    "lossspec/kinds.py", "lossspec/config.py",  # the kind table
    "lossspec/stats.py", "lossspec/oracle.py",  # the statistics / oracle math
    "jaxloss/_block.py", "torchloss/_block.py",  # the block math
    "jaxloss/backends/pallas.py",  # kernels
    "torchloss/backends/triton.py", "torchloss/backends/triton_kernels.py",
    "benchmarks/_worker.py",  # the peers' own per-kind expressions
}


def _sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _kind_names(node: ast.AST) -> list[str]:
    """Kind names among a comparison operand's string constants (a tuple or set of them too)."""
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [v.value for v in values if isinstance(v, ast.Constant) and v.value in lossspec.ALL_KINDS]


def kind_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            names = [name for operand in [node.left, *node.comparators] for name in _kind_names(operand)]
            if names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {', '.join(names)}")
    return found


def test_kinds_are_named_only_by_the_table_the_math_and_the_kernels() -> None:
    offending = [hit for path in _sources(LIBRARY) if str(path.relative_to(ROOT)) not in NAMES_KINDS
                 for hit in kind_comparisons(path)]
    assert offending == [], "compare a trait of lossspec.KIND_SPECS instead:\n" + "\n".join(offending)


def test_the_scan_finds_a_kind_comparison(tmp_path: Path, monkeypatch) -> None:
    """The check itself: the forms the code used before the table (== and in a tuple) are found."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text('if cfg.kind == "jensen_shannon":\n    pass\nce = kind in ("cross_entropy", "entropy")\n')
    assert kind_comparisons(probe) == ["probe.py:1 jensen_shannon", "probe.py:3 cross_entropy, entropy"]


IMPL_NAMES = set(lossspec.JAX_IMPLS) | set(lossspec.TORCH_IMPLS)
REGISTRIES = {"jaxloss/backends/__init__.py", "torchloss/backends/__init__.py"}


def _impl_names(node: ast.AST) -> list[str]:
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [v.value for v in values if isinstance(v, ast.Constant) and v.value in IMPL_NAMES]


def _names_an_impl(node: ast.AST) -> bool:
    """An operand that holds an impl: a name or attribute called ``*impl*`` or ``*backend*``
    (``"triton" in sys.modules`` is about the package, not an impl)."""
    ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "impl" in ident or "backend" in ident


def impl_comparisons(path: Path) -> list[str]:
    """Comparisons of an impl (``impl``, ``spec.impl``, ``backend``) with impl names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(_names_an_impl(o) for o in [node.left, *node.comparators]):
            names = [name for operand in [node.left, *node.comparators] for name in _impl_names(operand)]
            if names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {', '.join(names)}")
    return found


def test_impl_is_compared_only_in_the_backend_registries() -> None:
    offending = [hit for path in _sources(("jaxloss", "torchloss")) if str(path.relative_to(ROOT)) not in REGISTRIES
                 for hit in impl_comparisons(path)]
    assert offending == [], "resolve impl= with backends.resolve and read the Backend instead:\n" + "\n".join(offending)


def test_the_scan_finds_an_impl_comparison(tmp_path: Path, monkeypatch) -> None:
    """The check itself, on the forms the code used before the registries."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text('if spec.impl == "pallas":\n    pass\nkernel = None if impl in ("auto", "torch") else 1\nok = "triton" in sys.modules\n')
    assert impl_comparisons(probe) == ["probe.py:1 pallas", "probe.py:3 auto, torch"]


def test_tests_import_no_test_module_and_leave_sys_path_alone() -> None:
    tests = ROOT / "parity_tests"
    modules = {p.stem for p in tests.glob("test_*.py")} | {p.stem for p in tests.glob("_*.py")} | {"conftest"}
    offending = []
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            offending += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                          if name.split(".")[0] in modules or name.startswith("parity_tests.test_")]
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend", "remove") \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "path" \
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys":
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} edits sys.path")
    assert offending == [], "\n".join(offending)


def rank_launches(path: Path) -> list[str]:
    """Direct calls of ``ranks.launch`` in ``path`` (``launch_once`` / ``launch_dir_once`` are the
    shared ones), except in the body of a test function itself (which runs once, in one worker:
    the test of ``launch``)."""
    tree = ast.parse(path.read_text())
    in_tests = {id(node) for test in ast.walk(tree) if isinstance(test, ast.FunctionDef) and test.name.startswith("test_")
                for node in ast.walk(test)}
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "ranks" and id(node) not in in_tests]


def test_gloo_ranks_are_launched_once_per_run() -> None:
    """A module-scoped fixture runs once in every xdist worker that gets one of the module's tests:
    a direct ``ranks.launch`` there ran test_torchloss_vocab_parallel.py's 3 ranks twice under
    ``-n 2`` (18 s each, beside the other worker's tests). ``ranks.launch_once`` and
    ``launch_dir_once`` launch them for the first asker and make the others wait."""
    offending = [hit for path in sorted((ROOT / "parity_tests").glob("test_*.py")) for hit in rank_launches(path)]
    assert offending == [], "launch the ranks with ranks.launch_once / launch_dir_once:\n" + "\n".join(offending)


def test_the_scan_finds_a_direct_rank_launch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text("ranks.launch(script, [], world_size=3, log_dir=out)\nranks.launch_once('x', script, args, 3, factory)\n"
                     "@pytest.fixture(scope='module')\ndef fixture_launch():\n    ranks.launch(script, [], 2, out)\n"
                     "def test_launch():\n    ranks.launch(script, [], 2, out)\n")
    assert rank_launches(probe) == ["probe.py:1", "probe.py:5"]


NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def private_uses(path: Path, packages: tuple[str, ...] = ("lossspec", "jaxloss", "torchloss", "lossparity")) -> list[str]:
    """``from <our module> import _name`` and ``<our module alias>._name`` in ``path``, where
    ``_name`` is not itself a module of the package."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if not (node.level > 0 or module.split(".")[0] in packages):
                continue
            base = path.parents[node.level - 1] if node.level > 0 else ROOT  # "from .." is the parent package
            folder = base / module.replace(".", "/") if module else base
            for alias in node.names:
                is_module = (folder / f"{alias.name}.py").exists()
                if alias.name.startswith("_") and not alias.name.startswith("__") and not is_module:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
                ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            ours |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in packages}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours \
                and node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API:
            if not (path.parent / f"{node.attr}.py").exists():
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    offending = [hit for path in _sources(("lossspec", "jaxloss", "torchloss", "lossparity")) for hit in private_uses(path)]
    assert offending == [], "give the name a public name in its module:\n" + "\n".join(offending)


def test_the_scan_finds_a_private_import(tmp_path: Path, monkeypatch) -> None:
    """The check itself, on the two forms the head used (``api._prepare``, ``from .x import _y``)."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    package = tmp_path / "jaxloss"
    package.mkdir()
    (package / "_xla.py").write_text("")
    probe = package / "probe.py"
    probe.write_text("from . import _xla, api\nfrom .api import _finish\napi._prepare(1)\n_xla.fused(2)\n")
    assert private_uses(probe) == ["jaxloss/probe.py:2 imports _finish", "jaxloss/probe.py:3 reads api._prepare"]


def test_the_scan_resolves_modules_of_the_parent_package(tmp_path: Path, monkeypatch) -> None:
    """``from .. import _block`` in ``backends/`` imports a private module of the package (allowed);
    ``from ..api import _finish`` a private name (found)."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    backends = tmp_path / "jaxloss" / "backends"
    backends.mkdir(parents=True)
    (tmp_path / "jaxloss" / "_block.py").write_text("")
    probe = backends / "probe.py"
    probe.write_text("from .. import _block\nfrom .._block import F32\nfrom ..api import _finish\n_block.combine(1)\n")
    assert private_uses(probe) == ["jaxloss/backends/probe.py:3 imports _finish"]


# --------------------------------------------------------------------------------------------
# No module-global knobs: tests, benchmarks and scripts pass tuning= instead of setting them
# --------------------------------------------------------------------------------------------

OUR_PACKAGES = ("jaxloss", "torchloss", "lossspec")
KNOB_SCANNED = ("parity_tests", "benchmarks", "scripts")


def _upper(name: str) -> bool:
    return name[:1].isalpha() and name == name.upper() and name.replace("_", "").isalnum()


def knob_settings(path: Path) -> list[str]:
    """Where ``path`` sets an UPPER_CASE attribute of a jaxloss / torchloss / lossspec module:
    ``X.NAME = ...`` (also in a tuple target) or ``X.NAME[key] = ...``, or a call given
    ``(X, "NAME", ...)`` other than ``getattr`` / ``hasattr`` (``setattr``, ``monkeypatch.setattr``,
    a helper that sets it), or ``monkeypatch.setattr("jaxloss.x.NAME", ...)``, or
    ``monkeypatch.setitem(X.NAME, ...)`` (an entry of a module's table); ``X`` is a name bound to
    one of those modules by an import, an attribute of one (``torchloss.backends``), or a loop
    variable over such names."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OUR_PACKAGES:
            ours |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            ours |= {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.split(".")[0] in OUR_PACKAGES}
    for node in ast.walk(tree):  # for module in (jax_linear, torch_linear): ...
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)) \
                and node.iter.elts and all(isinstance(e, ast.Name) and e.id in ours for e in node.iter.elts):
            ours.add(node.target.id)

    def is_ours(value: ast.AST) -> bool:
        while isinstance(value, ast.Attribute):
            value = value.value
        return isinstance(value, ast.Name) and value.id in ours

    found = []
    where = lambda node, name: f"{path.relative_to(ROOT)}:{node.lineno} sets {name}"  # noqa: E731
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                targets += target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        for target in targets:
            if isinstance(target, ast.Subscript):  # X.NAME[key] = ...: an entry of a module's table
                target = target.value
            if isinstance(target, ast.Attribute) and _upper(target.attr) and is_ours(target.value):
                found.append(where(node, target.attr))
        if isinstance(node, ast.Call) and node.args:
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            first = node.args[0]
            if func in ("getattr", "hasattr"):
                continue
            if len(node.args) >= 2 and is_ours(first) and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _upper(node.args[1].value):
                found.append(where(node, node.args[1].value))
            elif func == "setitem" and isinstance(first, ast.Attribute) and _upper(first.attr) and is_ours(first.value):
                found.append(where(node, first.attr))
            elif isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.split(".")[0] in OUR_PACKAGES:
                name = first.value.rsplit(".", 1)[-1]
                if "." in first.value and _upper(name):
                    found.append(where(node, name))
    return sorted(found, key=lambda hit: int(hit.split(":")[1].split()[0]))


def test_no_test_benchmark_or_script_sets_a_module_knob() -> None:
    """Block and tile sizes, the fused head's memory plan and its bf16 matmuls are ``tuning=``
    (``lossspec.Tuning`` for the losses, ``lossspec.HeadTuning`` for the heads), never a module
    global set from outside (docs/DESIGN.md, "Plans are named"): no exceptions."""
    offending = [hit for path in _sources(KNOB_SCANNED) for hit in knob_settings(path)]
    assert offending == [], "pass tuning= (lossspec.Tuning / lossspec.HeadTuning) instead:\n" + "\n".join(offending)


def test_the_scan_finds_a_knob_set(tmp_path: Path, monkeypatch) -> None:
    """The check itself, on the forms the tests used (monkeypatch.setattr, a save-set-restore, a
    loop over the frameworks' modules, a tuple target, an entry of a module's table) and the ones
    it must let pass (a lowercase spy, a module of another package, a read, an entry of a local
    dict)."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torchloss\n"
        "from jaxloss import linear as jax_linear, _xla\n"
        "from torchloss import _cpu, linear as torch_linear\n"
        "from lossparity import inputs as inputs_module\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(_xla, 'TUNING', 1)\n"
        "    _cpu.TILE_ELEMENTS = 8\n"
        "    for module in (jax_linear, torch_linear):\n"
        "        monkeypatch.setattr(module, 'BLOCK_ELEMENTS', 2)\n"
        "    torch_linear.BLOCKED_ROWS, x = 3, 4\n"
        "    monkeypatch.setattr('torchloss._triton.MAX_BLOCK_V', 16)\n"
        "    monkeypatch.setattr(torchloss._prepare, 'host_readable', len)\n"
        "    monkeypatch.setattr(inputs_module, 'MAX_INPUT_BYTES', 1000)\n"
        "    print(getattr(_cpu, 'MAX_WORKERS'), _cpu.MAX_WORKERS)\n"
        "    monkeypatch.setitem(torch_linear.GPU_BLOCKS, 2, (1, 2))\n"
        "    _cpu.SIZES['x'] = 1\n"
        "    table = {}\n"
        "    table['X'] = 1\n"
        "    monkeypatch.setitem(table, 'Y', 2)\n"
    )
    assert knob_settings(probe) == [
        "probe.py:6 sets TUNING", "probe.py:7 sets TILE_ELEMENTS", "probe.py:9 sets BLOCK_ELEMENTS",
        "probe.py:10 sets BLOCKED_ROWS", "probe.py:11 sets MAX_BLOCK_V", "probe.py:15 sets GPU_BLOCKS",
        "probe.py:16 sets SIZES",
    ]
