"""The package's build: a wheel carries gradflow-server and is tagged for the platform
the binary runs on; an editable install carries nothing and compiles nothing; a build
with neither cargo nor a prebuilt server says what it needs. (scripts/wheel-smoke.sh
installs the real wheel into a fresh environment.)"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import server_binary

PROJECT = Path(__file__).resolve().parents[1]


def build(kind: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    """hatchling's PEP 517 hook, as pip calls it (no isolation: the test venv has it)."""
    code = f"import hatchling.build as b, sys; print(b.build_{kind}(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wheel_carries_the_server_and_its_platform(tmp_path):
    binary = server_binary()
    env = {**os.environ, "GRADFLOW_BUILD_SERVER_BIN": str(binary)}
    done = build("wheel", tmp_path, env)
    assert done.returncode == 0, done.stderr
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    glibc = max(int(v) for v in re.findall(rb"GLIBC_2\.(\d+)", binary.read_bytes()))
    assert re.fullmatch(rf"gradflow-0\.1\.0-py3-none-manylinux_2_{glibc}_\w+\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        script = archive.getinfo("gradflow-0.1.0.data/scripts/gradflow-server")
        assert script.file_size == binary.stat().st_size
        assert (script.external_attr >> 16) & stat.S_IXUSR, "installed executable"
        metadata = archive.read("gradflow-0.1.0.dist-info/WHEEL").decode()
        assert "Root-Is-Purelib: false" in metadata
        assert (
            "gradflow = gradflow.__main__:main"
            in archive.read("gradflow-0.1.0.dist-info/entry_points.txt").decode()
        )
        assert "gradflow/integrations/lightning.py" in archive.namelist()


def test_an_editable_install_builds_nothing(tmp_path):
    # No cargo and no server binary: an editable install needs neither.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), "CARGO": "/nonexistent"}
    env.pop("GRADFLOW_BUILD_SERVER_BIN", None)
    done = build("editable", tmp_path, env)
    assert done.returncode == 0, done.stderr
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if ".data/" in n]
        (pth,) = [n for n in archive.namelist() if n.endswith(".pth")]
        assert archive.read(pth).decode().strip() == str(PROJECT / "src")


def test_a_wheel_without_cargo_or_a_server_says_what_it_needs(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    for name in ("GRADFLOW_BUILD_SERVER_BIN", "CARGO"):
        env.pop(name, None)
    done = build("wheel", tmp_path, env)
    assert done.returncode != 0
    assert "building the gradflow wheel compiles gradflow-server, and cargo" in done.stderr
    assert "GRADFLOW_BUILD_SERVER_BIN" in done.stderr
    assert not list(tmp_path.glob("*.whl"))
