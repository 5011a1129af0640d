"""A detached run on Ray (calls/ray_jobs.py): what a job's status says, what address is asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from air_magic.backends.ray import jobs_api
from air_magic.calls import ray_jobs, runners
from air_magic.errors import ConfigurationError
from air_magic.launch.settings import make_settings


@pytest.mark.parametrize(
    ("status", "code", "node", "said"),
    [
        ("PENDING", None, None, "starting"),
        ("RUNNING", None, "n1", "running"),
        ("SUCCEEDED", 0, "n1", "succeeded"),
        ("FAILED", 3, "n1", "failed"),  # a rank failed: result_text.SUPERVISOR_EXIT
        ("FAILED", 4, "n1", "timeout"),
        ("FAILED", 5, "n1", "cancelled"),
        ("FAILED", 6, "n1", "failed"),  # the supervisor failed before the call: its result says why
        ("FAILED", 1, "n1", "lost"),  # Python's own exit on a crash (air_magic missing there, say)
        ("FAILED", -9, "n1", "lost"),  # killed
        ("FAILED", None, "n1", "lost"),  # Ray's job supervisor died
        ("FAILED", None, None, "failed"),  # it never ran (its runtime environment failed)
        ("STOPPED", None, "n1", "cancelled"),
    ],
)
def test_a_jobs_status_and_exit_code_say_how_the_run_ended(status, code, node, said):
    info = SimpleNamespace(status=status, driver_exit_code=code, driver_node_id=node)
    assert ray_jobs.run_status(info) == said


def test_a_result_travels_as_json_and_comes_back_as_a_local_attach_raises_it():
    from air_magic.errors import LaunchError, RankFailedError, RemoteTraceback
    from air_magic.launch.request import RunResult
    from air_magic.outcome import result_text
    from air_magic.protocol.events import Outcome

    done = result_text.from_json(
        result_text.to_json(RunResult("r", "/logs", Outcome.SUCCEEDED, [1, {"a": 2}]))
    )
    assert done.values == [1, {"a": 2}] and done.outcome is Outcome.SUCCEEDED
    error = ValueError("rank 1 hit a bad batch")
    error.air_magic_rank = 1  # type: ignore[attr-defined]
    error.__cause__ = RemoteTraceback("Traceback ...\nValueError: rank 1 hit a bad batch")
    failed = result_text.from_json(result_text.to_json(RunResult("r", "/logs", Outcome.FAILED, error=error)))
    assert isinstance(failed.error, RankFailedError) and failed.error.rank == 1
    assert str(failed.error) == "ValueError: rank 1 hit a bad batch"
    assert "Traceback ..." in str(failed.error.__cause__)
    objects = RunResult("r", "/logs", Outcome.SUCCEEDED, [object()])
    unsent = result_text.from_json(result_text.to_json(objects))
    assert isinstance(unsent.error, LaunchError) and "not plain data" in str(unsent.error)
    stopped = RunResult(
        "r", "/logs", Outcome.INTERRUPTED, error=LaunchError("f was stopped before it finished")
    )
    again = result_text.from_json(result_text.to_json(stopped))
    assert again.outcome is Outcome.INTERRUPTED and str(again.error) == "f was stopped before it finished"


def test_detach_with_a_ray_cluster_is_submitted_as_a_job():
    settings = make_settings(detach=True, cluster="ray=http://127.0.0.1:8265")
    runner = runners.runner_for(settings)
    assert isinstance(runner, runners.RayJob) and runner.address == "http://127.0.0.1:8265"


def test_which_cluster_a_follower_asks(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_jobs.cluster_address(None) is None  # this machine's runs only
    assert ray_jobs.cluster_address("ray=http://h:8265") == "http://h:8265"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # for ray_init: not a dashboard, not asked
    assert ray_jobs.cluster_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "http://env:8265")
    assert ray_jobs.cluster_address(None) == ray_jobs.cluster_address("ray") == "http://env:8265"
    with pytest.raises(ConfigurationError, match="--cluster must be ray"):
        ray_jobs.cluster_address("k8s")


def test_a_job_submitted_with_another_air_magic_fails_before_unpickling_naming_both(monkeypatch):
    from air_magic._version import __version__

    monkeypatch.setenv("AIR_MAGIC_SUBMITTED_WITH", "0.0.1")
    with pytest.raises(
        ConfigurationError, match=rf"submitted with air_magic 0\.0\.1.*has air_magic {__version__}"
    ):
        ray_jobs.take_request("20261205-000000-abcdef")


def test_the_jobs_python_is_python3_unless_told(monkeypatch):
    monkeypatch.delenv("AIR_MAGIC_RAY_JOB_PYTHON", raising=False)
    assert ray_jobs.job_python() == "python3"
    monkeypatch.setenv("AIR_MAGIC_RAY_JOB_PYTHON", "/opt/conda envs/bin/python")
    assert ray_jobs.job_python() == "'/opt/conda envs/bin/python'"


def test_ray_client_addresses_are_refused_for_jobs_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    for given, env in (("ray://head:10001", None), (None, "ray://head:10001")):
        if env is not None:
            monkeypatch.setenv("RAY_ADDRESS", env)
        with pytest.raises(
            ConfigurationError, match=r"dashboard address instead \(cluster='ray=http://HEAD:8265'"
        ):
            jobs_api.client_for(given)


def test_a_ray_client_connection_whose_server_failed_to_start_is_tried_again(capsys, monkeypatch):
    from air_magic.backends.ray import cluster

    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    said = "Initialization failure from server: Starting Ray client server failed"

    class FlakyRay:
        calls = 0

        def init(self, **kwargs):
            self.calls += 1
            if self.calls < 3:
                raise ConnectionAbortedError(said)

    ray = FlakyRay()
    cluster._init(ray, {"address": "ray://head:10001"})
    assert ray.calls == 3 and "attempt 2 of 3" in capsys.readouterr().err
    with pytest.raises(ConnectionAbortedError):  # not a Ray Client address: Ray's error as it is
        cluster._init(FlakyRay(), {"address": "head:6379"})


def test_a_detached_call_given_a_backend_is_still_run_by_its_supervisor():
    """ray_launch(detach=True) hands the driver's call a local backend: the supervisor runs it."""
    from air_magic.backends.local.backend import LocalBackend

    settings = make_settings(detach=True)
    assert isinstance(runners.runner_for(settings, LocalBackend(warm_start=False)), runners.LocalSupervisor)
