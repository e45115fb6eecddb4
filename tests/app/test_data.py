"""Tests of dkfac.app.data and dkfac.app.cifar: exact round trips, hostile files, sharding."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from dkfac.app.cifar import CIFAR10, CIFAR100, CifarArrays, RestrictedUnpickler, parse_batch
from dkfac.app.data import (
    DataError,
    batches,
    load_cifar,
    load_dataset,
    load_digits,
    random_crop_flip,
    read_cifar,
    shard_indices,
    synthetic,
    write_cifar_archive,
)

# ----------------------------------------------------------------------------- digits


def test_digits_shapes_and_normalization() -> None:
    s = load_digits(test_fraction=0.2, seed=0)
    assert (s.name, s.in_channels, s.image_size, s.num_classes) == ("digits", 1, 8, 10)
    assert s.x_train.shape == (1437, 1, 8, 8) and s.x_test.shape == (360, 1, 8, 8)
    assert s.x_train.dtype == torch.float32 and s.y_train.dtype == torch.int64
    assert abs(s.x_train.double().mean().item()) < 1e-6
    assert abs(s.x_train.double().std(unbiased=False).item() - 1.0) < 1e-6
    raw = load_digits(test_fraction=0.2, seed=0, normalize=False)
    assert raw.mean == () and raw.std == ()
    mean = raw.x_train.double().mean().item()
    std = raw.x_train.double().std(unbiased=False).item()
    assert s.mean == pytest.approx((mean,)) and s.std == pytest.approx((std,))
    torch.testing.assert_close(s.x_test, ((raw.x_test.double() - mean) / std).float())
    assert torch.equal(s.y_test, raw.y_test)


def test_digits_split_is_exact_stratified_partition() -> None:
    from sklearn.datasets import load_digits as sk_load_digits

    s = load_digits(test_fraction=0.2, seed=0, normalize=False)
    ref = sk_load_digits()
    pixels = torch.cat([s.x_train, s.x_test]).reshape(-1, 64) * 16
    assert torch.equal(pixels, pixels.round())  # values are exactly k / 16
    rows = sorted(
        (*p, int(y))
        for p, y in zip(pixels.long().tolist(), torch.cat([s.y_train, s.y_test]), strict=True)
    )
    expected = sorted(
        (*p, int(y)) for p, y in zip(ref.data.astype(int).tolist(), ref.target, strict=True)
    )
    assert rows == expected
    counts = np.bincount(ref.target, minlength=10)
    test_counts = np.bincount(s.y_test.numpy(), minlength=10)
    assert np.all(np.abs(test_counts - 0.2 * counts) <= 1)


def test_digits_seeding() -> None:
    a, b, c = load_digits(seed=1), load_digits(seed=1), load_digits(seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.y_test, c.y_test)
    with pytest.raises(DataError, match=r"test_fraction"):
        load_digits(test_fraction=1.0)


# ------------------------------------------------------------------------------ CIFAR


def layout_of(num_classes: int) -> tuple[str, str, list[str]]:
    lay = CIFAR10 if num_classes == 10 else CIFAR100
    return lay.archive, lay.folder, [*lay.train, lay.test]


def make_archive(tmp_path: Path, num_classes: int, kind: str) -> tuple[Path, CifarArrays]:
    """Writes an archive; returns (what to pass to load_cifar, the arrays written)."""
    archive, folder, _ = layout_of(num_classes)
    if kind in ("tar", "dir_with_tar"):
        arrays = write_cifar_archive(tmp_path / archive, num_classes, 6, 7, seed=num_classes)
        return (tmp_path / archive if kind == "tar" else tmp_path), arrays
    arrays = write_cifar_archive(tmp_path, num_classes, 6, 7, seed=num_classes)
    return (tmp_path if kind == "dir" else tmp_path / folder), arrays


@pytest.mark.parametrize("kind", ["tar", "dir_with_tar", "dir", "folder"])
@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_round_trip(tmp_path: Path, num_classes: int, kind: str) -> None:
    root, arrays = make_archive(tmp_path, num_classes, kind)
    got = read_cifar(root, num_classes)
    for want, have in zip(arrays, got, strict=True):
        assert have.dtype == want.dtype and np.array_equal(have, want)
    assert got.x_train.shape == (30, 3, 32, 32) and got.x_test.shape == (7, 3, 32, 32)
    assert got.y_train.dtype == np.int64 and got.y_train.max() < num_classes

    raw = load_cifar(root, num_classes, normalize=False)
    assert raw.x_train.shape == (30, 3, 32, 32) and raw.num_classes == num_classes
    assert torch.equal(raw.x_train * 255, torch.from_numpy(got.x_train).float())
    assert torch.equal(raw.y_test, torch.from_numpy(got.y_test))

    norm = load_cifar(root, num_classes)
    pixels = got.x_train / 255.0
    mean, std = pixels.mean(axis=(0, 2, 3)), pixels.std(axis=(0, 2, 3))
    assert norm.mean == pytest.approx(tuple(mean)) and norm.std == pytest.approx(tuple(std))
    expected = (got.x_test / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(norm.x_test.numpy(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.x_train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)


def test_cifar_files_are_in_official_format(tmp_path: Path) -> None:
    arrays = write_cifar_archive(tmp_path / "cifar-10-python.tar.gz", 10, 3, 4, seed=0)
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "r:gz") as tar:
        names = set(tar.getnames())
        raw = tar.extractfile("cifar-10-batches-py/data_batch_2").read()  # type: ignore[union-attr]
    assert names == {f"cifar-10-batches-py/{n}" for n in layout_of(10)[2] + ["batches.meta"]}
    # Python-2 protocol-2 pickle: py2 strings and the numpy.core global of the real files.
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(raw)]
    assert ops[0] == ("PROTO", 2)
    globals_ = {arg for name, arg in ops if name == "GLOBAL"}
    assert globals_ == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    assert ("SHORT_BINSTRING", "data") in [(n, a) for n, a in ops]
    d = pickle.loads(raw, encoding="bytes")  # the standard reader agrees
    assert set(d) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert d[b"data"].dtype == np.uint8 and d[b"data"].shape == (3, 3072)
    assert np.array_equal(d[b"data"].reshape(3, 3, 32, 32), arrays.x_train[3:6])
    assert d[b"labels"] == arrays.y_train[3:6].tolist()
    write_cifar_archive(tmp_path, 100, 2, 2, seed=0)
    d = pickle.loads((tmp_path / "cifar-100-python/train").read_bytes(), encoding="bytes")
    assert {b"fine_labels", b"coarse_labels", b"data"} <= set(d) and len(d[b"data"]) == 10


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_cifar_accepts_modern_pickles(protocol: int) -> None:
    data = np.arange(2 * 3072).astype(np.uint8).reshape(2, 3072)
    raw = pickle.dumps({b"data": data, b"labels": np.array([9, 0])}, protocol=protocol)
    x, y = parse_batch(raw, "batch", CIFAR10)
    assert np.array_equal(x.reshape(2, 3072), data) and y.tolist() == [9, 0]


def test_cifar_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope.*no such file"):
        load_cifar(tmp_path / "nope")
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz.*cifar-10-batches-py"):
        load_cifar(tmp_path)  # empty directory
    write_cifar_archive(tmp_path, 10, 2, 2, seed=0)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"data_batch_3: missing"):
        load_cifar(tmp_path)
    with pytest.raises(DataError, match=r"cifar-100-python"):
        load_cifar(tmp_path, num_classes=100)
    with pytest.raises(DataError, match=r"10 or 100"):
        load_cifar(tmp_path, num_classes=20)


@pytest.mark.parametrize("keep", [0.03, 0.5, 0.97, -1, 10])
def test_cifar_truncated_tar(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "cifar-10-python.tar.gz"
    write_cifar_archive(path, 10, 10, 10, seed=0)
    blob = path.read_bytes()
    cut = int(len(blob) * keep) if 0 < keep < 1 else (len(blob) - 1 if keep == -1 else 10)
    path.write_bytes(blob[:cut])
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz.*truncated"):
        load_cifar(path)


def test_cifar_not_a_tar(tmp_path: Path) -> None:
    path = tmp_path / "cifar-10-python.tar.gz"
    path.write_bytes(b"this is not a tar archive at all\n" * 10)
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz: truncated or not a gzip tar"):
        load_cifar(tmp_path)


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def official_members(tmp_path: Path) -> dict[str, bytes]:
    write_cifar_archive(tmp_path / "src", 10, 2, 2, seed=0)
    folder = tmp_path / "src" / "cifar-10-batches-py"
    return {f"cifar-10-batches-py/{p.name}": p.read_bytes() for p in folder.iterdir()}


def test_cifar_tar_missing_member(tmp_path: Path) -> None:
    members = official_members(tmp_path)
    del members["cifar-10-batches-py/test_batch"]
    write_tar(tmp_path / "c.tar.gz", members)
    with pytest.raises(
        DataError, match=r"c.tar.gz: archive has no member cifar-10-batches-py/test"
    ):
        load_cifar(tmp_path / "c.tar.gz")


BAD_BATCHES = {
    "wrong keys": (
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"label": [1, 2]}),
        r"expected a pickled dict with keys b'data' and b'labels' \(CIFAR-10 python format\)",
    ),
    "str keys": (
        pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [1, 2]}),
        "expected a pickled dict with keys b'data' and b'labels'",
    ),
    "not a dict": (pickle.dumps([1, 2, 3]), "expected a pickled dict.*found list"),
    "not a pickle": (b"hello, I am plain text\n", "not a readable pickle"),
    "empty": (b"", "not a readable pickle"),
    "float data": (
        pickle.dumps({b"data": np.zeros((2, 3072)), b"labels": [1, 2]}),
        r"uint8 array of shape \(N, 3072\)",
    ),
    "wrong width": (
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]}),
        r"shape \(2, 100\), expected \(N, 3072\)",
    ),
    "label count": (
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}),
        r"b'labels' has shape \(1,\), expected \(2,\)",
    ),
    "label range": (
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 10]}),
        r"labels outside \[0, 10\)",
    ),
    "label type": (
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [b"a", b"b"]}),
        "must be a list of ints",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_cifar_malformed_batch_in_folder(tmp_path: Path, case: str) -> None:
    raw, message = BAD_BATCHES[case]
    write_cifar_archive(tmp_path, 10, 2, 2, seed=0)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(raw)
    with pytest.raises(DataError, match=r"cifar-10-batches-py/data_batch_3: .*" + message):
        load_cifar(tmp_path)


def test_cifar_malformed_batch_in_tar(tmp_path: Path) -> None:
    members = official_members(tmp_path)
    members["cifar-10-batches-py/data_batch_3"] = BAD_BATCHES["wrong keys"][0]
    write_tar(tmp_path / "cifar-10-python.tar.gz", members)
    with pytest.raises(
        DataError, match=r"cifar-10-python.tar.gz \(member cifar-10-batches-py/data_batch_3\)"
    ):
        load_cifar(tmp_path)


class Evil:
    """Pickles to a call of ``func(*args)`` on load."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def evil_payloads(marker: Path) -> dict[str, bytes]:
    import subprocess

    cmd = f"touch {marker}"
    data = np.zeros((2, 3072), np.uint8)
    return {
        "os.system": pickle.dumps(Evil(os.system, cmd), protocol=2),
        "eval": pickle.dumps(Evil(eval, f"open({str(marker)!r}, 'w')")),
        "popen nested": pickle.dumps(
            {b"data": data, b"labels": [0, 1], b"x": Evil(subprocess.Popen, ["touch", marker])}
        ),
        "handwritten": b"cos\nsystem\n(V" + cmd.encode() + b"\ntR.",
        "numpy load": pickle.dumps(Evil(np.load, str(marker))),
    }


@pytest.mark.parametrize("case", ["os.system", "eval", "popen nested", "handwritten", "numpy load"])
@pytest.mark.parametrize("as_tar", [False, True])
def test_cifar_malicious_pickle_is_refused(tmp_path: Path, case: str, as_tar: bool) -> None:
    marker = tmp_path / "pwned"
    payload = evil_payloads(marker)[case]
    if as_tar:
        members = official_members(tmp_path)
        members["cifar-10-batches-py/test_batch"] = payload
        write_tar(tmp_path / "cifar-10-python.tar.gz", members)
        where = r"cifar-10-python.tar.gz \(member cifar-10-batches-py/test_batch\)"
    else:
        write_cifar_archive(tmp_path, 10, 2, 2, seed=0)
        (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(payload)
        where = "cifar-10-batches-py/test_batch"
    with pytest.raises(DataError, match=where + ": refusing to unpickle global"):
        load_cifar(tmp_path)
    assert not marker.exists()


def test_restricted_unpickler_allowlist() -> None:
    with pytest.raises(DataError, match=r"src: refusing to unpickle global builtins.exec"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(Evil(exec, "1"))), "src").load()
    ok = pickle.dumps(np.arange(3, dtype=np.uint8), protocol=4)
    assert RestrictedUnpickler(io.BytesIO(ok), "src").load().tolist() == [0, 1, 2]


# ----------------------------------------------------------------------- load_dataset


def test_load_dataset_dispatch(tmp_path: Path) -> None:
    for name, archive in (("cifar10", "cifar-10-python.tar.gz"), ("cifar100", "cifar-100-py")):
        with pytest.raises(DataError, match=rf"{name}: --data-dir is required.*{archive}"):
            load_dataset(name, None, seed=0)
    with pytest.raises(DataError, match=r"unknown dataset 'mnist'.*digits, cifar10, cifar100"):
        load_dataset("mnist", None, seed=0)
    written = write_cifar_archive(tmp_path, 100, 2, 3, seed=1)
    s = load_dataset("cifar100", str(tmp_path), seed=0, normalize=False)
    assert s.name == "cifar100" and s.num_classes == 100
    assert torch.equal(s.y_train, torch.from_numpy(written.y_train))
    assert torch.equal(load_dataset("digits", None, seed=3).x_test, load_digits(seed=3).x_test)
    syn = load_dataset("synthetic", None, seed=0, num_samples=8, in_channels=2, image_size=5)
    assert syn.x_train.shape == (8, 2, 5, 5) and syn.x_test.shape == (2, 2, 5, 5)


def test_synthetic() -> None:
    a = synthetic(20, 4, 6, num_classes=3, seed=5, num_test=7)
    assert a.x_train.shape == (20, 4, 6, 6) and a.x_test.shape == (7, 4, 6, 6)
    assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64
    assert set(torch.cat([a.y_train, a.y_test]).tolist()) <= {0, 1, 2}
    assert (a.in_channels, a.image_size, a.num_classes) == (4, 6, 3)
    b = synthetic(20, 4, 6, num_classes=3, seed=5, num_test=7)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, synthetic(20, 4, 6, 3, seed=6, num_test=7).x_train)
    # The signal is the same class prototype added to the same noise.
    s = synthetic(20, 4, 6, 3, seed=5, num_test=7, signal=2.0)
    diff = s.x_train - a.x_train
    for c in range(3):
        rows = diff[a.y_train == c]
        assert torch.allclose(rows, rows[:1].expand_as(rows))


# ------------------------------------------------------------------------ augmentation


def test_random_crop_flip_identity() -> None:
    x = torch.randn(5, 3, 7, 6)
    assert torch.equal(random_crop_flip(x, padding=0, flip=False), x)


def test_random_crop_flip_padding_zero_only_flips() -> None:
    x = torch.randn(64, 2, 4, 5)
    out = random_crop_flip(x, padding=0, generator=torch.Generator().manual_seed(0))
    same = (out == x).flatten(1).all(1)
    flipped = (out == x.flip(-1)).flatten(1).all(1)
    assert bool((same | flipped).all()) and same.any() and flipped.any()


def test_random_crop_flip_matches_brute_force() -> None:
    n, c, h, w, p = 1000, 2, 4, 3, 2
    x = torch.arange(1, n * c * h * w + 1, dtype=torch.float64).reshape(n, c, h, w)
    out = random_crop_flip(x, padding=p, generator=torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = torch.nn.functional.pad(x, (p, p, p, p))

    def crop(i: int, oy: int, ox: int, flip: int) -> torch.Tensor:
        window = padded[i, :, oy : oy + h, ox : ox + w]
        return window.flip(-1) if flip else window

    options = [(oy, ox, f) for oy in range(2 * p + 1) for ox in range(2 * p + 1) for f in (0, 1)]
    seen = set()
    for i in range(n):
        matches = [o for o in options if torch.equal(out[i], crop(i, *o))]
        assert len(matches) >= 1, i
        seen.update(matches)
    assert len(seen) == (2 * p + 1) ** 2 * 2  # every offset and flip occurs


def test_random_crop_flip_seeded_and_validated() -> None:
    x = torch.randn(8, 3, 8, 8)
    a = random_crop_flip(x, 4, torch.Generator().manual_seed(7))
    b = random_crop_flip(x, 4, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"N, C, H, W"):
        random_crop_flip(x[0])
    with pytest.raises(ValueError, match=r"padding"):
        random_crop_flip(x, padding=-1)


# -------------------------------------------------------------------- batching/sharding


def test_batches_in_order() -> None:
    x, y = torch.arange(23).float()[:, None], torch.arange(23)
    got = list(batches(x, y, 5))
    assert [len(b[1]) for b in got] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat([b[0] for b in got]), x)
    assert [len(b[1]) for b in batches(x, y, 5, drop_last=True)] == [5, 5, 5, 5]
    assert [len(b[1]) for b in batches(x, y, 23, drop_last=True)] == [23]
    with pytest.raises(ValueError, match=r"batch_size"):
        list(batches(x, y, 0))
    with pytest.raises(ValueError, match=r"different lengths"):
        list(batches(x, y[:3], 2))


def test_batches_shuffled() -> None:
    x, y = torch.arange(23).float()[:, None] * 10, torch.arange(23)
    got = list(batches(x, y, 4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    order = torch.cat([b[1] for b in got])
    assert torch.equal(order, torch.randperm(23, generator=torch.Generator().manual_seed(3)))
    assert all(torch.equal(bx[:, 0], by.float() * 10) for bx, by in got)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_indices_matches_distributed_sampler(shuffle: bool, drop_last: bool) -> None:
    for n in [0, 1, 2, 3, 5, 10, 17, 64]:
        for world in [1, 2, 3, 4, 8]:
            for epoch in [0, 1, 5]:
                for rank in range(world):
                    sampler: DistributedSampler[int] = DistributedSampler(
                        range(n),  # type: ignore[arg-type]
                        world,
                        rank,
                        shuffle=shuffle,
                        seed=11,
                        drop_last=drop_last,
                    )
                    sampler.set_epoch(epoch)
                    got = shard_indices(n, rank, world, epoch, 11, shuffle, drop_last)
                    assert got == list(sampler), (n, world, epoch, rank)


def test_shard_indices_properties() -> None:
    n, world = 103, 4
    shards = [shard_indices(n, r, world, epoch=2, seed=0) for r in range(world)]
    assert {len(s) for s in shards} == {26}
    assert set().union(*shards) == set(range(n))
    assert sum(len(s) for s in shards) - n == 1  # one index wrapped around as padding
    assert shards == [shard_indices(n, r, world, epoch=2, seed=0) for r in range(world)]
    assert shards[0] != shard_indices(n, 0, world, epoch=3, seed=0)
    assert shard_indices(5, 1, 2, shuffle=False) == [1, 3, 0]
    with pytest.raises(ValueError, match=r"rank"):
        shard_indices(5, 2, 2)
