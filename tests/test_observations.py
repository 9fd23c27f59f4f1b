"""Any observation space: a Dict/Tuple observation's leaves travel as named arrays, each with its
own dtype and shape, from the env to the learner on both backends; a Box stays one `frame`.

tests/structured_envs.py is a user env nesting every array space (and a Text leaf to leave out).
"""

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchbeast_hydra.agent.encoders import MultiBody, NetHackBody
from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.agent.settings import MultiConfig, NetHackConfig
from torchbeast_hydra.backends import memory
from torchbeast_hydra.backends.mono.backend import BadObservation, ObservationGuard
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.env.spaces import EnvSpec, observation_leaves, probe_env
from torchbeast_hydra.env.vector import Environments
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.run import checkpoint

from helpers import SMALL, TESTS, cli_env_with_path, compose_config, resume_refusal, rows, run_cli
from structured_envs import KEPT, SPACE

STRUCTURED = EnvConfig(id="Structured-v0", imports=["structured_envs"], obs_keys=KEPT)
KEYS = ["obs/image", "obs/inner/0", "obs/inner/1", "obs/inner/2", "obs/position"]  # gymnasium sorts Dict keys


def test_leaves_are_named_by_their_path_each_with_its_own_dtype_and_shape():
    spec = probe_env(STRUCTURED)
    assert list(spec.leaf_keys) == KEYS and not spec.single
    assert [(leaf.shape, leaf.dtype.name) for leaf in spec.leaves] == [
        ((5, 5, 3), "uint8"),
        ((3,), "int8"),
        ((2,), "int64"),
        ((2,), "float32"),
        ((), "int64"),
    ]
    specs = layout.rollout_specs(spec)
    assert "frame" not in specs and specs["obs/inner/0"] == ((3,), torch.int8)
    assert list(specs)[: len(KEYS)] == KEYS  # in the layout's place for the observation, in the space's order


def test_a_box_observation_stays_one_frame():
    spec = probe_env(EnvConfig(id="CartPole-v1"))
    assert spec.single and spec.leaf_keys == ("frame",) and spec.obs_shape == (4,)


def test_a_leaf_that_is_not_an_array_is_refused_naming_it_and_env_obs_keys():
    with pytest.raises(
        ConfigError, match=r"leaf 'note' is a Text.*env\.obs_keys=\[image,inner/0,inner/1,inner/2,position\]"
    ):
        observation_leaves(SPACE, None, "Structured-v0")


def test_obs_keys_select_leaves_by_path_or_subtree_and_unknown_ones_are_refused():
    assert [leaf.key for leaf in observation_leaves(SPACE, ["inner"])] == KEYS[1:4]
    assert [leaf.key for leaf in observation_leaves(SPACE, ["obs/position", "inner/2"])] == KEYS[3:]
    with pytest.raises(ConfigError, match=r"names 'glyphs'.*its leaves: \['image'"):
        observation_leaves(SPACE, ["glyphs"])


def test_environments_write_every_leaf_of_each_env():
    envs = Environments(STRUCTURED, 2, seed=0)
    try:
        envs.initial()
        out = envs.step(np.array([1, 0]))
        assert out["obs/position"].tolist() == [2, 1]
        assert (out["obs/image"][0] == 80).all() and (out["obs/image"][1] == 40).all()
        assert out["obs/inner/0"].tolist() == [[0, 1, 0], [1, 1, 0]]
        assert out["obs/inner/1"].tolist() == [[0, 2], [1, 1]]
        np.testing.assert_allclose(out["obs/inner/2"][0], [2 / 6, -2 / 6])
        # On the wire: one named array per leaf, decoded to the same arrays.
        raw = wire.encode_step(out, envs.spec.leaf_keys)
        decoded = wire.decode_step(wire.parse(wire.ClientMessage, raw), 2, envs.spec)
        assert not wire.parse(wire.ClientMessage, raw).step.HasField("frame")
        for key in KEYS:
            assert decoded[key].dtype == out[key].dtype and (decoded[key] == out[key]).all(), key
    finally:
        envs.close()


def test_multi_body_encodes_each_leaf_and_acts():
    spec = probe_env(STRUCTURED)
    model = make_model(MultiConfig(), spec)
    encoders = {key: type(e).__name__ for key, e in zip(model.body.keys, model.body.encoders)}
    assert encoders == {
        "obs/image": "ImageEncoder",
        "obs/inner/0": "VectorEncoder",
        "obs/inner/1": "DiscreteEncoder",
        "obs/inner/2": "VectorEncoder",
        "obs/position": "DiscreteEncoder",
    }
    inputs = {
        key: torch.from_numpy(np.stack([[leaf.space.sample() for _ in range(2)] for _ in range(3)]))
        for key, leaf in zip(spec.leaf_keys, spec.leaves)
    }
    inputs.update(
        done=torch.zeros(3, 2, dtype=torch.bool), reward=torch.zeros(3, 2), last_action=torch.zeros(3, 2).long()
    )
    outputs, _ = model(inputs)
    assert outputs["policy_logits"].shape == (3, 2, 2) and outputs["action"].shape == (3, 2)
    # A different image gives different features: the image reaches the body.
    changed = dict(inputs, **{"obs/image": inputs["obs/image"] // 2})
    assert not torch.equal(model(changed, action="none")[0]["baseline"], model(inputs, action="none")[0]["baseline"])


def test_code_images_embed_each_channels_code_rather_than_scale_pixels():
    # MiniGrid's view: each cell (object, colour, state), Box(0, 255) of uint8 codes.
    spaces = {"obs/image": gym.spaces.Box(0, 255, (7, 7, 3), np.uint8), "obs/direction": gym.spaces.Discrete(4)}
    body = MultiBody(spaces, code_images=["obs/image"])
    assert type(body.encoders[body.keys.index("obs/image")]).__name__ == "CodeImageEncoder"
    image = torch.zeros(2, 7, 7, 3, dtype=torch.uint8)
    image[1, 3, 3] = torch.tensor([5, 0, 0])  # a key; the same code as a colour means something else
    swapped = torch.zeros_like(image)
    swapped[1, 3, 3] = torch.tensor([0, 5, 0])
    direction = torch.zeros(2, dtype=torch.int64)
    features = body({"obs/image": image, "obs/direction": direction})
    assert not torch.equal(features[0], features[1])
    assert not torch.equal(features[1], body({"obs/image": swapped, "obs/direction": direction})[1])
    with pytest.raises(ValueError, match=r"model.code_images names \['obs/mission'\]"):
        MultiBody(spaces, code_images=["obs/mission"])
    with pytest.raises(ValueError, match=r"takes image leaves .*\['obs/direction'\] are not"):
        MultiBody(spaces, code_images=["obs/direction"])
    for code_images in ([], ["obs/image"]):  # no convs at all: the (embedded) cells, flattened
        flat = MultiBody(spaces, conv_channels=(), code_images=code_images)
        assert flat({"obs/image": image, "obs/direction": direction}).shape == (2, 256)


def test_a_single_array_body_is_refused_for_structured_observations_with_a_hint():
    with pytest.raises(ConfigError, match="takes observations that are one array.*use model=multi"):
        make_model(compose_config(["model=atari_net"]).model, probe_env(STRUCTURED))


NETHACK_SPACES = {
    "obs/glyphs": gym.spaces.Box(0, 5976, (21, 79), np.int16),
    "obs/blstats": gym.spaces.Box(-(2**31), 2**31 - 1, (27,), np.int64),
}


def test_nethack_body_crops_around_the_agent_from_blstats():
    body = NetHackBody(NETHACK_SPACES, crop_size=5)
    glyphs = torch.arange(21 * 79).view(1, 21, 79)
    x, y = torch.tensor([10]), torch.tensor([4])  # blstats[0] is the column, blstats[1] the row
    assert torch.equal(body.crop(glyphs, x, y)[0], glyphs[0, 2:7, 8:13])
    corner = body.crop(glyphs, torch.tensor([0]), torch.tensor([0]))[0]  # beyond the edge: glyph 0
    assert torch.equal(corner[2:, 2:], glyphs[0, :3, :3]) and (corner[:2] == 0).all()
    features = body({"obs/glyphs": glyphs.to(torch.int16), "obs/blstats": torch.zeros(1, 27, dtype=torch.int64)})
    assert features.shape == (1, 512)


def test_nethack_body_without_the_full_map_sees_only_its_crop():
    body = NetHackBody(NETHACK_SPACES, crop_size=5, full_map=False)
    assert body.map_convs is None
    glyphs = torch.randint(1, 5976, (2, 21, 79), dtype=torch.int16)
    blstats = torch.zeros(2, 27, dtype=torch.int64)
    blstats[:, :2] = torch.tensor([10, 4])  # the agent at column 10, row 4: its crop is rows 2-6, columns 8-12
    far = glyphs.clone()
    far[1, 10:, 30:] = 0  # the second map differs only beyond the crop
    features = body({"obs/glyphs": far, "obs/blstats": blstats})
    assert features.shape == (2, 512)
    assert torch.equal(features[1], body({"obs/glyphs": glyphs, "obs/blstats": blstats})[1])
    near = glyphs.clone()
    near[1, 4, 10] = (int(glyphs[1, 4, 10]) + 1) % 5976  # the cell the agent stands on
    assert not torch.equal(features[1], body({"obs/glyphs": near, "obs/blstats": blstats})[1])


def test_nethack_model_needs_glyphs_and_blstats():
    spec = EnvSpec(observation_leaves(gym.spaces.Dict({"glyphs": NETHACK_SPACES["obs/glyphs"]})), 8)
    with pytest.raises(ConfigError, match="needs the leaves obs/glyphs and obs/blstats"):
        make_model(NetHackConfig(), spec)


# A float64 leaf beside an integer one, as a MuJoCo task's observation might come with a mode id.
CONTROL = EnvSpec(
    observation_leaves(
        gym.spaces.Dict({"mode": gym.spaces.Discrete(3), "qpos": gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)})
    ),
    2,
)


def test_a_mono_actor_stops_on_an_observation_the_model_cannot_take_naming_env_leaf_and_value():
    guard = ObservationGuard(CONTROL, "InvertedPendulum-v5", layout.FLOAT32_LIMIT, clip=False)
    outputs = layout.env_outputs(CONTROL, 3)
    outputs["obs/qpos"][1] = [1e30, -1e38, 0, 3.4e38]  # within float32's range: taken
    guard(outputs)
    outputs["obs/qpos"][2, 1] = 1e300  # finite in float64, inf in the model
    with pytest.raises(
        BadObservation,
        match=r"env 2 \(InvertedPendulum-v5\) returned an observation the model cannot take: obs/qpos holds "
        r"1e\+300, beyond \+-3\.403e\+38, the largest the model computes with.* backend\.clip_obs_to_model_range=true",
    ):
        guard(outputs)
    outputs["obs/qpos"][2, 1] = np.nan
    with pytest.raises(BadObservation, match=r"obs/qpos holds nan\. Fix the env") as refused:
        guard(outputs)
    assert "learning_rate" not in str(refused.value)


def test_clip_obs_to_model_range_clips_and_counts_but_nan_still_stops():
    limit = layout.FLOAT32_LIMIT
    guard = ObservationGuard(CONTROL, "InvertedPendulum-v5", limit, clip=True)
    outputs = layout.env_outputs(CONTROL, 3)
    outputs["obs/qpos"][0, 0], outputs["obs/qpos"][0, 1], outputs["obs/qpos"][2, 3] = 1e300, -np.inf, 0.5
    guard(outputs)
    assert outputs["obs/qpos"].tolist() == [[limit, -limit, 0, 0], [0] * 4, [0, 0, 0, 0.5]]
    assert guard.take_clipped() == 1 and guard.take_clipped() == 0  # one env's observation, counted once
    outputs["obs/qpos"][1, 2] = np.nan  # no nearest value to clip to
    with pytest.raises(BadObservation, match="obs/qpos holds nan"):
        guard(outputs)


def test_memory_counts_every_leaf():
    spec = probe_env(STRUCTURED)
    without_image = EnvSpec(tuple(leaf for leaf in spec.leaves if leaf.key != "obs/image"), spec.actions)
    assert memory.step_bytes(spec) - memory.step_bytes(without_image) == 5 * 5 * 3
    assert spec.obs_bytes == 75 + 8 + 3 + 16 + 8


BRIEF = [
    "env.id=Structured-v0",
    "env.imports=[structured_envs]",
    f"env.obs_keys=[{','.join(KEPT)}]",
    "model=multi",
    "total_steps=1280",
    *SMALL,
    "backend.num_actors=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_a_structured_env_trains_checkpoints_and_refuses_a_changed_space_on_resume(tmp_path, backend):
    env = cli_env_with_path(TESTS)
    run_dir = tmp_path / backend
    run_cli(run_dir, *BRIEF, f"backend={backend}", env=env)
    assert int(rows(run_dir)[-1]["step"]) >= 1280
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert list(state["env"]["obs"]) == KEYS and state["env"]["obs"]["obs/inner/0"] == dict(shape=[3], dtype="int8")
    # The same run dir with one leaf fewer: refused, naming the leaf (the resume, in process).
    refusal = resume_refusal(run_dir, *BRIEF[:2], "env.obs_keys=[image,inner]", *BRIEF[3:], f"backend={backend}")
    assert "observation differs at leaf obs/position" in refusal


def test_multi_body_picks_encoders_by_each_leafs_space_at_its_edges():
    spaces = {
        "obs/one": gym.spaces.MultiDiscrete([5]),
        "obs/grid": gym.spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 0], [0, 2]]),
        "obs/depth": gym.spaces.Box(0.0, 1.0, (1, 84, 84), np.float32),  # channels first, one channel
        "obs/pair": gym.spaces.Box(0, 255, (2, 10, 10), np.uint8),
        "obs/stats": gym.spaces.Box(-(2**31), 2**31 - 1, (3,), np.int64),  # NLE's bounds: no real range
        "obs/far": gym.spaces.Box(-np.finfo(np.float32).max, np.finfo(np.float32).max, (2,), np.float32),
    }
    body = MultiBody(spaces)
    encoders = dict(zip(body.keys, body.encoders))
    assert [type(encoders[k]).__name__ for k in body.keys] == [
        "DiscreteEncoder",
        "DiscreteEncoder",
        "ImageEncoder",
        "ImageEncoder",
        "VectorEncoder",
        "VectorEncoder",
    ]
    # Each entry of a 2-D MultiDiscrete has its own rows of the table, from its own start.
    grid = encoders["obs/grid"](torch.tensor([[[1, 0], [0, 2]], [[2, 2], [3, 6]]]))
    assert grid.shape == (2, 4 * 16) and not torch.equal(grid[0], grid[1])
    assert encoders["obs/one"](torch.tensor([[0], [4]])).shape == (2, 16)
    # Counters far inside huge bounds stay apart (scaled by int32's range they were all 0.5).
    stats = encoders["obs/stats"](torch.tensor([[0, 5, 1000], [0, 6, 2000]]))
    assert stats[0, 0] == 0 and stats[0, 1] < stats[1, 1] < stats[0, 2] < stats[1, 2]
    assert torch.isfinite(encoders["obs/far"](torch.tensor([[1e30, -3.0]]))).all()


def test_nethack_body_needs_the_whole_map_to_crop_from():
    crop_only = dict(NETHACK_SPACES, **{"obs/glyphs": gym.spaces.Box(0, 5976, (9, 9), np.int16)})
    with pytest.raises(ValueError, match=r"must be the whole 21x79 map, not \[9, 9\]"):
        NetHackBody(crop_only)
    with pytest.raises(ValueError, match="needs conv_channels"):
        NetHackBody(NETHACK_SPACES, conv_channels=())
