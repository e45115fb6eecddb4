"""Byte-level text of the language-model task: windows, split, files, errors, per-byte loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from dkfac.app.cli import main
from dkfac.app.data import DataError, load_dataset
from dkfac.app.report import bits_per_byte, read_metrics
from dkfac.app.text import default_text_path, load_text, read_text_bytes, text_files


def _pseudo_text(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), generator=g).tolist())


@pytest.fixture
def text_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = _pseudo_text(1000)
    path = tmp_path / "tiny.bin"
    path.write_bytes(data)
    return path, data


def test_windows_are_the_file_bytes(text_file: tuple[Path, bytes]) -> None:
    path, data = text_file
    seq = 8
    splits = load_text(path, seq_len=seq, max_bytes=10_000)
    cut = 1000 - max(seq + 1, math.ceil(1000 * 0.1))  # = 900: the last 10 % validate
    assert cut == 900
    assert len(splits.x_train) == cut - seq  # every start whose seq+1 bytes fit before the cut
    for i in range(len(splits.x_train)):
        assert bytes(splits.x_train[i].tolist()) == data[i : i + seq]
        assert bytes(splits.y_train[i].tolist()) == data[i + 1 : i + seq + 1]
    assert len(splits.x_test) == (1000 - cut - 1) // seq == 12
    for j in range(len(splits.x_test)):
        start = cut + j * seq  # non-overlapping: each validation byte is a target once
        assert bytes(splits.x_test[j].tolist()) == data[start : start + seq]
        assert bytes(splits.y_test[j].tolist()) == data[start + 1 : start + seq + 1]
    assert splits.x_train.dtype == torch.int64
    assert (splits.num_classes, splits.image_size, splits.name) == (256, seq, "text")


def test_split_is_deterministic_and_disjoint(text_file: tuple[Path, bytes]) -> None:
    path, data = text_file
    a = load_text(path, seq_len=8)
    b = load_dataset("text", text_path=path, seq_len=8)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    # The last training target is byte 899, the first validation input byte 900.
    assert bytes(a.y_train[-1].tolist())[-1] == data[899]
    assert bytes(a.x_test[0].tolist())[0] == data[900]
    train_positions = set(range(900))
    val_positions = {900 + j * 8 + k for j in range(len(a.x_test)) for k in range(9)}
    assert not train_positions & val_positions


def test_byte_cap_and_folder_order(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(b"BBBB")
    (tmp_path / "a.py").write_bytes(b"AA")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_bytes(b"CCC")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    for skipped in (".hidden", "site-packages"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_bytes(b"XXXX")
    assert [p.relative_to(tmp_path).as_posix() for p in text_files(tmp_path)] == [
        "a.py",
        "b.py",
        "sub/c.py",
    ]
    assert read_text_bytes(tmp_path, 100) == b"AABBBBCCC"
    assert read_text_bytes(tmp_path, 5) == b"AABBB"
    assert read_text_bytes(tmp_path, 100, "*.txt") == b"not python"


def test_default_text_is_the_standard_library() -> None:
    root = default_text_path()
    files = text_files(root)
    assert root / "os.py" in files
    assert not any("site-packages" in p.parts for p in files)
    assert read_text_bytes(root, 64) == read_text_bytes(root, 100)[:64]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: tmp, "no file matching '*.py'"),
    ],
)
def test_bad_paths_raise(make: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="--text-path .*" + message.replace("*", r"\*")):
        load_text(make(tmp_path), seq_len=4)  # type: ignore[operator]


def test_too_little_text_raises(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_bytes(b"x" * 16)
    with pytest.raises(DataError, match="16 bytes; --seq-len 8 needs at least 18"):
        load_text(tmp_path / "short.txt", seq_len=8)
    exact = load_text(tmp_path / "short.txt", seq_len=7)  # one window of 8 bytes in each split
    assert (len(exact.x_train), len(exact.x_test)) == (1, 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--text-path", "/nonexistent/text"], "--text-path /nonexistent/text does not exist"),
        (["--text-path", "EMPTY"], "no file matching '*.py'"),
        (["--seq-len", "600"], "needs at least 1202"),
    ],
)
def test_bad_text_exits_2_with_one_line(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "t.txt").write_bytes(b"y" * 1000)
    extra = [str(tmp_path / "empty") if e == "EMPTY" else e for e in extra]
    if "--text-path" not in extra:
        extra += ["--text-path", str(tmp_path / "t.txt")]
    argv = ["train", "--model", "gpt", "--data", "text", "--out", str(tmp_path / "run"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dkfac train: error:")
    assert message in err


class ConstantLogits(nn.Module):
    """The same logits ``c`` at every position; its one parameter never changes them."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.register_buffer("c", torch.arange(num_classes, dtype=torch.float32) / 40.0)
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.c.expand(*tokens.shape, -1)
        return logits + 0.0 * self.unused


def constant_logits(num_classes: int) -> nn.Module:
    return ConstantLogits(num_classes)


def test_loss_is_nats_per_byte_and_bits_are_loss_over_ln2(
    text_file: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = text_file
    argv = ["train", "--model", f"{__name__}:constant_logits", "--data", "text"]
    argv += ["--text-path", str(path), "--seq-len", "8", "--steps", "1", "--optimizer", "sgd"]
    argv += ["--batch-size", "4", "--weight-decay", "0", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    final = [r for r in records if r["kind"] == "eval"][-1]
    # By hand: the validation targets are bytes 901 .. 900 + 8 * 12 (12 whole windows).
    c = torch.arange(256, dtype=torch.float64) / 40.0
    targets = torch.tensor(list(data[901 : 901 + 96]))
    nats = float((torch.logsumexp(c, 0) - c[targets]).mean())
    assert final["loss"] == pytest.approx(nats, rel=1e-6)
    assert final["bits_per_byte"] == pytest.approx(nats / math.log(2), rel=1e-6)
    assert final["accuracy"] == pytest.approx(float((targets == 255).double().mean()))
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)
    assert all(r["bits_per_byte"] == bits_per_byte(r["loss"]) for r in records)
