"""Accelerator detection and planning (SPEC §3).

This machine has no GPU, so GPU lists are built by hand here; the real NVML
path runs on the device (tests/gpu). Detection itself runs for real: it must
find no GPU here and must not import torch or create a CUDA context.
"""

from __future__ import annotations

import pytest

from air_magic.errors import AcceleratorError, ConfigurationError
from air_magic.launch.accelerators import (
    GPU,
    apply_visible_devices,
    detect_gpus,
    parse_accelerator_type,
    plan_accelerators,
)

H200 = [GPU(i, f"GPU-{i}aaaa-0000", "NVIDIA H200") for i in range(2)]
A10G = [GPU(0, "GPU-a10g", "NVIDIA A10G")]


def test_force_cpu(monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_FORCE_CPU", "1")
    assert detect_gpus() == []


def test_cpu_mode_defaults_to_two_ranks(monkeypatch):
    monkeypatch.delenv("AIR_MAGIC_CPU_RANKS", raising=False)
    plan = plan_accelerators(None, None, gpus=[])
    assert (plan.world_size, plan.cpu_mode, plan.backend) == (2, True, "gloo")
    assert plan_accelerators(5, None, gpus=[]).world_size == 5
    monkeypatch.setenv("AIR_MAGIC_CPU_RANKS", "3")
    assert plan_accelerators(None, None, gpus=[]).world_size == 3
    monkeypatch.setenv("AIR_MAGIC_CPU_RANKS", "zero")
    with pytest.raises(ConfigurationError, match="AIR_MAGIC_CPU_RANKS"):
        plan_accelerators(None, None, gpus=[])


def test_gpu_type_on_a_cpu_machine_names_what_was_detected():
    with pytest.raises(AcceleratorError, match="no NVIDIA GPU"):
        plan_accelerators(None, parse_accelerator_type("GPU_1xH100"), gpus=[])


def test_default_uses_every_visible_gpu():
    plan = plan_accelerators(None, None, gpus=H200)
    assert (plan.world_size, plan.backend, plan.detected) == (2, "nccl", "GPU_2xH200")


def test_subset_uses_the_first_devices():
    plan = plan_accelerators(1, None, gpus=H200)
    assert plan.gpus == (H200[0],)


def test_more_than_visible_names_the_visible_ones():
    with pytest.raises(AcceleratorError, match=r"num_accelerators=4 but only 2 GPU\(s\) are visible.*H200"):
        plan_accelerators(4, None, gpus=H200)


def test_type_mismatch_names_the_detected_type():
    with pytest.raises(AcceleratorError, match=r"GPU_8xH100 was asked for.*GPU_2xH200"):
        plan_accelerators(None, parse_accelerator_type("GPU_8xH100"), gpus=H200)
    with pytest.raises(AcceleratorError, match="needs 4 GPUs"):
        plan_accelerators(None, parse_accelerator_type("GPU_4xH200"), gpus=H200)


def test_type_count_sets_the_default_ranks():
    assert plan_accelerators(None, parse_accelerator_type("GPU_1xH200"), gpus=H200).world_size == 1


def test_legacy_type_matches_the_model_only():
    with pytest.warns(FutureWarning):
        from air_magic.launch.settings import make_settings

        spec = make_settings(accelerator_type="a10g").accelerator_type
    assert plan_accelerators(None, spec, gpus=A10G).world_size == 1  # NVML says 'A10G'; the seed says A10


def test_cuda_visible_devices_by_index_and_uuid():
    four = [GPU(i, f"GPU-{i}{i}{i}-x", "NVIDIA H200") for i in range(4)]
    assert apply_visible_devices(four, None) == four
    assert [g.index for g in apply_visible_devices(four, "2,0")] == [2, 0]
    assert [g.index for g in apply_visible_devices(four, "GPU-333,1")] == [3, 1]
    assert apply_visible_devices(four, "") == []
    assert [g.index for g in apply_visible_devices(four, "1,9,2")] == [1]  # CUDA stops at a bad entry


def test_ranks_get_gpu_indices_in_pci_order_and_mig_uuids():
    """Indices, not UUIDs: DeepSpeed parses CUDA_VISIBLE_DEVICES as integers (found on 2xH200)."""
    from air_magic.launch.accelerators import AcceleratorPlan
    from air_magic.launch.rank_env import RankPlace, rank_environment

    def env_for(gpus):
        plan = AcceleratorPlan(world_size=len(gpus), gpus=tuple(gpus), detected="test")
        return rank_environment(
            place=RankPlace.on_one_node(0, len(gpus)),
            plan=plan,
            master_addr="127.0.0.1",
            master_port=1,
            call_id="r",
            call_dir="/d",
            log_dir="/l",
            lifeline_fd=3,
            extra={},
            base={},
        )

    picked = [GPU(2, "GPU-2222-x", "NVIDIA H200"), GPU(3, "GPU-3333-x", "NVIDIA H200")]
    env = env_for(picked)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # so CUDA counts as NVML does
    assert env_for([GPU(0, "MIG-abcd", "NVIDIA A100")])["CUDA_VISIBLE_DEVICES"] == "MIG-abcd"
