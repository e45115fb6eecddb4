"""``--device``: which names are rejected (and why), and the device a valid one gives."""

from __future__ import annotations

import pytest
import torch

from dkfac.app.devices import device_error, pick_device

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tpu", "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ("meta", "--device must be auto, cpu, cuda or cuda:N, got 'meta'"),
        ("cuda:x", "--device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    ],
)
def test_a_name_that_is_no_cpu_or_cuda_device_is_rejected(name: str, message: str) -> None:
    assert device_error(name) == message
    with pytest.raises(ValueError, match=f"^{message}$"):
        pick_device(name)


@pytest.mark.parametrize("name", ["cpu", "cpu:0"])
def test_a_cpu_name_gives_the_cpu(name: str) -> None:
    assert device_error(name) is None
    assert pick_device(name).type == "cpu"


@pytest.mark.skipif(not NO_CUDA, reason="the answer without a GPU")
def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_error("auto") is None and pick_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        message = f"--device {name}: no CUDA device is available here; use --device cpu or auto"
        assert device_error(name) == message
        with pytest.raises(ValueError, match="no CUDA device is available here"):
            pick_device(name)


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_with_a_gpu_auto_and_cuda_take_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("auto") == pick_device("cuda") == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    assert device_error(f"cuda:{count}") is not None
