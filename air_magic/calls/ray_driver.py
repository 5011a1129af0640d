"""``ray_launch``: the function runs once, as a Ray driver, in a fresh process connected to the cluster.

For code that uses Ray itself (Ray Train, Ray Data, Tune): air_magic does not
place ranks; it checks that the cluster has the accelerators asked for (before
anything starts, listing the cluster when it does not), then runs the function
as a one-rank local call whose process has ``RAY_ADDRESS`` set to the cluster,
so its ``ray.init()`` (or the first Ray call) joins it. The reservation that
``cluster="ray"`` calls keep between calls is given back first. The rank sees no GPU of
this machine: the cluster's GPUs are for the work it submits. Tab, errors,
interrupt, timeout and MLflow run are those of any call; the result is ``[result]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from air_magic.backends.local.backend import LocalBackend
from air_magic.backends.ray import cluster, placement
from air_magic.calls.call import run_call
from air_magic.launch.request import RunResult
from air_magic.launch.settings import LaunchSettings, make_settings
from air_magic.protocol import env_names


def run_as_driver(
    name: str, func: Callable[..., Any], bound: inspect.BoundArguments, settings: LaunchSettings
) -> RunResult:
    """Check the cluster can hold the request, then run ``func`` once as a driver of it."""
    address = None
    if settings.cluster is not None:
        _, _, address = settings.cluster.partition("=")
    ray = cluster.require_ray()
    if not ray.is_initialized():
        cluster.ray_init(address or None)
    elif address:
        cluster.check_address(address)
    # The agents of an earlier cluster='ray' call hold their GPUs for the next call; the driver's
    # own work needs them now.
    placement.release_all()
    here = ray.get_runtime_context().get_node_id()
    placement.plan_shape(ray.nodes(), settings.num_accelerators, settings.accelerator_type, here)
    info = cluster.cluster_info()
    env = {
        **settings.env,
        env_names.RAY_ADDRESS: info.address,
        "CUDA_VISIBLE_DEVICES": "",  # the driver uses none of this machine's GPUs; its tasks get theirs
    }
    driver = make_settings(
        {k: v for k, v in settings.raw.items() if k not in ("gpus", "gpu_type")},
        num_accelerators=1,
        accelerator_type=None,
        cluster=None,
        env=env,
    )
    return run_call(name, func, bound, driver, kind="ray driver", backend=LocalBackend(driver.warm_start))
