"""Import arrows between the packages, read from the source with ast (nothing is imported).

    moetune_cli            the command line, above everything
    dashboards             read the result store (and the tuner's cached probe)
    tuner, suites          the tuner drives the suites and writes profiles; the suites write rows
                           to the store (the kernel suite reads the tuner's probe)
    results                the store (uses the engine's cache folder and fingerprint)
    engine                 reads profiles (engine.profile), never the tuner
    kernels                the bottom: imports none of the above

Every import counts: at the top of a module, inside a function (lazy), under TYPE_CHECKING, and
importlib.import_module / __import__ with a literal name.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "engine", "results", "suites", "tuner", "dashboards", "moetune_cli")

# package → the packages it must not import, and why
FORBIDDEN = {
    "kernels": ({"engine", "tuner", "suites", "dashboards", "results", "moetune_cli"},
                "the kernels are the bottom layer"),
    "engine": ({"results", "tuner", "suites", "dashboards", "moetune_cli"},
               "the engine reads profiles from engine.profile; the command line sits above it"),
    "results": ({"tuner", "suites", "dashboards", "moetune_cli"},
                "the result store sits below everything that writes or reads it"),
    "suites": ({"dashboards", "moetune_cli"}, "the suites write rows; the dashboards read them"),
    "tuner": ({"dashboards", "moetune_cli"}, "the tuner writes rows and profiles; the dashboards read them"),
    "dashboards": ({"moetune_cli"}, "the command line sits above everything"),
}


def imports(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module's source, wherever it stands.
    Relative imports stay inside their own package and are left out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return found


def upward(package: str, rel_path: str, source: str) -> list[str]:
    """The forbidden imports of one module of `package`, as 'path:line imports X (...)' lines."""
    banned, why = FORBIDDEN.get(package, (set(), ""))
    return [f"{rel_path}:{line} imports {name} ({package} must not import {name.split('.')[0]}: {why})"
            for line, name in imports(source) if name.split(".")[0] in banned]


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_no_upward_import():
    bad = []
    for package in PACKAGES:
        files = modules(package)
        assert files, f"no module found in {package}/"
        for path in files:
            bad += upward(package, str(path.relative_to(ROOT)), path.read_text())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_scan_sees_the_real_arrows():
    """The scan reads what is there: known downward imports are found, with their lines."""
    llm = imports((ROOT / "engine" / "llm.py").read_text())
    assert any(name == "engine.profile" for _, name in llm)
    assert any(name == "kernels" for _, name in llm)
    cli = {name.split(".")[0] for _, name in imports((ROOT / "moetune_cli" / "__init__.py").read_text())}
    assert {"engine", "tuner", "suites", "results", "dashboards"} <= cli


@pytest.mark.parametrize("source, line", [
    ("import os\nfrom tuner.profile import Profile\n", 2),
    ("def f():\n    import suites.kernels\n", 2),  # lazy, inside a function
    ("if TYPE_CHECKING:\n    from dashboards import report\n", 2),
    ("import importlib\nm = importlib.import_module('tuner.search')\n", 2),
    ("x = 1\n\n\nclass A:\n    def g(self):\n        from moetune_cli import main\n", 6),
])
def test_an_upward_import_is_named_with_its_line(source, line):
    (msg,) = upward("engine", "engine/fake.py", source)
    assert msg.startswith(f"engine/fake.py:{line} imports ")


def test_downward_and_relative_imports_pass():
    source = ("import torch\nimport kernels.cpu\nfrom engine.knobs import CATALOGUE\nfrom . import llm\n"
              "from .weights import presets\nimport enginex\n")
    assert upward("engine", "engine/fake.py", source) == []
    assert upward("kernels", "kernels/fake.py", "from engine.knobs import CATALOGUE\n") != []
    assert upward("results", "results/fake.py", "from engine.weights.presets import cache_root\n") == []
