"""Each stage of a training step timed alone on one core, for `throughput.py train`'s profile.

A run's own counters (logs.csv) say what env, inference, server work, batching and the learner
update cost inside the run, under contention; what they cannot split is timed here, apart from
the run, in core-microseconds per env step: the env's emulator against its preprocessing and our
lockstep wrapper, acting, the wire, the learner's forward, losses, backward and optimiser (the
torch.profiler scopes Learner._step names), weight publication and logging a row.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import numpy as np

REPEATS = 5
NATIVE_ENV = "env: all of it in ale-py's native vector env (the run's)"


def stage_costs(cfg, inference_batch: int, envs_per_message: int) -> dict:
    """stage -> core-microseconds per env step, each timed alone on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = env_costs(cfg)
        costs.update(model_costs(cfg, inference_batch))
        if cfg.backend.name == "poly":
            costs.update(wire_costs(cfg, envs_per_message))
        costs.update(logging_cost(cfg))
        return costs
    finally:
        torch.set_num_threads(threads)


def random_actions(spec, count: int) -> np.ndarray:
    """count actions drawn uniformly from the policy's side of the action space (actions.py)."""
    from torchbeast_hydra.env.actions import BOX, MULTI_BINARY

    rng = np.random.default_rng(0)
    if spec.kind == BOX:
        actions = rng.uniform(spec.low, spec.high, size=(count, spec.size)).astype(np.float32)
    else:
        actions = rng.integers(0, 2 if spec.kind == MULTI_BINARY else spec.nvec, size=(count, spec.size))
    return actions.reshape(count, *spec.step_shape)


def _per_call_us(fn, repeats: int = REPEATS) -> float:
    """CPU microseconds a call, after one warm-up call."""
    fn()
    started = time.process_time()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.process_time() - started) / repeats


def _per_step_us(step, seconds: float = 2.0) -> float:
    """CPU microseconds a call of step, over about `seconds` of calls."""
    step()
    calls, started, wall = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        step()
        calls += 1
    return 1e6 * (time.process_time() - started) / calls


def env_costs(cfg) -> dict:
    """An env step through our lockstep wrapper (Environments), the gymnasium env under it, and
    for Atari the emulator alone (frame_skip ALE frames and the last two screens read): the
    differences are our wrapper's and the preprocessing's costs."""
    from torchbeast_hydra.env.make import atari_settings, is_atari, make_env
    from torchbeast_hydra.env.native import vector_env_applies

    rng = np.random.default_rng(0)
    ours, actions = lockstep_env_us(cfg.env)

    env = make_env(cfg.env)
    env.reset(seed=0)

    def gym_step():
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()

    gymnasium = _per_step_us(gym_step)
    costs = {}
    if is_atari(cfg.env.id, cfg.env.imports):
        ale = env.unwrapped.ale
        skip = atari_settings(cfg.env).frame_skip
        legal = ale.getMinimalActionSet()
        screen = np.empty(ale.getScreenDims(), np.uint8)

        def emulate():
            for _ in range(skip):
                ale.act(legal[rng.integers(len(legal))])
            if ale.game_over():
                ale.reset_game()
            for _ in range(2):  # the two frames max-pooled
                ale.getScreenGrayscale(screen)

        emulator = _per_step_us(emulate)
        costs["env: emulator (ALE frames)"] = emulator
        costs["env: preprocessing (gymnasium wrappers)"] = max(0.0, gymnasium - emulator)
    else:
        costs["env: the gymnasium env"] = gymnasium
    env.close()
    costs["env: our lockstep wrapper (Environments)"] = max(0.0, ours - gymnasium)
    if cfg.backend.vector_env and vector_env_applies(cfg.env):
        costs[NATIVE_ENV] = native_env_cost(cfg.env, actions)
    return costs


def lockstep_env_us(env_cfg, seconds: float = 2.0) -> tuple[float, np.ndarray]:
    """CPU microseconds a step of one env through our lockstep wrapper (Environments), random
    actions; and the actions it drew."""
    from torchbeast_hydra.env.vector import Environments

    envs = Environments(env_cfg, 1, seed=0)
    envs.initial()
    actions = random_actions(envs.spec.actions, 256)
    counter = itertools.count()
    cost = _per_step_us(lambda: envs.step(actions[next(counter) % len(actions)][None]), seconds)
    envs.close()
    return cost, actions


def native_env_cost(env_cfg, actions: np.ndarray, num_envs: int = 4) -> float:
    """An env step in ale-py's native AtariVectorEnv on one thread, num_envs envs a call: what
    mono's actors and poly's clients step for Atari ids (the preprocessing done in C++)."""
    from torchbeast_hydra.env.native import AtariVectorEnvs

    envs = AtariVectorEnvs(env_cfg, 1)(num_envs, 0)
    envs.initial()
    counter = itertools.count()
    batched = actions[: len(actions) // num_envs * num_envs].reshape(-1, num_envs, *actions.shape[1:])
    cost = _per_step_us(lambda: envs.step(batched[next(counter) % len(batched)])) / num_envs
    envs.close()
    return cost


def model_costs(cfg, inference_batch: int) -> dict:
    """Acting on inference_batch envs, and one learner update on zeroed B x T rollouts split by the
    learner's profiler scopes, then publishing its weights to an acting copy; per env step."""
    import copy
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.layout import zero_rollouts
    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.learning import accel
    from torchbeast_hydra.learning.learner import Learner
    from torchbeast_hydra.run.publish import WeightPublisher

    spec = probe_env(cfg.env)
    model = make_model(cfg.model, spec)
    T, B = cfg.unroll_length, cfg.batch_size
    batch = zero_rollouts(spec, T, B)
    step = {k: v[:1, :1].expand(1, inference_batch, *v.shape[2:]).contiguous() for k, v in batch.items()}
    policy = copy.deepcopy(model)
    learner = Learner(cfg, model, torch.device("cpu"))
    bf16 = accel.acts_in_bf16(cfg.accel, learner.bf16)  # as the run acts

    def act():
        with torch.no_grad(), accel.autocast(bf16, torch.device("cpu")):
            policy(step, policy.initial_state(inference_batch))

    name = f"actor inference (batch {inference_batch}{', bf16' if bf16 else ''})"
    costs = {name: _per_call_us(act) / inference_batch}
    state = model.initial_state(B)
    learner.update(batch, state)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(REPEATS):
            learner.update(batch, state)
    scopes = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key.startswith("learner/")}
    for scope in ("forward", "losses", "backward", "optimiser"):
        costs[f"learner: {scope}"] = scopes.get(f"learner/{scope}", 0.0) / REPEATS / (T * B)
    lock = threading.Lock()
    publisher = WeightPublisher(model, policy, lock, threading.Lock(), interval=1)
    costs["weight publication"] = _per_call_us(publisher.after_update) / (T * B)
    return costs


def wire_costs(cfg, num_envs: int) -> dict:
    """A client's step message for num_envs envs: encoding it (client) and parsing, decoding and
    checking it (server); per env step. Stacks of frames go as the run sends them: with
    backend.newest_frames, a step in an episode's middle (each env's newest frame)."""
    from torchbeast_hydra.backends.poly import wire
    from torchbeast_hydra.backends.poly.frame_stacks import StackReceiver, StackSender, stackable
    from torchbeast_hydra.env import layout
    from torchbeast_hydra.env.spaces import probe_env

    spec = probe_env(cfg.env)
    outputs = layout.env_outputs(spec, num_envs)
    newest = bool(cfg.backend.get("newest_frames", False)) and stackable(spec)
    sender, receiver = (StackSender(), StackReceiver()) if newest else (None, None)
    first = wire.encode_step(outputs, spec.leaf_keys, sender)  # whole stacks: the stream's first step
    raw = wire.encode_step(outputs, spec.leaf_keys, sender)  # newest frames from here on, where on
    wire.decode_step(wire.parse(wire.ClientMessage, first), num_envs, spec, stacks=receiver)

    def decode():
        wire.decode_step(wire.parse(wire.ClientMessage, raw), num_envs, spec, stacks=receiver)

    how = ", newest frames" if newest else ""
    return {
        f"wire: encode a step ({num_envs} envs{how}, client)": _per_call_us(
            lambda: wire.encode_step(outputs, spec.leaf_keys, sender), 50
        )
        / num_envs,
        f"wire: parse + decode + check{how} (server)": _per_call_us(decode, 50) / num_envs,
    }


def logging_cost(cfg) -> dict:
    """One update's row through the sinks the run has on (logs.csv, TensorBoard), per env step."""
    from torchbeast_hydra.logs.metrics import CsvLog, Stats

    steps = cfg.unroll_length * cfg.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        sinks = [CsvLog(Path(tmp) / "logs.csv", None)] if cfg.logger.csv else []
        if cfg.logger.tensorboard:
            from torchbeast_hydra.logs.tensorboard_log import TensorboardLog

            sinks.append(TensorboardLog(Path(tmp), resume_step=None))
        stats = Stats(0, 10**12, sinks)
        figures = dict(total_loss=1.0, pg_loss=0.1, baseline_loss=0.2, entropy_loss=-0.3, grad_norm=4.0, update_ms=450)
        cost = _per_call_us(lambda: stats.record(steps, [1.0], figures, dict(learner_queue_size=3)), 50)
        stats.close()
    return {"logging a row (csv, TensorBoard)": cost / steps}
