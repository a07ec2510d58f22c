"""What a new user touches first, without torch: the version, the integrations
named as the README names them, and a wheel built in the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gradflow

REPO = Path(__file__).resolve().parents[4]

# Imports of torch and the frameworks fail, whether or not they are installed.
NO_FRAMEWORKS = (
    "import sys\n"
    "for name in ('torch', 'transformers', 'lightning', 'pytorch_lightning'):\n"
    "    sys.modules[name] = None\n"
)


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_FRAMEWORKS + code], capture_output=True, text=True, timeout=60
    )


def test_gradflow_version_prints_the_package_version():
    done = subprocess.run(
        [sys.executable, "-m", "gradflow", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, f"gradflow {gradflow.__version__}\n"), done.stderr


def test_the_integrations_are_attributes_of_the_package_loaded_on_first_use():
    done = python(
        "import gradflow\n"
        "print(sorted(gradflow.integrations.__all__))\n"
        "print('transformers' in dir(gradflow.integrations), 'integrations' in dir(gradflow))\n"
        "try:\n"
        "    gradflow.integrations.transformers\n"
        "except ImportError as err:\n"
        "    print('needs', err.name)\n"
        "try:\n"
        "    gradflow.integrations.keras\n"
        "except AttributeError as err:\n"
        "    print(err)\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "['lightning', 'transformers']"
    assert lines[1] == "True True"
    # Naming the integration imports its framework then, not at `import gradflow`.
    assert lines[2] in ("needs torch", "needs transformers"), done.stdout
    assert lines[3] == "module 'gradflow.integrations' has no attribute 'keras'"


def test_a_wheel_built_in_the_checkout_is_not_left_for_git_to_pick_up():
    """``pip wheel ./clients/python`` writes into the current folder, the repository's
    root for the README's command."""
    wheel = "gradflow-0.1.0-py3-none-manylinux_2_35_x86_64.whl"
    for where in (REPO / wheel, REPO / "clients" / "python" / wheel, REPO / "dist" / wheel):
        done = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", str(where)], cwd=REPO, timeout=60
        )
        assert done.returncode == 0, f"{where} is not ignored by git"
