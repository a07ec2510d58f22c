"""The package's layers (ARCHITECTURE.md): every import downward, checked from the
source by scripts/check-layering.py, on the package as it is and on copies of it
with one upward import added."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[4]
PACKAGE = REPO / "clients" / "python" / "src" / "gradflow"


def load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_layering", REPO / "scripts" / "check-layering.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CHECK = load_check()


def errors_of(package: Path) -> List[str]:
    errors: List[str] = []
    CHECK.check_python(package, errors)
    return errors


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(PACKAGE, tmp_path / "gradflow"))


def add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_package_imports_only_downward():
    assert errors_of(PACKAGE) == []


def test_the_check_reads_the_packages_imports():
    # Not vacuous: the graph holds the imports every layer makes of the one below.
    modules = CHECK.python_modules(PACKAGE)
    found = {
        target
        for module, path in modules.items()
        for target, _ in CHECK.python_imports(path, module, modules)
    }
    assert {"gradflow.measurement.registration", "gradflow.delivery.reporter"} <= found
    assert {"gradflow.capture.instrument", "gradflow.watcher", "gradflow.wire"} <= found


@pytest.mark.parametrize(
    ("file", "line", "module", "target"),
    [
        # measurement below capture, even from inside a function
        (
            "measurement/record.py",
            "def late():\n    from ..capture import hooks",
            "gradflow.measurement.record",
            "gradflow.capture.hooks",
        ),
        # delivery knows nothing of the API's options, nor of measurement
        (
            "delivery/delivery.py",
            "from ..options import WatchOptions",
            "gradflow.delivery.delivery",
            "gradflow.options",
        ),
        (
            "delivery/spool.py",
            "from ..measurement import encode",
            "gradflow.delivery.spool",
            "gradflow.measurement.encode",
        ),
        # capture does not talk to the server
        (
            "capture/hooks.py",
            "from ..delivery import transport",
            "gradflow.capture.hooks",
            "gradflow.delivery.transport",
        ),
        # nothing imports the integrations
        (
            "watcher.py",
            "from .integrations import lightning",
            "gradflow.watcher",
            "gradflow.integrations.lightning",
        ),
        # the foundation imports nothing above it, not even for typing
        (
            "errors.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import watcher",
            "gradflow.errors",
            "gradflow.watcher",
        ),
    ],
)
def test_an_upward_import_is_named(copy: Path, file: str, line: str, module: str, target: str):
    add_line(copy / file, line)
    # The upward import is named (it may close a circle as well, named apart).
    errors = [e for e in errors_of(copy) if "in a circle" not in e]
    assert len(errors) == 1, errors
    assert f"imports `{target}`" in errors[0]
    assert module in errors[0] and file in errors[0]


def test_a_module_of_no_layer_is_named(copy: Path):
    (copy / "helpers.py").write_text("X = 1\n")
    errors = errors_of(copy)
    assert len(errors) == 1 and "`gradflow.helpers` has no layer" in errors[0], errors


def test_modules_importing_each_other_in_a_circle_are_named(copy: Path):
    add_line(copy / "measurement" / "encode.py", "from . import record")
    errors = errors_of(copy)
    assert len(errors) == 1 and "in a circle" in errors[0], errors
    assert "gradflow.measurement.encode" in errors[0]
    assert "gradflow.measurement.record" in errors[0]
