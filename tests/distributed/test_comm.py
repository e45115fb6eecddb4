"""Oracle tests for dkfac.distributed.comm and the packing (buckets) and ledger it uses:
packing, ledger, no-op mode, gloo collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dkfac.distributed.assignment import grad_worker_groups
from dkfac.distributed.buckets import bucket_tensors, pack_triangle, unpack_triangle
from dkfac.distributed.comm import Communicator
from dkfac.distributed.ledger import COLLECTIVES, KINDS, CommLedger
from tests.distributed_utils import DistributedTestError, run_distributed

# -- triangle packing ----------------------------------------------------------------------


def test_pack_triangle_exact() -> None:
    m = torch.arange(16.0).view(4, 4)
    assert pack_triangle(m).tolist() == [0, 1, 2, 3, 5, 6, 7, 10, 11, 15]
    assert pack_triangle(m).numel() * 4 == 40  # a packed 4x4 float32 is 40 bytes


def test_unpack_triangle_exact() -> None:
    out = unpack_triangle(torch.tensor([1.0, 2, 3, 4, 5, 6]), 3)
    assert out.tolist() == [[1, 2, 3], [2, 4, 5], [3, 5, 6]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triangle_round_trip(dtype: torch.dtype) -> None:
    x = torch.randn(7, 7, generator=torch.Generator().manual_seed(0), dtype=dtype)
    sym = x + x.T
    back = unpack_triangle(pack_triangle(sym), 7)
    assert back.dtype == dtype and torch.equal(back, sym)


def test_triangle_validation() -> None:
    with pytest.raises(ValueError, match="square"):
        pack_triangle(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="n\\(n\\+1\\)/2"):
        unpack_triangle(torch.zeros(5), 3)


# -- ledger --------------------------------------------------------------------------------


def _step(by_kind: dict[str, int], by_coll: dict[str, int]) -> dict[str, Any]:
    kinds = {k: by_kind.get(k, 0) for k in KINDS}
    colls = {c: by_coll.get(c, 0) for c in COLLECTIVES}
    return {"by_kind": kinds, "by_collective": colls, "bytes": sum(kinds.values())}


def test_ledger_steps_and_totals() -> None:
    ledger = CommLedger()
    assert ledger.stats()["last_step"] == _step({}, {})
    ledger.record("gradients", "all_reduce", 68)
    ledger.record("factors", "all_reduce", 40)
    ledger.end_step()
    ledger.record("preconditioned", "broadcast", 12)
    stats = ledger.stats()
    step1 = _step({"gradients": 68, "factors": 40}, {"all_reduce": 108})
    assert stats == {
        "total": {"gradients": 68, "factors": 40, "inverses": 0, "preconditioned": 12},
        "total_bytes": 120,
        "by_collective": {**_step({}, {})["by_collective"], "all_reduce": 108, "broadcast": 12},
        "last_step": step1,
        "current_step": _step({"preconditioned": 12}, {"broadcast": 12}),
        "per_step": [step1],
        "steps": 1,
        "first_step_in_window": 0,
    }
    stats["per_step"][0]["bytes"] = -1  # a snapshot, not a view
    assert ledger.stats()["per_step"][0]["bytes"] == 108
    ledger.reset()
    assert ledger.stats()["total_bytes"] == 0 and ledger.stats()["steps"] == 0


def test_ledger_validation() -> None:
    ledger = CommLedger()
    with pytest.raises(ValueError, match="kind"):
        ledger.record("weights", "all_reduce", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collective"):
        ledger.record("factors", "scatter", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        ledger.record("factors", "reduce", -1)


# -- single process: no-ops ----------------------------------------------------------------


def test_single_process_is_a_noop() -> None:
    assert not dist.is_initialized()
    comm = Communicator(bucket_bytes=8)
    assert (comm.active, comm.rank, comm.world_size, comm.ranks) == (False, 0, 1, [0])
    a, b = torch.arange(12.0).view(3, 4), torch.ones(3, 3)
    b[2, 0] = 5.0  # not symmetric: packing must not touch it in no-op mode
    a0, b0 = a.clone(), b.clone()
    handles = [
        comm.all_reduce([a], "gradients"),
        comm.all_reduce([b], "factors", pack_symmetric=True),
        comm.broadcast([a], 0, "inverses"),
        comm.reduce([a], 0, "factors", op="sum"),
        comm.reduce_to_owners([a, b], [0, 0], "gradients", pack_symmetric=False),
        comm.all_gather_from_owners([a, b], [0, 0], "preconditioned"),
    ]
    for h in handles:
        h.wait()
        h.wait()  # idempotent
        assert h.done
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert comm.ledger.stats()["total_bytes"] == 0


def test_validation_without_process_group() -> None:
    comm = Communicator()
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="kind"):
        comm.all_reduce([x], "weights")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce([x], "gradients", op="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in the group"):
        comm.reduce_to_owners([x], [1], "gradients")
    with pytest.raises(ValueError, match="one entry per tensor"):
        comm.all_gather_from_owners([x, x], [0], "preconditioned")
    with pytest.raises(ValueError, match="square"):
        comm.all_reduce([torch.zeros(2, 3)], "factors", pack_symmetric=True)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Communicator(bucket_bytes=0)


def test_bucketing_caps_size_and_splits_dtypes() -> None:
    t1, t2 = torch.zeros(3, 4), torch.zeros(5)  # 48 and 20 bytes
    t3, t4 = torch.zeros(2), torch.zeros(3, dtype=torch.float64)  # 8 and 24 bytes
    big = torch.zeros(100)  # 400 bytes > cap: a bucket of its own
    buckets = bucket_tensors([t1, t2, t3, t4, big], [False] * 5, ["factors"] * 5, 64)
    assert [[t.numel() for t in b.tensors] for b in buckets] == [[12], [5, 2], [100], [3]]
    assert [b.nbytes for b in buckets] == [48, 28, 400, 24]
    squares = [torch.zeros(4, 4), torch.zeros(3, 3), torch.zeros(2, 2)]
    packed = bucket_tensors(squares, [True] * 3, ["factors"] * 3, 64)
    assert [b.nbytes for b in packed] == [64, 12]  # 40 + 24 fits exactly, then 3 floats


# -- multi-rank (gloo, spawned) ------------------------------------------------------------


def _sym_with_junk_lower(base: torch.Tensor, scale: float, junk: float) -> torch.Tensor:
    out = base * scale
    rows, cols = torch.tril_indices(*base.shape, offset=-1)
    out[rows, cols] = junk  # ignored by packing: only the upper triangle is sent
    return out


def _collectives(rank: int, ws: int) -> dict[str, Any]:
    ledger = CommLedger()
    comm = Communicator(ledger=ledger, bucket_bytes=32)
    assert (comm.active, comm.rank, comm.world_size) == (True, rank, ws)
    ranks_sum = sum(range(ws))  # Σ r
    scale_sum = sum(r + 1 for r in range(ws))  # Σ (r + 1)

    # step 1: all-reductions; two launched before either is waited on
    a = torch.arange(12.0).view(3, 4) * (rank + 1)  # 48 bytes, one bucket alone
    b = torch.arange(5.0) + 10 * rank  # 20 bytes
    c = torch.full((2, 3), float(rank), dtype=torch.float64)  # 48 bytes
    e = torch.arange(7.0) * rank  # 28 bytes
    h1 = comm.all_reduce([a, b], "gradients")  # mean: 68 bytes
    h2 = comm.all_reduce([c, e], "gradients", op="sum")  # mixed dtypes: 76 bytes
    h2.wait()
    h1.wait()
    assert torch.equal(a, torch.arange(12.0).view(3, 4) * scale_sum / ws)
    assert torch.equal(b, torch.arange(5.0) + 10 * ranks_sum / ws)
    assert torch.equal(c, torch.full((2, 3), float(ranks_sum), dtype=torch.float64))
    assert torch.equal(e, torch.arange(7.0) * ranks_sum)

    base4 = unpack_triangle(torch.arange(1.0, 11.0), 4)
    base3 = unpack_triangle(torch.arange(1.0, 7.0), 3)
    fa = _sym_with_junk_lower(base4, rank + 1, -100.0 * rank)
    fg = _sym_with_junk_lower(base3, 2.0 * (rank + 1), 7.0 + rank)
    comm.all_reduce([fa, fg], "factors", pack_symmetric=True).wait()  # 40 + 24 bytes
    assert torch.equal(fa, base4 * scale_sum / ws)
    assert torch.equal(fg, base3 * 2.0 * scale_sum / ws)
    ledger.end_step()

    # step 2: broadcast, reduce_to_owners, all_gather_from_owners, reduce (all in flight)
    src = ws - 1
    x = torch.arange(6.0).view(2, 3) + 100 * rank  # 24 bytes
    y = torch.arange(4.0, dtype=torch.float64) * (rank + 1)  # 32 bytes
    hb = comm.broadcast([x, y], src, "inverses")

    owners = [0, 1, ws - 1, 0]
    grads = [
        torch.arange(12.0).view(3, 4) * (rank + 1),  # 48 bytes
        torch.arange(5.0) - rank,  # 20 bytes
        torch.full((2, 2), 2.0 * rank),  # 16 bytes
        torch.arange(6.0) * rank,  # 24 bytes
    ]
    originals = [g.clone() for g in grads]
    hr = comm.reduce_to_owners(grads, owners, "gradients")  # 108 bytes
    fac = [_sym_with_junk_lower(base3, rank + 1, 3.0), _sym_with_junk_lower(base4, 1.0, -rank)]
    fac_orig = [f.clone() for f in fac]
    hf = comm.reduce_to_owners(fac, [1, 0], "factors", op="sum", pack_symmetric=True)  # 64 B

    gather_owners = [0, ws - 1, 1]
    expected_gather = [
        torch.arange(12.0).view(3, 4) + 0.5,
        torch.arange(5.0) * 3,
        torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64),
    ]
    pre = [
        v.clone() if rank == o else torch.full_like(v, -1.0 - rank)
        for v, o in zip(expected_gather, gather_owners, strict=True)
    ]
    hg = comm.all_gather_from_owners(pre, gather_owners, "preconditioned")  # 48+20+32 = 100 B

    z = torch.arange(3.0) + rank  # 12 bytes
    hz = comm.reduce([z], 1, "factors", op="sum")

    for h in (hz, hg, hf, hr, hb):
        h.wait()
    assert torch.equal(x, torch.arange(6.0).view(2, 3) + 100 * src)
    assert torch.equal(y, torch.arange(4.0, dtype=torch.float64) * ws)
    expected_grads = [
        torch.arange(12.0).view(3, 4) * scale_sum / ws,
        torch.arange(5.0) - ranks_sum / ws,
        torch.full((2, 2), 2.0 * ranks_sum / ws),
        torch.arange(6.0) * ranks_sum / ws,
    ]
    for g, g0, want, owner in zip(grads, originals, expected_grads, owners, strict=True):
        assert torch.equal(g, want if rank == owner else g0)
    assert torch.equal(fac[0], base3 * scale_sum if rank == 1 else fac_orig[0])
    assert torch.equal(fac[1], base4 * ws if rank == 0 else fac_orig[1])
    for got, want in zip(pre, expected_gather, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(z, torch.arange(3.0) * ws + ranks_sum if rank == 1 else z)
    ledger.end_step()
    return ledger.stats()


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_exact_values_and_bytes(world_size: int) -> None:
    results = run_distributed(_collectives, world_size)
    step1 = _step({"gradients": 68 + 76, "factors": 40 + 24}, {"all_reduce": 208})
    step2 = _step(
        {"inverses": 24 + 32, "gradients": 108, "factors": 64 + 12, "preconditioned": 100},
        {"broadcast": 56, "reduce_scatter": 108 + 64, "all_gather": 100, "reduce": 12},
    )
    expected = {
        "total": {"gradients": 252, "factors": 140, "inverses": 56, "preconditioned": 100},
        "total_bytes": 548,
        "by_collective": {
            "all_reduce": 208,
            "broadcast": 56,
            "reduce_scatter": 172,
            "all_gather": 100,
            "reduce": 12,
            "all_to_all": 0,
        },
        "last_step": step2,
        "current_step": _step({}, {}),
        "per_step": [step1, step2],
        "steps": 2,
        "first_step_in_window": 0,
    }
    assert results == [expected] * world_size  # every rank records the same bytes


def _all_to_all(rank: int, ws: int) -> dict[str, Any]:
    # rank r sends r + 1 entries to each rank j (its own share included), valued 100 r + j
    ledger = CommLedger()
    comm = Communicator(ledger=ledger)
    send = torch.cat([torch.full((rank + 1,), 100.0 * rank + j) for j in range(ws)])
    out, handle = comm.all_to_all(
        send, [rank + 1] * ws, [i + 1 for i in range(ws)], "gradients", nbytes=12
    )
    handle.wait()
    want = torch.cat([torch.full((i + 1,), 100.0 * i + rank) for i in range(ws)])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="one entry per rank"):
        comm.all_to_all(send, [1], [1], "gradients", nbytes=0)
    with pytest.raises(ValueError, match="sum\\(send_counts\\)"):
        comm.all_to_all(send, [0] * ws, [0] * ws, "gradients", nbytes=0)
    return ledger.stats()["total"] | {"all_to_all": ledger.stats()["by_collective"]["all_to_all"]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_delivers_each_ranks_share_and_records_the_plans_bytes(world_size: int) -> None:
    # what the caller's plan says all ranks send together, the same on every rank
    for stats in run_distributed(_all_to_all, world_size):
        assert stats["gradients"] == 12 and stats["all_to_all"] == 12


def _subgroups(rank: int, ws: int) -> int:
    groups = grad_worker_groups(ws, 0.5)  # [[0, 2], [1, 3]]
    pgs = [dist.new_group(g) for g in groups]  # collective: every rank creates every group
    mine = next(i for i, g in enumerate(groups) if rank in g)
    comm = Communicator(group=pgs[mine], bucket_bytes=16)
    assert (comm.world_size, comm.ranks) == (2, groups[mine])
    t = torch.arange(4.0) + rank
    comm.all_reduce([t], "preconditioned").wait()
    assert torch.equal(t, torch.arange(4.0) + sum(groups[mine]) / 2)
    s = torch.full((3,), float(rank))
    comm.broadcast([s], groups[mine][-1], "inverses").wait()  # src is a global rank
    assert torch.equal(s, torch.full((3,), float(groups[mine][-1])))
    other = Communicator(group=pgs[1 - mine])
    with pytest.raises(RuntimeError, match="not a member"):
        other.all_reduce([t], "gradients")
    with pytest.raises(ValueError, match="not in the group"):
        comm.broadcast([s], groups[1 - mine][0], "inverses")
    dist.barrier()
    return int(comm.ledger.stats()["total_bytes"])


def test_subgroup_communicator_uses_global_ranks() -> None:
    assert run_distributed(_subgroups, 4) == [16 + 12] * 4


def _single_rank(rank: int, ws: int) -> int:
    comm = Communicator()
    t = torch.arange(3.0)
    comm.all_reduce([t], "gradients").wait()
    comm.reduce_to_owners([t], [0], "gradients").wait()
    assert not comm.active and torch.equal(t, torch.arange(3.0))
    return int(comm.ledger.stats()["total_bytes"])


def _fails_on_rank_one(rank: int, ws: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would hang here; the helper must kill it
    return rank


def test_helper_world_one_and_error_propagation() -> None:
    assert run_distributed(_single_rank, 1) == [0]
    with pytest.raises(DistributedTestError, match="rank 1 of 2 raised") as info:
        run_distributed(_fails_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "boom from rank one" in info.value.child_traceback
    assert "Traceback" in info.value.child_traceback


def _own_rank(rank: int, ws: int) -> int:
    return rank


def test_helper_starts_again_when_its_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process binding the chosen port first (a second pytest worker) costs a
    restart on a fresh port, not a failed test; a port taken every time is an error."""
    import socket

    import tests.distributed_utils as utils

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        handed: list[int] = []
        fresh = utils.find_free_port

        def first_taken() -> int:
            handed.append(taken if not handed else fresh())
            return handed[-1]

        monkeypatch.setattr(utils, "find_free_port", first_taken)
        assert run_distributed(_own_rank, 2, timeout=60) == [0, 1]
        assert handed[0] == taken and len(handed) == 2
        monkeypatch.setattr(utils, "find_free_port", lambda: taken)
        with pytest.raises(DistributedTestError, match="port taken 3 times") as info:
            run_distributed(_own_rank, 2, timeout=60)
        assert info.value.rank == 0
