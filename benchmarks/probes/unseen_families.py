"""The default on four model families outside ``dkfac bench suite``, by the suite's protocol.

``KFACOptimizer.for_model(model, lr=lr)`` against AdamW and Muon (float32 iteration) on models
of kinds the suite does not hold and no option of the default was chosen on, as an unseen
user would bring them (:func:`dkfac.bench.suite.measure_task`: each optimizer's lr grid swept
on one seed, then held-out seeds on two splits; steps to the target; the step's cost side by
side in alternated blocks from the same initial weights, one thread):

* ``convnext``: a ConvNeXt-style network: a 2x2 stride-2 patch stem, two blocks of a 3x3
  depthwise convolution, LayerNorm over the channels and a pointwise MLP (``nn.Linear`` on
  channels-last maps), residual; global average pooling; the digits to 95%;
* ``mixer``: an MLP-Mixer: 16 tokens of 2x2 pixels, two blocks of token mixing (linear layers
  across the tokens, on the transposed map) and channel mixing, LayerNorm; the digits to 93%;
* ``gnresnet``: a residual CNN with GroupNorm and SiLU, a strided convolution, biases; the
  digits to 95%;
* ``llama``: ``transformers``' ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary positions,
  grouped-query attention, untied embeddings; 2 layers, width 64) on the suite's byte-level
  text, to a validation loss of 2.6 (skipped, and recorded so, without ``transformers``).

The digits families take the suite's data and batch (256) and the text family the GPT task's
(32 windows of 64 bytes, evaluated every 5 steps).

    PYTHONPATH=src python benchmarks/probes/unseen_families.py --threads 1 \\
        --name unseen_families
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.bench.common import command_line, format_table, machine_info, write_result
from dkfac.bench.suite import (
    GRIDS,
    add_protocol_flags,
    check_protocol_flags,
    make_optimizer,
    measure_task,
)
from dkfac.bench.suite_tasks import Task, load_task

FAMILIES = ("convnext", "mixer", "gnresnet", "llama")


class _ConvNeXtBlock(nn.Module):
    """Depthwise 3x3, LayerNorm over channels, pointwise MLP (4x), residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, 4 * channels)
        self.down = nn.Linear(4 * channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.down(F.gelu(self.up(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtTiny(nn.Module):
    """A patch stem, two ConvNeXt blocks, global average pooling, LayerNorm, a head."""

    def __init__(self, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 2, stride=2)
        self.blocks = nn.Sequential(_ConvNeXtBlock(channels), _ConvNeXtBlock(channels))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.stem(x)).mean(dim=(2, 3))))


class Mixer(nn.Module):
    """An MLP-Mixer on the 16 2x2 patches of an 8x8 image."""

    def __init__(self, width: int = 32, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.token_norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.tokens = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(depth)
        )
        self.channel_norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.channels = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        patches = x.reshape(n, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, 16, 4)
        t = self.embed(patches)
        layers = zip(self.token_norms, self.tokens, self.channel_norms, self.channels, strict=True)
        for token_norm, tokens, channel_norm, channels in layers:
            t = t + tokens(token_norm(t).transpose(1, 2)).transpose(1, 2)
            t = t + channels(channel_norm(t))
        return self.head(t.mean(dim=1))


class GroupNormResNet(nn.Module):
    """A stem, a residual block, a strided convolution and a second block; GroupNorm, SiLU."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(8, width))
        self.block1 = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1),
            nn.GroupNorm(8, width),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.GroupNorm(8, width),
        )
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.block2 = nn.Sequential(
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.GroupNorm(8, 2 * width), nn.SiLU()
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        y = F.silu(self.stem(x))
        y = self.down(F.silu(y + self.block1(y)))
        return self.head((y + self.block2(y)).mean(dim=(2, 3)))


class _Logits(nn.Module):
    """A ``transformers`` causal language model as ``ids -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


def llama() -> nn.Module:
    """A two-layer ``LlamaForCausalLM`` on bytes (width 64, 4 heads, 2 key-value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return _Logits(LlamaForCausalLM(config))


BUILDERS: dict[str, tuple[str, Callable[[], nn.Module], float]] = {
    "convnext": ("resnet", ConvNeXtTiny, 0.95),
    "mixer": ("vit", Mixer, 0.93),
    "gnresnet": ("resnet", GroupNormResNet, 0.95),
    "llama": ("gpt", llama, 2.6),
}
"""Family -> (the suite task whose data and batch it takes, its model, its target)."""


def family_tasks(family: str) -> dict[int, Task]:
    """The family's task on both splits."""
    base, build, target = BUILDERS[family]
    return {
        split: dataclasses.replace(load_task(base, split), name=family, build=build, target=target)
        for split in (0, 1)
    }


def _missing(family: str) -> str | None:
    """Why the family cannot run here (``None``: it can)."""
    if family != "llama":
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    add_protocol_flags(parser, ("dkfac", "adamw", "muon32"), max_steps=200, name="unseen_families")
    args = parser.parse_args(argv)
    check_protocol_flags(parser, args)
    if args.dkfac_options:  # refused on a small model now, not deep in the first run
        try:
            make_optimizer("dkfac", Mixer(), 1e-3, args.dkfac_options)
        except (TypeError, ValueError) as error:
            parser.error(f"--dkfac-options: {error}")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(dict.fromkeys(args.optimizers))
    skipped = {f: reason for f in args.families if (reason := _missing(f)) is not None}
    records: list[dict[str, Any]] = []
    for family in args.families:
        if family not in skipped:
            records.append(measure_task(args, family_tasks(family), names))
    payload = {
        "benchmark": "unseen families",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "grids": {n: GRIDS[n] for n in names}},
        "skipped": skipped,
        "tasks": records,
    }
    command = command_line("PYTHONPATH=src python benchmarks/probes/unseen_families.py", argv)
    path = write_result(args.name, payload, args.out_dir, command)
    rows = [
        [t["task"], n, e["lr"], e["median_steps"], e["median_steps_split1"], e["step_vs_adamw"],
         e["time_vs_best_peer"]]
        for t in records
        for n, e in t["summary"]["optimizers"].items()
    ]  # fmt: skip
    headers = ["family", "optimizer", "lr", "steps", "steps split 1", "x AdamW step", "x best"]
    print(format_table(headers, rows))
    for family, reason in skipped.items():
        print(f"{family}: skipped ({reason})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
