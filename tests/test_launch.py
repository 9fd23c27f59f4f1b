"""SLURM launch checks without a cluster: sinfo's answers parsed, requests compared, hopeless pendings."""

import pytest
from omegaconf import OmegaConf

from hydra_plugins.torchbeast_hydra_slurm.launcher import hopeless, sweep_job_ids
from torchbeast_hydra.launch.jobs import LaunchError, SlurmNode, check_fits, gpu_count, minutes, partition_nodes

SINFO = """\
cpu01|cpu*|64|256000|(null)|1-00:00:00
cpu02|cpu*|64|256000|(null)|1-00:00:00
gpu01|gpu|32|512000|gpu:a100:8(S:0-1)|2-00:00:00
gpu02|gpu|16+|128000|gpu:2,mps:100|2-00:00:00
"""


def launcher(**kwargs):
    return OmegaConf.create(
        dict(dict(cpus_per_task=10, tasks_per_node=1, mem_gb=32, gpus_per_node=1, timeout_min=240), **kwargs)
    )


def test_sinfo_fields():
    assert [gpu_count(g) for g in ("(null)", "gpu:4", "gpu:a100:4(S:0-1)", "gpu:2,mps:100")] == [0, 4, 4, 2]
    assert [minutes(t) for t in ("infinite", "30", "30:15", "4:00:00", "1-00:00:00", "2-12")] == [
        None,
        30,
        30.25,
        240,
        1440,
        3600,
    ]
    name, nodes, limit = partition_nodes(SINFO, None)
    assert name == "cpu" and [n.cpus for n in nodes] == [64, 64] and limit == 1440
    name, nodes, limit = partition_nodes(SINFO, "gpu")
    assert [(n.cpus, n.mem_mb, n.gpus) for n in nodes] == [(32, 512000, 8), (16, 128000, 2)] and limit == 2880
    assert partition_nodes(SINFO, "nosuch")[1] == []


def test_requests_that_fit_pass():
    check_fits(launcher(), "gpu", partition_nodes(SINFO, "gpu")[1], 2880)
    check_fits(launcher(gpus_per_node=0, cpus_per_task=64, mem_gb=250), "cpu", partition_nodes(SINFO, "cpu")[1], 1440)


def test_requests_no_node_has_name_the_setting_and_the_partitions_figures():
    nodes = partition_nodes(SINFO, "cpu")[1]
    with pytest.raises(LaunchError) as error:
        check_fits(launcher(), "cpu", nodes, 1440)
    message = str(error.value)
    assert "1 GPU (gpus_per_node)" in message and "partition 'cpu'" in message
    assert "64 CPUs, 250.0 GB, no GPUs" in message and "set hydra.launcher.gpus_per_node=0," in message
    with pytest.raises(LaunchError, match=r"128 CPUs \(cpus_per_task=64 x tasks_per_node=2\).*cpus_per_task=32"):
        check_fits(launcher(gpus_per_node=0, cpus_per_task=64, tasks_per_node=2), "cpu", nodes, 1440)
    with pytest.raises(LaunchError, match=r"300 GB \(mem_gb\).*hydra.launcher.mem_gb=250"):
        check_fits(launcher(gpus_per_node=0, mem_gb=300), "cpu", nodes, 1440)
    # each figure fits some node, but no node has all of them
    nodes = [SlurmNode("x", 16, 128000, 8), SlurmNode("y", 64, 256000, 0)]
    with pytest.raises(LaunchError, match="16 CPUs, 200 GB and 8 GPUs together"):
        check_fits(launcher(gpus_per_node=8, mem_gb=200, cpus_per_task=16), "mixed", nodes, None)


def test_time_limit_above_the_partitions_fails():
    with pytest.raises(LaunchError, match=r"timeout_min=2000 is above .*'cpu'.*1440 min.*timeout_min=1440"):
        check_fits(launcher(gpus_per_node=0, timeout_min=2000), "cpu", partition_nodes(SINFO, "cpu")[1], 1440)


def test_pending_reasons_that_never_clear():
    assert hopeless("12_0|RUNNING|None\n12_1|PENDING|Resources\n13|PENDING|Priority") is None
    assert hopeless("12_0|PENDING|BeginTime\n12_1|PENDING|PartitionConfig") == ("12_1", "PartitionConfig")
    assert hopeless("14|PENDING|DependencyNeverSatisfied") == ("14", "DependencyNeverSatisfied")


def test_sweep_job_ids(tmp_path):
    assert sweep_job_ids(tmp_path / "missing") == []
    for name in ("41", "41_0", "41_1"):
        (tmp_path / name).mkdir()
    assert sweep_job_ids(tmp_path) == ["41_0", "41_1"]
