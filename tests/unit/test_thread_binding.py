"""omp_threads_bind: which CPUs the engine's OpenMP threads are pinned to, and when none."""

from __future__ import annotations

import pytest

from backend import thread_binding
from backend.config import EngineConfig


def fake_sysfs(tmp_path, cores: dict[int, tuple[int, int]]):
    """cpu -> (package, core) under tmp_path, as /sys/devices/system/cpu lays it out."""
    for cpu, (package, core) in cores.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


@pytest.mark.parametrize("spec", ["auto", "nobind", "0", "0-3", "0,2,4,6", "0-1,4-5"])
def test_valid_specs_are_accepted(spec):
    assert thread_binding.check_spec(spec) is None
    assert EngineConfig(model_path="/m", omp_threads_bind=spec).omp_threads_bind == spec


@pytest.mark.parametrize("spec", ["", "yes", "0-", "0,,1", "-1", "0 1", "AUTO"])
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError, match=r"omp_threads_bind=.* must be \"auto\", \"nobind\" or a CPU list"):
        EngineConfig(model_path="/m", omp_threads_bind=spec)
    with pytest.raises(ValueError, match="omp_threads_bind"):
        EngineConfig.from_parameters({"omp_threads_bind": spec or "bad"}, "/m")


def test_cpu_lists_expand_ranges_in_order():
    assert thread_binding.parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ValueError, match="runs backwards"):
        thread_binding.parse_cpu_list("3-1")


def test_hyperthreads_count_once_per_core(tmp_path):
    # Linux numbers a core's second hyperthread after every core's first: cpu 2 shares core 0.
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0), 5: (1, 0)})
    assert thread_binding.first_cpu_of_each_core({0, 1, 2, 3, 4, 5}, sysfs) == [0, 1, 4]
    assert thread_binding.first_cpu_of_each_core({2, 3}, sysfs) == [2, 3]
    # Where sysfs says nothing, every CPU is a core of its own.
    assert thread_binding.first_cpu_of_each_core({7, 9}, sysfs) == [7, 9]


def test_auto_binds_only_a_team_with_one_thread_per_core(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert thread_binding.resolve("auto", 2, {0, 1, 2, 3}, sysfs) == [0, 1]
    assert thread_binding.resolve("auto", 1, {0, 1, 2, 3}, sysfs) is None  # one thread: nothing to keep apart
    assert thread_binding.resolve("auto", 1, {0}, sysfs) is None
    assert thread_binding.resolve("auto", 4, {0, 1, 2, 3}, sysfs) is None  # hyperthreads in the team
    assert thread_binding.resolve("auto", 2, {0, 1, 2, 3, 4, 5}, str(tmp_path / "none")) is None
    assert thread_binding.resolve("nobind", 2, {0, 1}, sysfs) is None


def test_an_explicit_list_must_fit_the_team_and_the_process():
    assert thread_binding.resolve("3,1", 2, {0, 1, 2, 3}) == [3, 1]
    with pytest.raises(ValueError, match=r"omp_threads_bind='0-2' names 3 CPU\(s\), but the engine runs 2 OpenMP"):
        thread_binding.resolve("0-2", 2, {0, 1, 2, 3})
    with pytest.raises(ValueError, match="names a CPU twice"):
        thread_binding.resolve("1,1", 2, {0, 1})
    with pytest.raises(ValueError, match=r"CPU\(s\) \[5\] are not among this process's CPUs \[0, 1\]"):
        thread_binding.resolve("0,5", 2, {0, 1})
