"""The python examples of README.md and docs/*.md run as a reader would run them.

Each page's blocks run in order in one namespace, as the page is read (a later block uses the
``model`` or ``opt`` an earlier one built). What a block leaves to the reader (``model``,
``loader``, ``loss_fn``: "yours") is bound by :data:`READER`, keyed by the page and the start
of the block's first line; a block without an entry fails here, so a new example gets one,
and an entry that matches no block fails too. An ``...`` standing for a value of an
assignment (``vocab, loader = 256, ...``) is the reader's object of that name, bound by the
entry. Where a block's comment states a value, the entry's check asserts it.

docs/integrations.md has its own test (tests/integrations/test_docs.py), and a block that is
a module file (``# mymodels.py``) is imported by the command it serves
(``tests/test_documents.py::test_command_parses``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed_utils import find_free_port
from tests.test_documents import PAGES, _fenced, _text

OWN_TEST = ("integrations.md",)
"""Pages whose examples another test runs."""
MODULE_FILE = re.compile(r"# \w+\.py$")
FRAMEWORKS = ("transformers",)


class Reader(NamedTuple):
    """What the reader holds before a block (``before``) and what its comments state
    (``check``, asserted after it): python run in the page's namespace."""

    before: str = ""
    check: str = ""


READER: dict[tuple[str, str], Reader] = {
    ("README.md", "from dkfac import KFACOptimizer"): Reader(
        "model, loader, loss_fn = mlp(), batches(3), cross_entropy"
    ),
    ("README.md", "import torch"): Reader(
        "model = mlp()",
        "c = pre.config\n"
        "assert (c.method, c.damping) == ('eigen', 0.03)\n"
        "assert (c.factor_update_interval, c.inverse_update_interval) == (1, 10)",
    ),
    ("README.md", "pre = KFACPreconditioner(ddp_model"): Reader(
        "ddp_model = model  # one process: the bare model"
    ),
    ("distributed.md", "import torch, torch.distributed as dist"): Reader(
        "make_model, device, loader = mlp, 'cpu', batches(2)"
    ),
    ("distributed.md", "from torch.distributed.device_mesh import"): Reader(
        "model, loss_fn = blocks_model(), cross_entropy"
    ),
    ("spngd.md", "out = model(x)"): Reader(
        "from dkfac import KFACPreconditioner\n"
        "model, loss_fn = mlp(), cross_entropy\n"
        "pre = KFACPreconditioner(model, fisher='mc')\n"
        "((x, y),) = batches(1)"
    ),
    ("transformers.md", "import torch"): Reader("loader = token_batches(1)"),
    ("transformers.md", "opt = KFACOptimizer.for_model(model, lr=0.006"): Reader(),
    ("transformers.md", "for row in pre.describe():"): Reader("pre = opt.preconditioner"),
    ("transformers.md", "opt = KFACOptimizer.for_model(model, orthogonal_layers="): Reader(),
    ("transformers.md", "opt = KFACOptimizer.for_model(model, basis_block_size="): Reader(
        check="assert opt.preconditioner.config.basis_block_size == 256  # '256 here'"
    ),
    ("transformers.md", "opt = KFACOptimizer.for_model(model, skip_layers="): Reader(),
}
"""(page, start of a block's first line) -> what the reader holds before it."""


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class BlocksModel(nn.Module):
    """A model with ``.blocks``, as the FSDP2 example shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(count)]


def token_batches(count: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (2, 16)) for _ in range(count)]


def _examples(page: Path) -> list[str]:
    """The page's python blocks a reader runs (not module files)."""
    return [
        code
        for language, code in _fenced(_text(page))
        if language == "python" and not MODULE_FILE.match(code.split("\n", 1)[0])
    ]


def _entry(page: str, code: str) -> Reader:
    first = code.split("\n", 1)[0]
    found = [r for (p, start), r in READER.items() if p == page and first.startswith(start)]
    assert len(found) == 1, (
        f"{page}: the block starting {first!r} has {len(found)} entries in READER: give it one"
    )
    return found[0]


def _bind_placeholders(code: str) -> str:
    """``a, b = 1, ...`` -> ``a, b = 1, b``: an ``...`` value is the reader's own ``b``."""
    lines = []
    for line in code.splitlines():
        found = re.match(r"^(\s*)([\w, ]+?) = ([^#]*?)\s*(#.*)?$", line)
        if found and "..." in found.group(3):
            names = [n.strip() for n in found.group(2).split(",")]
            values = [v.strip() for v in found.group(3).split(",")]
            if len(names) == len(values):
                values = [n if v == "..." else v for n, v in zip(names, values, strict=True)]
                line = f"{found.group(1)}{', '.join(names)} = {', '.join(values)}"
        lines.append(line)
    return "\n".join(lines)


PAGES_WITH_EXAMPLES = [p for p in PAGES if p.name not in OWN_TEST and _examples(p)]


def test_every_entry_names_a_block() -> None:
    firsts = {
        (page.name, code.split("\n", 1)[0])
        for page in PAGES_WITH_EXAMPLES
        for code in _examples(page)
    }
    stale = [
        key for key in READER if not any(p == key[0] and f.startswith(key[1]) for p, f in firsts)
    ]
    assert not stale, f"READER entries that no block of the pages starts with: {stale}"


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: p.name)
def test_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    examples = _examples(page)
    for name in FRAMEWORKS:
        if any(re.search(rf"^\s*(import|from) {name}\b", c, flags=re.M) for c in examples):
            pytest.importorskip(name)
    if any("init_process_group(" in code for code in examples):  # one rank of gloo
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    namespace: dict[str, Any] = {
        "__name__": "__docs__",
        "mlp": mlp,
        "blocks_model": BlocksModel,
        "batches": batches,
        "token_batches": token_batches,
        "cross_entropy": nn.functional.cross_entropy,
    }
    try:
        for index, code in enumerate(examples):
            entry = _entry(page.name, code)
            where = f"{page.name}, python block {index + 1}"
            exec(compile(entry.before, f"{where}: the reader's part", "exec"), namespace)
            exec(compile(_bind_placeholders(code), where, "exec"), namespace)
            exec(compile(entry.check, f"{where}: what its comments say", "exec"), namespace)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
