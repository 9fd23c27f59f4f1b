"""A suite sweeps tasks (conf/task/): each option sets its env id and that task's own settings, after
the suite's preset and before the command line, so the composed config says what each task runs
with; a task file's key that no schema declares is refused before the sweep's first job."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.overrides import check_overrides

from helpers import compose_config, leaves

CONF = Path(CONFIG_DIR)
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))


def swept_tasks(preset: str) -> list[str]:
    params = OmegaConf.load(CONF / "experiment" / f"{preset}.yaml").hydra.sweeper.params
    return str(params.get("task", "")).split(",") if params.get("task") else []


SUITES = {p.stem: swept_tasks(p.stem) for p in (CONF / "experiment").glob("suite_*.yaml") if swept_tasks(p.stem)}


def task_settings(task: str) -> dict:
    content = OmegaConf.to_container(OmegaConf.load(CONF / "task" / f"{task}.yaml"))
    content.pop("defaults", None)
    return dict(leaves(content))


def test_the_laptop_suite_gives_each_task_its_own_learning_rate():
    assert SUITES["suite_classic"] == ["CartPole-v1", "Acrobot-v1"]
    cartpole = compose_config(["experiment=suite_classic", "task=CartPole-v1"])
    acrobot = compose_config(["experiment=suite_classic", "task=Acrobot-v1"])
    assert (cartpole.env.id, cartpole.optim.learning_rate) == ("CartPole-v1", 0.001)
    assert (acrobot.env.id, acrobot.optim.learning_rate) == ("Acrobot-v1", 0.003)
    for cfg in (cartpole, acrobot):  # the suite's own settings stay under each task's
        assert cfg.vtrace.reward_scale == 0.1 and cfg.total_steps == 300_000


@pytest.mark.parametrize("suite, task", [(suite, task) for suite, tasks in SUITES.items() for task in tasks])
def test_each_swept_task_composes_with_its_suite_to_what_its_file_sets(suite, task):
    cfg = compose_config([f"experiment={suite}", f"task={task}"])
    settings = task_settings(task)
    assert "env.id" in settings, f"conf/task/{task}.yaml must set env.id: the report groups runs by it"
    for key, value in settings.items():
        assert OmegaConf.select(cfg, key) == value, f"{suite} with task={task}: {key}"


def test_every_task_option_is_swept_by_a_suite():
    assert sorted({t for tasks in SUITES.values() for t in tasks}) == TASKS


def test_the_command_line_wins_over_a_task():
    cfg = compose_config(["experiment=suite_classic", "task=CartPole-v1", "optim.learning_rate=0.01"])
    assert cfg.optim.learning_rate == 0.01 and cfg.env.id == "CartPole-v1"


def write(conf_dir: Path, path: str, text: str) -> None:
    (conf_dir / path).parent.mkdir(parents=True, exist_ok=True)
    (conf_dir / path).write_text(textwrap.dedent(text))


@pytest.fixture
def own_conf(tmp_path):
    """A config dir of one's own with a task whose file misspells a key, and a suite that sweeps it."""
    write(tmp_path, "task/Typo-v1.yaml", "# @package _global_\nenv:\n  id: CartPole-v1\noptim:\n  learnig_rate: 0.01\n")
    write(tmp_path, "task/Typed-v1.yaml", "# @package _global_\noptim:\n  learning_rate: fast\n")
    write(
        tmp_path,
        "experiment/suite_mine.yaml",
        """\
        # @package _global_
        defaults:
          - suite_classic
        hydra:
          sweeper:
            params:
              task: CartPole-v1,Typo-v1
              seed: 1,2
        """,
    )
    return tmp_path


def refusal(*argv: str) -> str:
    with pytest.raises(ConfigError) as error:
        check_overrides(list(argv), CONFIG_DIR)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_task_file_with_an_undeclared_key_is_refused_naming_it(own_conf):
    message = refusal("--config-dir", str(own_conf), "experiment=suite_classic", "task=Typo-v1")
    assert message.startswith("task=Typo-v1: task/Typo-v1.yaml sets optim.learnig_rate, which AdamConfig")
    assert "did you mean optim.learning_rate?" in message


def test_a_task_file_value_of_the_wrong_type_is_refused(own_conf):
    message = refusal("--config-dir", str(own_conf), "experiment=cartpole", "task=Typed-v1")
    assert message.startswith("task=Typed-v1: task/Typed-v1.yaml sets optim.learning_rate: Value 'fast'")


def test_a_suite_sweeping_such_a_task_is_refused_before_its_first_job(own_conf):
    """The preset's sweep lists a good task first: the bad one is found before anything runs."""
    message = refusal("--config-dir", str(own_conf), "-m", "experiment=suite_mine")
    assert message.startswith("task=Typo-v1: ")
    check_overrides(["--config-dir", str(own_conf), "-m", "experiment=suite_mine", "task=CartPole-v1"], CONFIG_DIR)
    swept_here = refusal("--config-dir", str(own_conf), "-m", "experiment=cartpole", "task=Acrobot-v1,Typo-v1")
    assert swept_here.startswith("task=Typo-v1: ")


def test_a_suite_sweeping_a_task_that_does_not_exist_is_refused(own_conf):
    sweep = "# @package _global_\nhydra:\n  sweeper:\n    params:\n      task: CartPol-v1\n"
    write(own_conf, "experiment/suite_gone.yaml", sweep)
    message = refusal("--config-dir", str(own_conf), "-m", "experiment=suite_gone")
    assert message.startswith("task=CartPol-v1: no such option; did you mean task=CartPole-v1?")


def test_the_repository_suites_pass_the_check():
    for suite in sorted(p.stem for p in (CONF / "experiment").glob("suite_*.yaml")):
        check_overrides(["-m", f"experiment={suite}"], CONFIG_DIR)
