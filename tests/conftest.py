"""Fixtures and hooks (the helpers tests import are in tests/helpers.py).

Tests state their cost: every test that starts the CLI or a training process is marked `slow`,
so that `make test-fast` (`-m "not slow and not slurm"`) runs none. Two layers see to it:

1. At collection, a test is marked slow when its code, a fixture it uses (through any chain of
   fixtures), or a function of tests/ that any of these calls reaches a helper decorated
   @starts_cli (run_cli, start_cli, run_sweep, cli_argv, ...). So a test that trains through
   `tiny_run`, or through a helper of its own that calls run_cli, needs no mark of its own.
2. At run time, in a test that is not marked slow, starting a process that runs the CLI (by any
   command line: `-m torchbeast_hydra`, torchbeast_hydra.__main__, the torchbeast-hydra script, a
   hydra.run.dir or hydra.sweep.dir override, a benchmarks/ script) or any multiprocessing
   process (how the backends start actors and env clients, in process too) fails the test:
   "... mark it slow". This catches what layer 1 cannot see (a command line built by hand, a
   starter reached through an object), so a missed case fails the fast tier instead of slowing it.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import re
import shutil
import subprocess
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import helpers
from helpers import REPO, TESTS, TINY, cli_env, run_cli

# -- layer 1: mark slow at collection what reaches a @starts_cli helper --------------------------------


def _code_objects(code):
    """code and the code of the functions and lambdas defined in it."""
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _code_objects(const)


def _is_test_function(obj) -> bool:
    """A function defined under tests/ (the only code the search follows: not the package's)."""
    code = getattr(obj, "__code__", None)
    return inspect.isfunction(obj) and code is not None and code.co_filename.startswith(str(TESTS))


def _closure_values(function) -> dict:
    values = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # the enclosing function has not assigned it yet
            pass
    return values


def _reaches_the_cli(function, seen: set) -> bool:
    if not _is_test_function(function) or function.__code__ in seen:
        return False
    seen.add(function.__code__)
    closure = _closure_values(function)
    for code in _code_objects(function.__code__):
        for name in (*code.co_names, *code.co_freevars):
            # Attribute names (helpers.run_cli) are looked up in helpers too.
            obj = closure.get(name, function.__globals__.get(name, getattr(helpers, name, None)))
            if inspect.isfunction(obj) and (getattr(obj, "starts_cli", False) or _reaches_the_cli(obj, seen)):
                return True
    return False


def starts_the_cli(item) -> bool:
    """Whether the test, a fixture it uses, or what they call reaches a @starts_cli helper."""
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    seen = set()
    return any(_reaches_the_cli(inspect.unwrap(f), seen) for f in (item.function, *fixtures))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the mark must be there when it looks
def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("slow") and starts_the_cli(item):
            item.add_marker(pytest.mark.slow)
    _files_with_most_slow_tests_first(items)


def _files_with_most_slow_tests_first(items) -> None:
    """make test's workers take whole files (--dist loadfile) in collection order. With the costly
    files first, both end on quick ones at about the same time, instead of one waiting while the
    other runs the last costly file. Stable: each file's tests stay together, in their order."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


# -- layer 2: at run time, a test not marked slow may not start the CLI or a process -----------------

# A command line that runs the CLI, however it was built.
CLI_COMMAND = re.compile(
    r"-m torchbeast_hydra( |$)|torchbeast_hydra\.__main__|torchbeast-hydra|hydra\.(run|sweep)\.dir=|benchmarks/"
)
_running = None  # the test item whose setup, call or teardown is running


def _refuse_in_the_fast_tier(what: str):
    if _running is not None and not _running.get_closest_marker("slow"):
        pytest.fail(
            f"{_running.nodeid} {what}: mark it slow (@pytest.mark.slow), or start it through a "
            "@starts_cli helper of tests/helpers.py, which marks it so (see tests/conftest.py)",
            pytrace=False,
        )


def _guarded_popen_init(init):
    def guarded(self, args, *rest, **kwargs):
        command = args if isinstance(args, (str, bytes, os.PathLike)) else " ".join(map(str, args))
        if CLI_COMMAND.search(str(command)):
            _refuse_in_the_fast_tier(f"starts the CLI ({command})")
        init(self, args, *rest, **kwargs)

    return guarded


def _guarded_process_start(start):
    def guarded(self):
        _refuse_in_the_fast_tier(f"starts a process ({self.name}), as training starts its actors and env clients")
        start(self)

    return guarded


_ORIGINALS = {
    (subprocess.Popen, "__init__"): subprocess.Popen.__init__,
    (multiprocessing.process.BaseProcess, "start"): multiprocessing.process.BaseProcess.start,
}


def pytest_configure(config):
    # One intra-op thread for the tests' own torch work. With the default (a thread a core), two
    # xdist workers beside training processes oversubscribe the cores, and OpenMP's spinning
    # threads turn a tiny LSTM pass from milliseconds into seconds. The processes the tests start
    # set their own threads (backend.learner_torch_threads, inference_torch_threads).
    torch.set_num_threads(1)
    subprocess.Popen.__init__ = _guarded_popen_init(subprocess.Popen.__init__)
    multiprocessing.process.BaseProcess.start = _guarded_process_start(multiprocessing.process.BaseProcess.start)


def pytest_unconfigure(config):
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # The whole protocol: a module-scoped fixture that trains does so in its first user's setup.
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished tiny CartPole run (its run dir), trained once per session: tests only read it.

    A test that resumes it, corrupts it or plays it in place takes tiny_run_copy instead.
    """
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    run_cli(run_dir, *TINY)
    return run_dir


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path):
    """The test's own copy of tiny_run, to change as it likes."""
    return shutil.copytree(tiny_run, tmp_path / "run")


def _snapshot(run_dir):
    """Every file under run_dir with its size and mtime: what a read-only use leaves unchanged."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


@pytest.fixture(scope="session")
def tiny_test_run(tiny_run, tmp_path_factory):
    """mode=test of tiny_run, played once per session into a run dir of its own: two games, each
    recorded, with no display or desktop session (as on a cluster node). Tests only read it.

    Returns the test run's dir, its CompletedProcess, and tiny_run's files before and after.
    """
    test_dir = tmp_path_factory.mktemp("tiny_test") / "eval"
    before = _snapshot(tiny_run)
    env = cli_env(DISPLAY=None, WAYLAND_DISPLAY=None, XDG_RUNTIME_DIR=None, SDL_VIDEODRIVER=None)
    overrides = ["experiment=cartpole", "mode=test", f"load_dir={tiny_run}", "test.num_episodes=2"]
    result = run_cli(test_dir, *overrides, "test.record_video=true", env=env)
    return SimpleNamespace(dir=test_dir, result=result, before=before, after=_snapshot(tiny_run))


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory):
    """A finished tiny CartPole sweep (its sweep dir), run once per session: two seeds of two learning
    rates, each job in a dir named by its overrides (optim.learning_rate=0.001,seed=1, ...). Tests only read it."""
    sweep = tmp_path_factory.mktemp("tiny_sweep") / "sweep"
    run_cli(sweep, *TINY, "seed=1,2", "optim.learning_rate=0.003,0.001", multirun=True, timeout=400)
    return sweep


def _cluster_up() -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local single-node SLURM cluster (`make slurm-start`), for tests marked slurm.

    Started (and its Debian packages installed, if missing) once per session, and stopped at the
    end unless it was already up before the tests. Skipped only where it cannot be had: not root,
    or no apt-get to install it with."""
    installed = all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch"))
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (it starts munged, slurmctld and slurmd)")
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it with")
    was_up = _cluster_up()
    start = subprocess.run([str(REPO / "scripts/slurm/start.sh")], capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        raise AssertionError(f"make slurm-start failed:\n{start.stdout}\n{start.stderr}")
    partition = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30).stdout.split()[
        0
    ]
    yield partition
    if not was_up:
        subprocess.run([str(REPO / "scripts/slurm/stop.sh")], capture_output=True, timeout=120)
