"""Project rules that code review would otherwise have to catch (DESIGN sections 2 and 8)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
# What each layer may import besides the standard library and its own package.
ALLOWED = {
    "kernels": {"torch", "triton", "numpy"},
    "engine": {
        "torch",
        "triton",
        "numpy",
        "safetensors",
        "tokenizers",
        "jinja2",
        "tqdm",
        "orjson",
        "llguidance",  # imported lazily, by constrained requests only (engine/constrained.py)
    },
}
PACKAGE_OF = {"kernels": "freetoken_agent.kernels", "engine": "freetoken_agent.engine"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_dependencies_point_one_way(layer):
    """engine and kernels never import integrations, the agent layer, or their libraries;
    kernels import nothing from the engine. Imports are absolute."""
    own = PACKAGE_OF[layer]
    deps = ALLOWED[layer] | ({"freetoken_agent.kernels"} if layer == "engine" else set())
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            ok = (
                top in STDLIB
                or top in deps
                or name.startswith(own)
                or any(name.startswith(d + ".") or name == d for d in deps)
            )
            if not ok:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_nothing_imports_root_folders_bare():
    bad = []
    for folder in ("freetoken_agent", "engine", "kernels", "integrations", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in _imports(path):
                if name.split(".")[0] in ("engine", "kernels", "integrations", "bench"):
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "bare imports of root folders (use freetoken_agent.<folder>):\n" + "\n".join(
        bad
    )


def test_every_package_folder_is_installed():
    """A regular (non-editable) install takes only the packages pyproject names: a folder left
    out is missing from the wheel, and its importers fail there while editable installs, which
    map whole folders, hide it (engine/experts was left out until the forty-second session)."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found <= listed, f"package folders pyproject does not install: {sorted(found - listed)}"
    assert listed <= found, f"packages pyproject names without a folder: {sorted(listed - found)}"


def test_ruff_clean():
    """ruff is a test dependency: a missing ruff fails here rather than skipping."""
    lint = subprocess.run(["ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        ["ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
