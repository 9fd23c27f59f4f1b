"""The logger's settings: the progress line, logs.csv, TensorBoard and wandb."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from torchbeast_hydra.errors import require


class WandbMode(enum.Enum):
    auto = "auto"  # online when credentials exist (WANDB_API_KEY or `wandb login`), else offline
    online = "online"
    offline = "offline"  # files under <run dir>/wandb; upload later with `wandb sync`
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.auto
    project: str = "torchbeast_hydra"
    entity: Optional[str] = None  # None: your default entity
    group: Optional[str] = None  # None: the sweep (multirun dir) or the experiment preset's name
    name: Optional[str] = None  # None: the job's overrides, else the run dir's name
    tags: List[str] = field(default_factory=list)  # added to the env/model/backend choices
    init_timeout_s: float = 60.0  # longer than this and the run goes on without wandb


@dataclass
class LoggerConfig:
    log_interval_s: float = 5.0  # console progress line
    csv: bool = True  # logs.csv in the run dir
    tensorboard: bool = False  # scalars to RUN_DIR/tensorboard/ (needs the tensorboard package)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def check(cfg) -> None:
    """The logger slice's checks (cfg.logger)."""
    require(cfg.logger.log_interval_s > 0, "logger.log_interval_s must be positive.")
    wandb = cfg.logger.wandb
    require(bool(wandb.project and wandb.project.strip()), "logger.wandb.project must not be empty.")
    require(
        not any(c in wandb.project for c in "/\\#?%:"),
        f"logger.wandb.project={wandb.project!r} may not contain / \\ # ? % or :.",
    )
    require(wandb.init_timeout_s > 0, "logger.wandb.init_timeout_s must be positive.")
    for tag in wandb.tags:
        require(0 < len(str(tag)) <= 64, f"logger.wandb.tags: {tag!r} must be 1 to 64 characters.")
