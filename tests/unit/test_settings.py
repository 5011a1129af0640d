"""The decorator's surface and setting validation (SPEC §2): pure logic, no processes."""

from __future__ import annotations

import argparse
import math
import warnings

import pytest

from air_magic import AcceleratorType, ConfigurationError, DirectCallError, distributed
from air_magic.launch.accelerators import parse_accelerator_type
from air_magic.launch.settings import (
    DEFAULT_TIMEOUT,
    add_arguments,
    help_of,
    make_settings,
    settings_from_args,
)


def train(x, y=2):
    return x + y


def test_bare_and_called_decorator_are_equivalent():
    bare = distributed(train)
    called = distributed()(train)
    assert bare.settings == called.settings
    assert bare.func is train and called.func is train
    assert bare.__name__ == "train"
    assert bare.settings.timeout == DEFAULT_TIMEOUT == 10800


def test_direct_call_says_what_to_use():
    wrapped = distributed(train)
    with pytest.raises(DirectCallError) as info:
        wrapped(1)
    assert "train.distributed(" in str(info.value) and "train.func(" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_func_runs_locally():
    assert distributed(train).func(1) == 3


@pytest.mark.parametrize("value", [True, False, 0, -1, 1.5, "2", "two"])
def test_num_accelerators_rejects(value):
    with pytest.raises(ConfigurationError, match="num_accelerators"):
        distributed(num_accelerators=value)


@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -math.inf, 0, -5, "60", [1]])
def test_timeout_rejects(value):
    with pytest.raises(ConfigurationError, match="timeout"):
        distributed(timeout=value)


@pytest.mark.parametrize("value", [1, 2.5, 10800, None])
def test_timeout_accepts(value):
    assert distributed(timeout=value)(train).settings.timeout == (None if value is None else float(value))


def test_with_overrides_returns_a_new_wrapper():
    base = distributed(num_accelerators=2, timeout=30)(train)
    changed = base.with_overrides(num_accelerators=3)
    assert changed.settings.num_accelerators == 3 and changed.settings.timeout == 30
    assert base.settings.num_accelerators == 2
    assert changed.func is train
    with pytest.raises(ConfigurationError, match="timeout"):
        base.with_overrides(timeout=0)
    with pytest.raises(ConfigurationError, match="unknown setting"):
        base.with_overrides(nonsense=1)


def test_legacy_names_warn_once_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = distributed(gpus=2, gpu_type="H100")(train)  # the line the warning must name
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 1
    assert future[0].filename == __file__
    text = str(future[0].message)
    assert "gpus= -> num_accelerators=" in text and "gpu_type= -> accelerator_type=" in text
    assert "'GPU_2xH100'" in text  # the model it named, with the count it was given
    assert wrapped.settings.num_accelerators == 2
    assert wrapped.settings.accelerator_type.model == "H100"


@pytest.mark.parametrize("legacy", ["A10", "a10g", "H100", "h100_80gb", "B300", "b300", "h100"])
def test_legacy_type_values_warn(legacy):
    with pytest.warns(FutureWarning, match="legacy"):
        distributed(accelerator_type=legacy)


def test_mixing_old_and_new_names_is_an_error():
    with pytest.raises(ConfigurationError, match="gpus"):
        distributed(num_accelerators=2, gpus=2)
    with pytest.raises(ConfigurationError, match="gpu_type"):
        distributed(accelerator_type="GPU_1xA10", gpu_type="A10")


def test_run_id_is_the_former_name_of_mlflow_run_id():
    new = distributed(mlflow_run_id="0123abcd")(train)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a former name, not a legacy one: no warning
        old = distributed(run_id="0123abcd")(train)
    assert new.settings == old.settings and old.settings.mlflow_run_id == "0123abcd"
    assert old.settings.run_id == "0123abcd"  # the read-only property, for code that reads it
    with pytest.raises(AttributeError):
        old.settings.run_id = "other"
    assert (
        make_settings(run_id="a")
        == make_settings(mlflow_run_id="a")
        == make_settings(run_id="a", mlflow_run_id="a")
    )
    assert new.with_overrides(run_id="b").settings.mlflow_run_id == "b"  # an override in either name
    assert old.with_overrides(mlflow_run_id="b").settings.mlflow_run_id == "b"
    assert old.with_overrides(run_id=None).settings.mlflow_run_id is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flag in ("--mlflow-run-id", "--run-id"):
        given = settings_from_args(parser.parse_args([flag, "0123abcd"]))
        assert make_settings(**given) == new.settings, flag
    assert "--run-id is its former name" in help_of("mlflow_run_id")


def test_run_id_and_mlflow_run_id_that_differ_are_an_error():
    both = r"both run_id='a' \(--run-id\) and mlflow_run_id='b'.*former"
    with pytest.raises(ConfigurationError, match=both):
        distributed(run_id="a", mlflow_run_id="b")
    with pytest.raises(ConfigurationError, match="former name of mlflow_run_id"):
        distributed(mlflow_run_id="a")(train).with_overrides(run_id="b", mlflow_run_id="c")
    with pytest.raises(ConfigurationError, match="mlflow_run_id must be an MLflow run id"):
        distributed(run_id="has space")


def test_with_overrides_accepts_legacy_names_with_a_warning():
    base = distributed(num_accelerators=2)(train)
    with pytest.warns(FutureWarning):
        assert base.with_overrides(gpus=4).settings.num_accelerators == 4


@pytest.mark.parametrize(
    ("text", "count", "model"),
    [
        ("GPU_1xA10", 1, "A10"),
        ("GPU_1xH100", 1, "H100"),
        ("GPU_8xH100", 8, "H100"),
        ("GPU_8xB300", 8, "B300"),
        ("GPU_2xH200", 2, "H200"),
        ("gpu_4xa100", 4, "A100"),
        ("GPU_1xL4", 1, "L4"),
    ],
)
def test_accelerator_type_general_form(text, count, model):
    spec = parse_accelerator_type(text)
    assert (spec.count, spec.model, spec.legacy) == (count, model, False)


@pytest.mark.parametrize("text", ["", "H200x2", "GPU_0xH100", "GPU_xH100", "TPU_8xV5"])
def test_accelerator_type_rejects(text):
    with pytest.raises(ConfigurationError, match="GPU_<count>x<MODEL>"):
        distributed(accelerator_type=text)


def test_accelerator_type_enum_is_a_string():
    assert AcceleratorType.GPU_8xH100 == "GPU_8xH100"
    assert {t.value for t in AcceleratorType} == {"GPU_1xA10", "GPU_1xH100", "GPU_8xH100", "GPU_8xB300"}
    assert (
        distributed(accelerator_type=AcceleratorType.GPU_1xA10)(train).settings.accelerator_type.model
        == "A10"
    )


def test_other_settings_are_checked():
    with pytest.raises(ConfigurationError, match="display"):
        distributed(display="fancy")
    with pytest.raises(ConfigurationError, match="env"):
        distributed(env={"A": 1})
    with pytest.raises(ConfigurationError, match="max_payload_bytes"):
        distributed(max_payload_bytes=0)


def test_stop_grace_defaults_to_torchruns_variable_then_30_seconds(monkeypatch):
    from air_magic.launch.settings import make_settings, stop_grace_s

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert stop_grace_s(make_settings().stop_grace) == 30.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert stop_grace_s(make_settings().stop_grace) == 7.0
    assert stop_grace_s(make_settings(stop_grace=0).stop_grace) == 0.0  # the setting wins
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    assert stop_grace_s(None) == 30.0
    for bad in (-1, float("nan"), "5", True):
        with pytest.raises(ConfigurationError, match="stop_grace"):
            make_settings(stop_grace=bad)


def test_run_id_and_mlflow_run_id_flags_that_differ_are_an_error():
    """On a command line too (the CLI, ``%%distributed``, ``session start``): argparse keeps the last."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for line in (
        ["--run-id", "aaaa", "--mlflow-run-id", "bbbb"],
        ["--mlflow-run-id", "bbbb", "--run-id", "aaaa"],
    ):
        given = settings_from_args(parser.parse_args(line))
        with pytest.raises(ConfigurationError, match="former name of mlflow_run_id"):
            make_settings(**given)
    same = settings_from_args(parser.parse_args(["--run-id", "aaaa", "--mlflow-run-id", "aaaa"]))
    assert make_settings(**same).mlflow_run_id == "aaaa"


def test_the_former_run_id_keyword_still_builds_a_run_info_and_a_run_result():
    from air_magic.calls.history import RunInfo
    from air_magic.launch.request import RunResult
    from air_magic.protocol.events import Outcome

    info = RunInfo(run_id="call-1", name="train", world_size=2, log_dir="/tmp/x")
    assert info == RunInfo("call-1", "train", 2, "/tmp/x") and info.run_id == "call-1"
    result = RunResult(run_id="call-2", log_dir="", outcome=Outcome.SUCCEEDED, values=[1])
    assert result.call_id == result.run_id == "call-2"
    with pytest.raises(TypeError, match="run_id is the former name of call_id"):
        RunInfo(run_id="a", call_id="b", name="", world_size=1, log_dir="")


@pytest.mark.parametrize("name", ["", "A=B", "A\0B"])
def test_an_env_name_no_environment_can_hold_is_refused_before_any_rank(name):
    with pytest.raises(ConfigurationError, match="cannot be an environment variable's name"):
        make_settings(env={name: "1"})
    with pytest.raises(ConfigurationError, match="holds a NUL"):
        make_settings(env={"GOOD": "a\0b"})


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "MASTER_PORT", "AIR_MAGIC_RUN_ID"])
def test_env_cannot_give_a_rank_another_place(name):
    with pytest.raises(ConfigurationError, match=f"env: {name} is set by air_magic for each rank"):
        make_settings(env={name: "3"})
    assert make_settings(env={"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"}).env["OMP_NUM_THREADS"] == "4"


def test_a_run_id_to_record_into_with_tracking_off_is_an_error():
    """Issue 49 (second probe): ``--mlflow-run-id X --no-tracking`` dropped the id without a word."""
    with pytest.raises(ConfigurationError, match=r"--mlflow-run-id\) names the MLflow run.*--no-tracking"):
        make_settings(mlflow_run_id="0123abcd", tracking=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = settings_from_args(parser.parse_args(["--mlflow-run-id", "0123abcd", "--no-tracking"]))
    with pytest.raises(ConfigurationError, match="give one of the two"):
        make_settings(**given)
    assert make_settings(mlflow_run_id=None, tracking=False).tracking is False
