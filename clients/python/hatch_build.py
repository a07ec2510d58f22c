"""The wheel carries ``gradflow-server``, as ruff's and uv's wheels carry their binaries.

Hatchling builds the Python package; this hook adds the server binary to the wheel's
scripts (``gradflow-0.1.0.data/scripts/gradflow-server``, installed beside the
``gradflow`` command) and tags the wheel for the platform the binary runs on. The
binary is

- ``GRADFLOW_BUILD_SERVER_BIN``, when set: a server already built (a release job that
  compiled it elsewhere, or CI reusing the workspace's build);
- otherwise compiled here from the repository's cargo workspace (this project sits in
  ``clients/python`` of it): ``cargo build --locked -p gradflow-server`` with the
  profile ``GRADFLOW_BUILD_PROFILE`` names (``release`` by default, its debug line
  tables stripped; ``dev`` shares the workspace's ``target/debug`` build as it is).

An editable install (``pip install -e``) carries no binary and compiles nothing: it
finds the server through ``GRADFLOW_SERVER_BIN`` or the PATH, as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict, Optional

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

EXE = ".exe" if sys.platform == "win32" else ""
NAME = "gradflow-server" + EXE


class ServerBinaryHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: Dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        binary = _prebuilt() or _compile(Path(self.root))
        build_data["shared_scripts"][str(binary)] = NAME
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{platform_tag(binary)}"


def _prebuilt() -> Optional[Path]:
    given = os.environ.get("GRADFLOW_BUILD_SERVER_BIN")
    if not given:
        return None
    path = Path(given)
    if not path.is_file():
        raise RuntimeError(f"GRADFLOW_BUILD_SERVER_BIN={given}: no such file")
    return path


def _workspace(root: Path) -> Optional[Path]:
    """The cargo workspace this project belongs to (the repository's root)."""
    for folder in [root, *root.parents]:
        manifest = folder / "Cargo.toml"
        server = folder / "server" / "Cargo.toml"
        if server.is_file() and manifest.is_file() and "[workspace]" in manifest.read_text():
            return folder
    return None


def _compile(root: Path) -> Path:
    workspace = _workspace(root.resolve())
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if workspace is None or cargo is None:
        missing = "cargo (Rust 1.87 or newer)" if workspace else "the repository's Rust sources"
        raise RuntimeError(
            f"building the gradflow wheel compiles gradflow-server, and {missing} is not "
            "there: build from a checkout of the repository with Rust installed, or set "
            "GRADFLOW_BUILD_SERVER_BIN to a gradflow-server binary"
        )
    profile = os.environ.get("GRADFLOW_BUILD_PROFILE", "release")
    command = [cargo, "build", "--locked", "--profile", profile, "-p", "gradflow-server"]
    if profile != "dev":
        # The wheel's binary without its line tables: a quarter of the size (about 8 MB
        # compressed instead of 33). Passed to the binary's own compilation only, so the
        # dependencies' build is the same as `cargo build --release`'s.
        command[1:2] = ["rustc", "--bin", "gradflow-server"]
        command += ["--message-format=json-render-diagnostics", "--", "-C", "strip=debuginfo"]
    else:
        command += ["--message-format=json-render-diagnostics"]
    # cargo's progress and diagnostics go to stderr, where pip shows them with -v; the
    # artifacts it reports come on stdout.
    done = subprocess.run(command, cwd=workspace, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit status {done.returncode})")
    for line in done.stdout.splitlines():
        message = json.loads(line) if line.startswith("{") else {}
        if message.get("reason") != "compiler-artifact":
            continue
        if message["target"]["name"] == "gradflow-server" and message.get("executable"):
            return Path(message["executable"])
    raise RuntimeError(f"{' '.join(command)} reported no gradflow-server executable")


def platform_tag(binary: Path) -> str:
    """The wheel's platform tag. On Linux, ``manylinux_2_N`` with N the newest glibc
    symbol version the binary links against (it needs nothing else from the system but
    libgcc), so the wheel installs on every distribution whose glibc is that or newer."""
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if platform.startswith("linux_"):
        versions = re.findall(rb"GLIBC_2\.(\d+)", binary.read_bytes())
        if versions:
            return f"manylinux_2_{max(int(v) for v in versions)}_{platform[len('linux_') :]}"
        return platform
    if platform.startswith("macosx_"):
        from packaging.tags import platform_tags

        return next(iter(platform_tags()))
    return platform
