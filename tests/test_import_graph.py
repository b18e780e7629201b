"""The import graph keeps one direction, for the whole package (ORDER below) and, more strictly, for
ops -> layers -> models. Checked from the
source (every import statement, function-level ones included; annotation-only imports under
`if TYPE_CHECKING:` are not imports at run time)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "k3cli"
# what each level may import from k3cli (besides itself)
BASE = ("errors", "files")
ALLOWED = {"ops": ("ops", *BASE), "layers": ("layers", "ops", *BASE), "models": ("models", "layers", "ops", *BASE)}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def k3_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every run-time import of a k3cli module in the file."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if a.name.startswith("k3cli"))
            elif isinstance(child, ast.ImportFrom) and child.level > 0:   # the package imports by absolute names
                found.append((child.lineno, "." * child.level + (child.module or "")))
            elif isinstance(child, ast.ImportFrom) and child.module == "k3cli":   # from k3cli import data
                found.extend((child.lineno, f"k3cli.{a.name}") for a in child.names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("k3cli"):
                found.append((child.lineno, child.module))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


@pytest.mark.parametrize("level", sorted(ALLOWED))
def test_lower_levels_import_nothing_above_them(level):
    files = sorted((PACKAGE / level).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}"
           for f in files for line, mod in k3_imports(f)
           if mod == "k3cli" or mod.startswith(".") or mod.split(".")[1] not in ALLOWED[level]]
    assert not bad, "\n".join(bad)


def test_the_check_sees_function_level_and_skips_annotation_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from k3cli.train import x\n"
                 "def g():\n    import k3cli.cli\n    from k3cli.ops import y\n    from ..models import z\n")
    assert k3_imports(f) == [(5, "k3cli.cli"), (6, "k3cli.ops"), (7, "..models")]


# The whole package, lowest first: a module may import its own unit and any unit of a lower level, never one
# of its own level or above. A unit is a subpackage (k3cli/data/) or a top-level module (k3cli/errors.py).
ORDER = [
    ("errors", "files"),
    ("ops",),
    ("testing", "layers"),
    ("models",),
    ("config",),
    ("data", "checkpoint", "distributed"),
    ("train",),
    ("evaluation", "study", "bench"),
    ("console",),
    ("cli",),
    ("__main__",),
]
LEVEL = {unit: i for i, units in enumerate(ORDER) for unit in units}


def unit_of(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_of_the_package_has_a_level():
    units = {unit_of(f) for f in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(LEVEL), f"place these in ORDER: {sorted(units - set(LEVEL))}"


def violations(package: Path) -> list[str]:
    """Every import in `package` that goes sideways or up ORDER, as 'file:line imports module'."""
    bad = []
    for f in sorted(package.rglob("*.py")):
        unit = unit_of(f, package)
        for line, mod in k3_imports(f):
            if mod.startswith("."):
                bad.append(f"{f.relative_to(package.parent)}:{line} imports {mod} (relative)")
                continue
            parts = mod.split(".")
            if unit == "__init__":   # k3cli/__init__.py: the public API, above everything but the CLI
                ok = len(parts) > 1 and LEVEL.get(parts[1], 99) < LEVEL["cli"]
            else:
                target = parts[1] if len(parts) > 1 else None
                ok = target == unit or (target in LEVEL and LEVEL[target] < LEVEL[unit])
            if not ok:
                bad.append(f"{f.relative_to(package.parent)}:{line} imports {mod}")
    return bad


def test_imports_go_one_way_down_the_whole_package():
    bad = violations(PACKAGE)
    assert not bad, "\n".join(bad)


def test_the_order_check_finds_a_cycle_and_an_upward_import(tmp_path):
    # data and checkpoint share a level: each importing the other is refused, as is data importing train
    root = tmp_path / "k3cli"
    for rel, text in {"data/a.py": "from k3cli.checkpoint import x\n", "checkpoint/b.py": "import k3cli.data\n",
                      "data/c.py": "def f():\n    from k3cli.train import y\n", "data/ok.py": "from k3cli.config import z\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert violations(root) == ["k3cli/checkpoint/b.py:1 imports k3cli.data", "k3cli/data/a.py:1 imports k3cli.checkpoint",
                     "k3cli/data/c.py:2 imports k3cli.train"]


def test_train_package_is_used_by_its_public_names():
    outside = [f for f in PACKAGE.rglob("*.py") if PACKAGE / "train" not in f.parents]
    private = [f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}" for f in outside for line, mod in k3_imports(f)
               if mod.startswith("k3cli.train.")]
    assert not private, "\n".join(private)
