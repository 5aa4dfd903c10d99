"""Who may import whom: models knows nothing of jaxkv, pallas_kernels and the C++ kernels'
Python sides are leaves (JAX, numpy and the standard library only, and models.native's builder)."""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level names of every module ``path`` imports, at module level or inside functions
    (relative imports: its own package's name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module if node.level == 0 else ".")
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def test_imported_packages_sees_every_import():
    source = ROOT / "tests" / "test_layering.py"
    assert {"ast", "pathlib", "sys", "pytest"} <= imported_packages(source)


@pytest.mark.parametrize("path", sorted((ROOT / "models").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_models_imports_nothing_from_jaxkv(path):
    assert not {name for name in imported_packages(path) if top(name) == "jaxkv"}


LEAF_ALLOWED = {"jax", "jaxlib", "numpy", "__future__", *sys.stdlib_module_names}


@pytest.mark.parametrize("path", sorted((ROOT / "pallas_kernels").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pallas_kernels_import_only_jax_numpy_and_the_standard_library(path):
    outside = {name for name in imported_packages(path) if top(name) not in LEAF_ALLOWED | {"pallas_kernels"}}
    assert not outside, outside


@pytest.mark.parametrize("path", [ROOT / "jaxkv" / "native" / "__init__.py",
                                  *sorted((ROOT / "models" / "native").glob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cpu_kernels_python_side_is_a_leaf(path):
    allowed = LEAF_ALLOWED | {"models.native", "models.native.build"}
    outside = {name for name in imported_packages(path) if name not in allowed and top(name) not in LEAF_ALLOWED}
    assert not outside, outside
