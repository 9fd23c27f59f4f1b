"""`--help`: the project's page, with the common commands and the config groups, no schema nodes."""

from pathlib import Path

from torchbeast_hydra.__main__ import CONFIG_DIR

from helpers import cli_argv, run_command


def test_help_page(tmp_path):
    result = run_command(cli_argv("--help"), timeout=60)
    assert result.returncode == 0, result.stderr
    page = result.stdout
    assert page.startswith("torchbeast_hydra: IMPALA")
    assert "powered by Hydra" not in page
    for command in (
        "experiment=cartpole",
        "mode=test load_dir=RUN_DIR",
        "hydra/launcher=slurm",
        "hydra/sweeper=lr_entropy",
        "hydra.run.dir=RUN_DIR",
    ):
        assert command in page, command
    assert "base_" not in page, "typed schema nodes are not options"
    groups = {
        line.split(":")[0].strip(): line.split(":", 1)[1]
        for line in page.splitlines()
        if line.startswith("  ") and ":" in line and "(default)" in line
    }
    # every group dir of conf/ with every option file, the default first
    for group in (p for p in Path(CONFIG_DIR).iterdir() if p.is_dir() and p.name != "hydra"):
        options = [o.strip().removesuffix(" (default)") for o in groups[group.name].split(",")]
        files = sorted(f.stem for f in group.glob("*.yaml"))
        assert sorted(o for o in options if o != "none" or "none" in files) == files  # none: a null default
    assert groups["env"].strip().startswith("pong (default)")
    for preset in ("lr_entropy", "slurm"):  # the hydra groups the page lists by hand exist
        assert list(Path(CONFIG_DIR, "hydra").glob(f"*/{preset}.yaml")), preset
    assert "\nenv:\n  id: ALE/Pong-v5" in page, "the composed config follows"


def test_help_follows_overrides():
    result = run_command(cli_argv("--help", "experiment=cartpole"), timeout=60)
    assert result.returncode == 0 and "\nenv:\n  id: CartPole-v1" in result.stdout
