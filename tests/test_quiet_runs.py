"""A pytest run prints no warning the user did not cause: not pytest-asyncio's about
its unset fixture loop scope (aaccl's test extra installs it), not pytest's about
modules imported before it could rewrite their asserts (under `aaccl launch`). Each
run is a real `python -m pytest` in a process of its own, as a user starts it: in
this repository, and in a user's project that only installed aaccl."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_mpi_fabric import MPIEXEC

ROOT = Path(__file__).resolve().parents[1]
NOISE = ('"asyncio_default_fixture_loop_scope" is unset', "PytestDeprecationWarning",
         "PytestAssertRewriteWarning", "PytestConfigWarning")

USER_TEST = """
import pytest

@pytest.mark.aaccl(world_size=2)
async def test_allreduce(accl):
    buf = accl.allocate(4)
    buf[:] = accl.rank + 1
    await accl.allreduce(buf, buf, 4, 0)
    assert (buf == 3).all()
"""


def pytest_in(directory: Path, *args: str, launch: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m pytest ARGS` (or under `aaccl launch -n 2`) in `directory`, with
    this checkout's aaccl and nothing of this test run's pytest configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = ""  # whatever warnings show, show as a user would see them
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    if launch:
        command = [sys.executable, "-m", "aaccl", "launch", "-n", "2", *command[1:]]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def assert_quiet(run: subprocess.CompletedProcess[str]) -> None:
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert not [word for word in NOISE if word in out], out
    assert "Warning:" not in out and "warnings summary" not in out, out  # nor any other


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: one test marked aaccl, no pytest configuration of its own."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TEST))
    return tmp_path


def test_this_repositorys_tests_run_without_warnings() -> None:
    """The quickstart's `python -m pytest`, from a fresh clone (collection is enough:
    the warnings come at configuration)."""
    assert_quiet(pytest_in(ROOT, "--collect-only", "-q", "tests/test_unawaited.py"))


def test_a_users_project_runs_without_warnings(project: Path) -> None:
    run = pytest_in(project)
    assert_quiet(run)
    assert "1 passed" in run.stdout


def test_a_projects_own_fixture_loop_scope_still_wins(project: Path) -> None:
    """aaccl's plugin only gives pytest-asyncio's setting a default."""
    pytest.importorskip("pytest_asyncio")
    (project / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = module\n")
    run = pytest_in(project)
    assert "asyncio_default_fixture_loop_scope=module" in run.stdout, run.stdout
    run = pytest_in(project, "-o", "asyncio_default_fixture_loop_scope=class")
    assert "asyncio_default_fixture_loop_scope=class" in run.stdout, run.stdout
    (project / "pytest.ini").unlink()
    run = pytest_in(project)
    assert "asyncio_default_fixture_loop_scope=function" in run.stdout, run.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install 'aaccl[mpi]')")
def test_aaccl_launch_runs_pytest_without_warnings(project: Path) -> None:
    """Each rank's program imports aaccl and anyio itself, after pytest's assertion
    rewriting is in place: no 'Module already imported so cannot be rewritten'."""
    run = pytest_in(project, launch=True)
    assert_quiet(run)
    assert "1 passed" in run.stdout
