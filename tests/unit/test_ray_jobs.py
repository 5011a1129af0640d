"""A detached run on Ray (calls/ray_jobs.py): what a job's status says, what address is asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from air_magic.backends.ray import jobs_api
from air_magic.calls import ray_jobs
from air_magic.calls.call import backend_for
from air_magic.errors import ConfigurationError
from air_magic.launch.settings import make_settings


@pytest.mark.parametrize(
    ("status", "code", "said"),
    [
        ("PENDING", None, "starting"),
        ("RUNNING", None, "running"),
        ("SUCCEEDED", 0, "succeeded"),
        ("FAILED", 3, "failed"),  # a rank failed: supervisor.EXIT_STATUS
        ("FAILED", 4, "timeout"),
        ("FAILED", 5, "cancelled"),
        ("FAILED", 1, "failed"),  # the supervisor failed before the call: its result says why
        ("FAILED", 137, "lost"),  # killed
        ("FAILED", None, "lost"),  # Ray's job supervisor died
        ("STOPPED", None, "cancelled"),
    ],
)
def test_a_jobs_status_and_exit_code_say_how_the_run_ended(status, code, said):
    assert ray_jobs.run_status(SimpleNamespace(status=status, driver_exit_code=code)) == said


def test_detach_with_a_ray_cluster_is_submitted_as_a_job():
    settings = make_settings(detach=True, cluster="ray=http://127.0.0.1:8265")
    backend = backend_for(settings)
    assert isinstance(backend, ray_jobs.JobSubmitter) and backend.address == "http://127.0.0.1:8265"


def test_a_ray_client_address_is_refused_with_what_to_use_instead():
    with pytest.raises(ConfigurationError, match=r"dashboard address instead \(http://HEAD:8265"):
        jobs_api.client_for("ray://127.0.0.1:10001")


def test_which_cluster_a_follower_asks(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_jobs.cluster_address(None) is None  # this machine's runs only
    assert ray_jobs.cluster_address("ray=http://h:8265") == "http://h:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://env:8265")
    assert ray_jobs.cluster_address(None) == ray_jobs.cluster_address("ray") == "http://env:8265"
    with pytest.raises(ConfigurationError, match="--cluster must be ray"):
        ray_jobs.cluster_address("k8s")
