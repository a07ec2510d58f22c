"""``import gradflow`` and its commands need no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A `torch` that cannot be imported, whether or not it is installed.
NO_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_import_gradflow_does_not_import_torch():
    done = run(
        """
        import gradflow, gradflow.delivery.reporter, gradflow.delivery.delivery
        import gradflow.measurement.record
        print(gradflow.TrainingAlert.__name__, gradflow.Watch.__name__)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "TrainingAlert Watch" in done.stdout


def test_the_cli_runs_without_torch():
    done = run(
        """
        import sys
        from gradflow.__main__ import main
        sys.argv = ["gradflow", "check", "--help"]
        main()
        """
    )
    assert "gradflow check" in done.stdout, done.stdout + done.stderr


def test_watch_says_torch_is_needed_when_it_is_used():
    done = run("import gradflow; gradflow.watch")
    assert done.returncode != 0 and "torch" in done.stderr
