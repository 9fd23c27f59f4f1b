"""The docs' Extending page (docs/extending.md), run as written: a user's env, model and loss term,
each trained briefly from the files and commands the page gives; and a user env whose constructor
fails."""

import re
import shlex

import pytest

from torchbeast_hydra.run import checkpoint

from helpers import REPO, SMALL, cli_argv, cli_env_with_path, rows, run_command

pytestmark = pytest.mark.slow

# Small enough to train in seconds (one actor); appended to each command of the page.
BRIEF = ["total_steps=640", *SMALL, "backend.num_actors=1"]


def extending_page() -> str:
    return (REPO / "docs" / "extending.md").read_text()


def page_files_and_commands():
    """The page's files (code blocks whose first line is `# PATH`) and its training commands."""
    files, commands = {}, []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", extending_page(), re.S):
        first, _, rest = body.partition("\n")
        if language in ("python", "yaml") and first.startswith("# "):
            files[first[2:].strip()] = rest
        elif language == "bash":
            commands += [line for line in body.splitlines() if line.startswith("python -m torchbeast_hydra")]
    return files, commands


def run_in(directory, command: str, run_dir, *extra: str, check: bool = True):
    """A command line of the page, run from `directory` (where the user's files are), plus extra overrides."""
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "torchbeast_hydra"]
    # PYTHONPATH: this checkout's package, as installed (the user's files come from the cwd).
    argv = cli_argv(*argv[3:], f"hydra.run.dir={run_dir}", *extra)
    return run_command(argv, timeout=300, check=check, env=cli_env_with_path(), cwd=directory)


@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user")
    files, commands = page_files_and_commands()
    assert set(files) == {"my_envs.py", "my_models.py", "my_conf/model/wide.yaml", "my_losses.py"}
    for path, text in files.items():
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_text(text)
    return directory, commands


def command_with(commands, text):
    (command,) = [c for c in commands if text in c]
    return command


@pytest.mark.parametrize("form", ["env.id=my_envs:Walk-v0", "env.imports=[my_envs]"])
def test_readme_env_trains_on_both_backends(readme, form):
    directory, commands = readme
    command = command_with(commands, form)
    assert ("backend=poly" in command) == (form == "env.imports=[my_envs]")  # one form on each backend
    run_dir = directory / form.split("=")[0]
    run_in(directory, command, run_dir, *BRIEF)
    assert int(rows(run_dir)[-1]["step"]) >= 640  # poly: partial rollouts at resets may overshoot
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert state["env"]["obs_shape"] == [6] and state["env"]["num_actions"] == 2


def test_readme_model_trains_from_config_alone(readme):
    directory, commands = readme
    run_dir = directory / "model"
    run_in(directory, command_with(commands, "model=wide"), run_dir, *BRIEF)
    weights = checkpoint.load(checkpoint.path_in(run_dir))["learner"]["model"]
    assert tuple(weights["body.net.1.weight"].shape) == (64, 4)  # model.width=64 from the command line
    assert int(rows(run_dir)[-1]["step"]) == 640


def test_readme_model_with_a_field_its_class_does_not_take_fails_before_starting(readme):
    directory, commands = readme
    run_dir = directory / "bad_model"
    result = run_in(directory, command_with(commands, "model=wide"), run_dir, "+model.depth=3", *BRIEF, check=False)
    assert result.returncode == 2
    assert "my_models.Wide" in result.stdout + result.stderr and "depth" in result.stdout + result.stderr
    assert not (run_dir / "logs.csv").exists()


def test_readme_loss_term_is_trained_on_and_logged(readme):
    directory, commands = readme
    run_dir = directory / "loss"
    run_in(directory, command_with(commands, "extra_losses"), run_dir, *BRIEF)
    logged = rows(run_dir)
    assert int(logged[-1]["step"]) == 640
    kl = [float(row["kl_loss"]) for row in logged]
    # A KL (times its cost): never below zero beyond rounding, and above it once the policy has moved.
    assert all(value >= -1e-5 for value in kl) and any(value > 1e-5 for value in kl)
    total = float(logged[-1]["total_loss"])
    parts = sum(float(logged[-1][key]) for key in ("pg_loss", "baseline_loss", "entropy_loss", "kl_loss"))
    assert total == pytest.approx(parts, rel=1e-4, abs=1e-5)


def test_an_error_inside_a_user_env_keeps_its_traceback(tmp_path):
    (tmp_path / "broken_envs.py").write_text(
        "import gymnasium as gym\n\n\n"
        "class Broken(gym.Env):\n"
        "    def __init__(self):\n"
        "        raise ValueError('the bug in my env')\n\n\n"
        "gym.register('Broken-v0', entry_point=Broken)\n"
    )
    result = run_in(
        tmp_path,
        "python -m torchbeast_hydra env.id=broken_envs:Broken-v0 model=mlp",
        tmp_path / "run",
        *BRIEF,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2
    first = output.index("could not create env.id='broken_envs:Broken-v0': ValueError: the bug in my env")
    assert "Traceback" in output[first:] and 'broken_envs.py", line 6, in __init__' in output[first:]
