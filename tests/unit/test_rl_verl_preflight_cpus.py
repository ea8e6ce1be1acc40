"""Ray CPUs counted the way Ray counts them (cgroup quota or cpuset, not os.cpu_count()), over fake cgroup files,
checked against Ray 2.60's own function on the same files."""

from __future__ import annotations

import pytest

from stages.core.config.rl_engine import VerlSection
from stages.rl.verl.resources import VerlResourceError, cgroup_cpus, check_ray_cpus, cluster_node_cpus, ray_cpu_count


def _cgroup(root, v1_quota=None, v1_period=None, cpu_max=None, cpuset=None):
    if v1_quota is not None:
        (root / "cpu").mkdir(parents=True, exist_ok=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{v1_quota}\n")
        (root / "cpu" / "cpu.cfs_period_us").write_text(f"{v1_period}\n")
    if cpu_max is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "cpu.max").write_text(f"{cpu_max}\n")
    if cpuset is not None:
        (root / "cpuset").mkdir(parents=True, exist_ok=True)
        (root / "cpuset" / "cpuset.cpus").write_text(f"{cpuset}\n")
    return root


CASES = [  # (cgroup files, Ray's float, what ray.init counts on a 64-core host)
    ({"cpu_max": "400000 100000"}, 4.0, 4),                        # v2: --cpus=4
    ({"cpu_max": "max 100000"}, None, 64),                          # v2 without a quota: the host's cores
    ({"cpu_max": "250000 100000"}, 2.5, 2),                         # fractional: Ray truncates
    ({"v1_quota": 300000, "v1_period": 100000}, 3.0, 3),            # v1 quota
    ({"v1_quota": -1, "v1_period": 100000}, None, 64),              # v1 unlimited
    ({"v1_quota": -1, "v1_period": 100000, "cpuset": "0-5,8"}, 7, 7),  # v1 cpuset only: 6 + 1 ids
    ({"cpu_max": "800000 100000", "cpuset": "0-3"}, 4, 4),          # the smaller of quota and cpuset
    ({}, None, 64),                                                 # no cgroup files
]


@pytest.mark.parametrize(("files", "limit", "count"), CASES)
def test_cpus_as_ray_counts_them(tmp_path, files, limit, count):
    root = _cgroup(tmp_path / "cgroup", **files)
    assert cgroup_cpus(root) == limit
    assert ray_cpu_count(root, cpu_count=64, env={}) == count
    assert ray_cpu_count(root, cpu_count=64, env={"RAY_USE_MULTIPROCESSING_CPU_COUNT": "1"}) == 64


def test_same_answer_as_rays_own_function_on_the_same_files(tmp_path):
    import ray._private.utils as utils  # the main venv has Ray (pyproject)
    for i, (files, _, _) in enumerate(CASES):
        root = _cgroup(tmp_path / f"c{i}", **files)
        ours = cgroup_cpus(root)
        rays = utils._get_docker_cpus(cpu_quota_file_name=str(root / "cpu" / "cpu.cfs_quota_us"),
                                      cpu_period_file_name=str(root / "cpu" / "cpu.cfs_period_us"),
                                      cpuset_file_name=str(root / "cpuset" / "cpuset.cpus"),
                                      cpu_max_file_name=str(root / "cpu.max"))
        assert ours == rays, files


def test_a_container_quota_is_what_the_preflight_checks(tmp_path, monkeypatch):
    """A 64-core host, a pod limited to 6 CPUs: Ray gives verl 6, not 64, and the tiny verl run needs 8."""
    from stages.rl.verl import resources

    root = _cgroup(tmp_path / "cgroup", cpu_max="600000 100000")
    monkeypatch.setattr(resources, "CGROUP", root)
    monkeypatch.setattr(resources.multiprocessing, "cpu_count", lambda: 64)
    monkeypatch.delenv("RAY_USE_MULTIPROCESSING_CPU_COUNT", raising=False)
    tiny = VerlSection(n_gpus_per_node=1, storage_units=1, agent_workers=1, reward_workers=1)
    assert cluster_node_cpus(tiny) == [6.0]
    with pytest.raises(VerlResourceError, match=r"Ray offers 6 CPUs.*rl\.verl\.ray_num_cpus=8"):
        check_ray_cpus(tiny, cluster_node_cpus(tiny))
    # the suggested fix passes, and leaves the unreserved actors their CPUs: 8 = 5 reserved + 3 free
    fixed = tiny.model_copy(update={"ray_num_cpus": 8})
    need = check_ray_cpus(fixed, cluster_node_cpus(fixed))["need"]
    assert need["total"] - need["reserved"] == 3
