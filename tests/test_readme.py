"""The README's snippets run as pasted: every ```python block, and every bash block that checks one pair with
the combinations CLI, each in a fresh process started outside the repository (the installed package is what
they see). The install command and the full matrix are CI's own steps (.ci/run), not repeated here."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR_CLI = "python -m tests.test_modular_kernel_combinations --pf-type"


def _blocks(lang: str) -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


PYTHON_BLOCKS = _blocks("python")
PAIR_COMMANDS = [b.replace("\\\n", " ") for b in _blocks("bash") if b.startswith(PAIR_CLI)]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as a user's shell has it
    return env


def test_the_readme_has_the_snippets_this_file_runs():
    assert len(PYTHON_BLOCKS) >= 2 and len(PAIR_COMMANDS) >= 1


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_snippet_runs_as_pasted(tmp_path, index):
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(PYTHON_BLOCKS[index])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the snippet prints what it computed"


@pytest.mark.parametrize("index", range(len(PAIR_COMMANDS)))
def test_readme_pair_command_runs_as_pasted(index):
    # The CLI is a module of this repository's tests package: run from the repository root, as the README says.
    cmd = PAIR_COMMANDS[index].split()
    assert cmd[:2] == ["python", "-m"]
    proc = subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert re.search(r"\b\d+ passed, 0 failed", proc.stdout), proc.stdout[-2000:]
