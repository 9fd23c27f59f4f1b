"""Metrics to Weights & Biases: a sink beside logs.csv, one wandb run per run dir.

`WandbLog` has CsvLog's interface (`write(row)`, `close()`), so `Stats` feeds it the same rows:
every numeric field, with the training `step` as the x-axis. The run's id is kept in the run
dir (`wandb_run_id`, written before wandb starts), so a resumed or requeued run, and `mode=test`,
continue the same wandb run; wandb's files go to `<run dir>/wandb`.

wandb never stops or slows training: all wandb calls happen on one background thread fed by a
queue, start-up has a deadline (`logger.wandb.init_timeout_s`), and any wandb error logs one
warning and turns the sink off. logs.csv is written whatever happens here.

Resuming after a crash. Training rows are logged at wandb's own step (`_step`) = the training
step, so a run resumed from a checkpoint at step S can ask wandb to rewind the run there
(`wandb.init(resume_from="ID?_step=S+1")`, wandb >= 0.17, online runs on a server that has
rewind): the rows past S that the crashed attempt logged are dropped, and the resumed rows take
their place, each step once. Where rewind is not possible (offline runs; a server without it; a
run the server does not know), the run is continued (`resume="allow"`) and rows at or below the
step wandb already has are not sent: the crashed attempt's rows past S stay, the resumed run's
rows start after them, so no step shows twice either, but steps S..crash show the crashed
attempt's figures. An offline run cannot know what the server has: its resumed part is a new
offline run dir with the same id, and `wandb sync` of both sends the overlapping steps twice
(sync the resumed part only, or rewind online).
"""

from __future__ import annotations

import logging
import netrc
import numbers
import os
import queue
import random
import re
import string
import threading
from pathlib import Path
from typing import Iterable, Mapping, Optional
from urllib.parse import urlparse

from torchbeast_hydra.logs.sweep_record import fixed_overrides, is_fixed

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
# Fields of a logs.csv row that are not scalars: the list of returns is summarised by
# mean_episode_return (the full list stays in logs.csv).
SKIPPED_FIELDS = {"episode_returns"}
MAX_QUEUED = 10_000  # rows waiting for a slow wandb before new ones are dropped
CLOSE_TIMEOUT_S = 120.0  # for wandb.finish (uploads what is left in online mode)


def has_credentials(environ: Mapping[str, str] = os.environ) -> bool:
    """True when wandb can log in without asking: WANDB_API_KEY, or a `wandb login` (netrc)."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str, environ: Mapping[str, str] = os.environ) -> str:
    """online / offline / disabled. `auto`: WANDB_MODE if set, else online with credentials."""
    if mode != "auto":
        return mode
    from_env = {
        "online": "online",
        "run": "online",
        "offline": "offline",
        "dryrun": "offline",
        "disabled": "disabled",
    }.get(environ.get("WANDB_MODE", "").lower())
    if from_env:
        return from_env
    return "online" if has_credentials(environ) else "offline"


def run_id_for(run_dir: Path) -> str:
    """The run dir's wandb run id: read back, or made and saved before wandb starts."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.exists():
        run_id = path.read_text().strip()
        if re.fullmatch(r"[a-z0-9]{1,64}", run_id):
            return run_id
        log.warning("Ignoring %s: %r is not a wandb run id; starting a new wandb run.", path, run_id)
    run_id = "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def hydra_labels() -> tuple[Optional[str], Optional[str], list]:
    """Default (group, name, tags) for this Hydra job.

    group: the sweep dir's name in a multirun, else the experiment preset, else None.
    name: the job's overrides (in a multirun, the swept ones: `seed=2,optim.learning_rate=0.001`),
    else the run dir's name.
    tags: the env, model and backend choices.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None, []
    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        group = sweep_name(sweep_dir)
        fixed = fixed_overrides(sweep_dir)  # named as its job dir is (launch.jobs.job_subdir)
        overrides = [o for o in overrides if not is_fixed(o, fixed)] or overrides
    else:
        group = choices.get("experiment") or None
    name = _clean(",".join(overrides), 128) or Path(hydra_cfg.runtime.output_dir).name
    tags = [_clean(str(choices[key]), 64) for key in ("env", "model", "backend") if choices.get(key)]
    return group, name, tags


def sweep_name(sweep_dir: Path) -> str:
    """`outputs/multirun/2024-05-01/12-00-00` -> `2024-05-01/12-00-00`; `sweeps/lr` -> `lr`."""
    name = sweep_dir.name
    if not re.search(r"[A-Za-z]", name) and sweep_dir.parent.name:  # a bare time: add the date
        name = f"{sweep_dir.parent.name}/{name}"
    return _clean(name, 128)


def _clean(text: str, limit: int) -> str:
    """No whitespace, and at most `limit` characters (wandb's limits: names 128, tags 64)."""
    text = re.sub(r"\s+", "", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def numeric_fields(row: Mapping) -> dict:
    """The row's numeric fields, as wandb takes them (empty cells and lists left out)."""
    out = {}
    for key, value in row.items():
        if key in SKIPPED_FIELDS or isinstance(value, bool):
            continue
        if isinstance(value, numbers.Real):
            out[key] = float(value) if not isinstance(value, numbers.Integral) else int(value)
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # torch/numpy scalars
            out[key] = value.item()
    return out


class WandbLog:
    """A sink that sends rows to one wandb run; never raises, never blocks the caller for long."""

    def __init__(
        self,
        settings,
        run_dir: str | os.PathLike,
        *,
        config: Optional[dict] = None,
        group: Optional[str] = None,
        name: Optional[str] = None,
        tags: Iterable[str] = (),
        job_type: Optional[str] = "train",
        resume_step: int = 0,
    ):
        self.mode = resolve_mode(_value(settings.mode))
        self.run_dir = Path(run_dir)
        self.run = None
        self.url: Optional[str] = None  # the run's page, once an online run has started
        self.sync_dir: Optional[str] = None
        self._failed = threading.Event()
        self._warn_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self._ready = threading.Event()
        self._thread = None
        if self.mode == "disabled":
            return
        try:
            self.run_id = run_id_for(self.run_dir)
        except OSError as error:
            self._fail(f"cannot keep the run id in {self.run_dir}: {error}")
            return
        init_kwargs = dict(
            project=settings.project,
            entity=settings.entity,
            group=settings.group or group,
            name=settings.name or name,
            tags=_unique([*tags, *settings.tags]) or None,
            config=config,
            job_type=job_type,
            dir=str(self.run_dir),
            mode=self.mode,
        )
        self._first_step = 0  # rows at lower steps are not sent (see the module docstring)
        self._thread = threading.Thread(
            target=self._work,
            args=(init_tries(init_kwargs, self.run_id, self.mode, resume_step), settings.init_timeout_s),
            name="wandb",
            daemon=True,
        )
        self._thread.start()
        # A little longer than wandb's own deadline, which normally ends a stuck start first.
        if not self._ready.wait(settings.init_timeout_s + min(10.0, settings.init_timeout_s)):
            self._fail(f"wandb did not start within {settings.init_timeout_s:g} s (logger.wandb.init_timeout_s)")

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._failed.is_set()

    def write(self, row: Mapping) -> None:
        """Queues a logs.csv row: its numeric fields, at x = row['step'] (also wandb's own step)."""
        metrics = numeric_fields(row)
        self.log(metrics, wandb_step=metrics.get("step"))

    def log_eval(self, row: Mapping) -> None:
        """An evaluation's figures (evaluation.periodic) as eval/*, at x = the training step it measured.

        At wandb's next `_step`: the evaluation finishes after later training rows were logged."""
        figures = {f"eval/{key}": value for key, value in numeric_fields(row).items() if key != "step"}
        self.log(dict(step=row["step"], **figures), summary=figures)

    def log(
        self,
        metrics: Mapping,
        videos: Optional[Mapping[str, str | os.PathLike]] = None,
        summary: Optional[Mapping] = None,
        wandb_step: Optional[int] = None,
    ) -> None:
        """Queues metrics (a `step` key sets their x), video files to upload and summary values.

        wandb_step: wandb's `_step` for the row; None: the next one (as for an evaluation)."""
        if not self.active:
            return
        try:
            self._queue.put_nowait(("log", dict(metrics), dict(videos or {}), dict(summary or {}), wandb_step))
        except queue.Full:
            self._fail(f"wandb fell {MAX_QUEUED} rows behind")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finishes the wandb run (each job its own run, even when jobs share a process)."""
        thread, self._thread = self._thread, None
        if thread is None or not self._ready.is_set():
            return  # disabled, or wandb never started: nothing to finish, nothing to wait for
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            self._fail(f"wandb fell {MAX_QUEUED} rows behind")
            return
        thread.join(timeout_s)
        if thread.is_alive():
            self._fail(f"wandb did not finish within {timeout_s:g} s")
        elif self.mode == "offline" and self.sync_dir and not self._failed.is_set():
            log.info("wandb: offline run %s saved; upload it with:  wandb sync %s", self.run_id, self.sync_dir)

    # The wandb thread: every wandb call happens here.

    def _work(self, tries: list, init_timeout_s: float) -> None:
        run = None
        try:
            import wandb

            for i, kwargs in enumerate(tries):
                try:
                    run = wandb.init(
                        **kwargs, settings=wandb.Settings(init_timeout=init_timeout_s, silent=True, console="off")
                    )
                    break
                except Exception as error:
                    if i + 1 == len(tries):
                        raise
                    log.warning(
                        "wandb could not rewind run %s to the checkpoint (%s); continuing it instead: "
                        "steps past the checkpoint keep the crashed attempt's figures.",
                        self.run_id,
                        _first_line(error),
                    )
        except BaseException as error:  # anything, even a KeyboardInterrupt-like exit of wandb
            self._fail(f"wandb did not start: {_first_line(error)}")
            self._ready.set()
            return
        if "resume_from" not in kwargs and getattr(run, "resumed", False):
            self._first_step = int(getattr(run, "step", 0) or 0)  # what wandb has already
        self.url = getattr(run, "url", None) if self.mode == "online" else None  # before the caller reads it
        self._ready.set()
        if self._failed.is_set():  # started after the deadline: training went on without it
            self.url = None
            _finish(run)
            return
        self.run, self.sync_dir = run, getattr(run.settings, "sync_dir", None)
        if self.mode == "online":
            log.info("wandb: run %s at %s", run.id, run.url)
        try:
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            while True:
                item = self._queue.get()
                if item is None:
                    break
                if self._failed.is_set():
                    continue
                _, metrics, videos, summary, step = item
                for key, path in videos.items():
                    metrics[key] = wandb.Video(str(path))
                if metrics and step is None:
                    run.log(metrics)
                elif metrics and step >= self._first_step:
                    run.log(metrics, step=step)
                if summary:
                    run.summary.update(summary)
        except Exception as error:
            self._fail(f"wandb failed while logging: {_first_line(error)}")
        _finish(run, self._fail)

    def _fail(self, reason: str) -> None:
        with self._warn_lock:
            if self._failed.is_set():
                return
            self._failed.set()
        saved = f" What wandb saved is in {self.sync_dir} (`wandb sync` uploads it)." if self.sync_dir else ""
        log.warning("%s. Training goes on without wandb; logs.csv is unaffected.%s", reason, saved)


def init_tries(kwargs: dict, run_id: str, mode: str, resume_step: int) -> list:
    """wandb.init's arguments, in the order to try them.

    A training run resumed from a checkpoint at resume_step, online: first rewind the wandb run
    to just after that step (dropping what the crashed attempt logged past it), then, if wandb
    refuses, continue it. Otherwise (a new run, offline, mode=test): continue it or start it.
    """
    resume = dict(kwargs, id=run_id, resume="allow")
    if resume_step > 0 and mode == "online":
        return [dict(kwargs, resume_from=f"{run_id}?_step={resume_step + 1}"), resume]
    return [resume]


def _finish(run, on_error=None) -> None:
    try:
        run.finish()
    except Exception as error:
        if on_error is not None:
            on_error(f"wandb failed to finish: {_first_line(error)}")


def _first_line(error: BaseException, lines: int = 3) -> str:
    """The error's type and the start of its message, on one line."""
    text = " / ".join(line.strip() for line in str(error).strip().splitlines()[:lines] if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _unique(items: Iterable[str]) -> list:
    return list(dict.fromkeys(str(item) for item in items))


def _value(mode) -> str:
    return mode.value if hasattr(mode, "value") else str(mode)
