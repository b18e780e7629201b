"""The import graph keeps one direction: cli -> run modules -> models -> layers -> ops. Checked from the
source (every import statement, function-level ones included; annotation-only imports under
`if TYPE_CHECKING:` are not imports at run time)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "k3cli"
# what each level may import from k3cli (besides itself)
ALLOWED = {"ops": ("ops",), "layers": ("layers", "ops"), "models": ("models", "layers", "ops")}


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


# modules that use training (commands and their helpers): k3cli/train may import none of them
ABOVE_TRAIN = ("cli", "bench_train", "evaluate", "study", "compare", "report", "export", "generate", "plot")


def test_train_package_imports_nothing_above_it_and_is_used_by_its_public_names():
    inside = sorted((PACKAGE / "train").rglob("*.py"))
    assert inside
    up = [f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}" for f in inside for line, mod in k3_imports(f)
          if mod.startswith(".") or mod.split(".")[1:2] and mod.split(".")[1] in ABOVE_TRAIN]
    assert not up, "\n".join(up)
    outside = [f for f in PACKAGE.rglob("*.py") if PACKAGE / "train" not in f.parents]
    private = [f"{f.relative_to(PACKAGE.parent)}:{line} imports {mod}" for f in outside for line, mod in k3_imports(f)
               if mod.startswith("k3cli.train.")]
    assert not private, "\n".join(private)
