import time

import pytest
import torch

from course_lib.runtime import DeviceError, default_dtype, resolve_device, seed_everything, stopwatch, time_it


@pytest.mark.parametrize("request_", ["cpu", "CPU", " cpu "])
def test_cpu_is_always_available(request_):
    assert resolve_device(request_) == torch.device("cpu")


def test_auto_prefers_cuda_then_cpu():
    expected = "cuda" if torch.cuda.is_available() else None
    got = resolve_device("auto").type
    assert got == expected if expected else got in ("cpu", "mps")


def test_environment_variable_overrides(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert resolve_device() == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu", "", "cpu:0:1", 3])
def test_invalid_device_string_is_a_clear_error(bad):
    with pytest.raises(DeviceError, match="device"):
        resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("want", ["cuda", "cuda:0"])
def test_cuda_requested_without_gpu_says_so(want):
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        resolve_device(want)


def test_bad_device_from_environment_is_reported(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "quantum")
    with pytest.raises(DeviceError, match="COURSE_DEVICE"):
        resolve_device()


def test_default_dtypes():
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    assert default_dtype(torch.device("cpu"), "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        default_dtype(torch.device("cpu"), "float8")


def test_seed_makes_draws_repeatable():
    seed_everything(7)
    a = torch.rand(5)
    seed_everything(7)
    assert torch.equal(a, torch.rand(5))


def test_timing_records_every_repeat():
    calls = []
    timing = time_it(lambda: calls.append(1), "cpu", label="noop", repeats=4, warmup=2)
    assert len(calls) == 6 and len(timing.seconds) == 4
    assert 0 <= timing.best <= timing.mean
    slow = time_it(lambda: time.sleep(0.02), "cpu", repeats=2, warmup=0)
    assert 0.015 < slow.best < 1.0  # it measures the work, in seconds
    with stopwatch("cpu") as t:
        time.sleep(0.02)
    assert 0.015 < t["seconds"] < 1.0


def test_a_cpu_lesson_says_why_it_leaves_the_gpu(monkeypatch, capsys):
    import torch
    from course_lib import runtime
    monkeypatch.setattr(runtime, "resolve_device", lambda request=None: torch.device("cuda"))
    assert runtime.cpu_lesson("the 4-bit kernel is a CPU kernel") == "cpu"
    assert "runs on the CPU, not on cuda: the 4-bit kernel is a CPU kernel" in capsys.readouterr().out
    monkeypatch.setattr(runtime, "resolve_device", lambda request=None: torch.device("cpu"))
    assert runtime.cpu_lesson("anything") == "cpu"
    assert capsys.readouterr().out == ""  # on the CPU already: nothing to say


def test_progress_yields_every_item_in_order(capsys, monkeypatch):
    from course_lib.runtime import progress
    monkeypatch.delenv("COURSE_PROGRESS", raising=False)
    assert list(progress(range(5), "steps")) == [0, 1, 2, 3, 4]
    assert "steps" in capsys.readouterr().err  # a bar was drawn (a text one, outside Jupyter)
    monkeypatch.setenv("COURSE_PROGRESS", "0")
    items = [1, 2]
    assert progress(items, "off") is items
    assert list(progress((x for x in "abc"), "letters", total=3)) == ["a", "b", "c"]  # a generator, with its length
