"""The stated domain of every numeric flag of ``dkfac train`` / ``dkfac compare``.

:data:`DOMAINS` holds one :class:`Domain` per numeric training flag (the K-FAC flags are
checked by :class:`~dkfac.KFACConfig` itself). :func:`check_domains` checks a parsed namespace
against the table, so every flag is checked once, where it enters, with a message that names
the flag, the allowed values and the value given. Every float must be finite: ``nan`` and
``inf`` pass no comparison a user means (``--gamma nan`` used to skip every step silently).
Relations between flags (``--warmup-epochs`` <= ``--epochs``, increasing ``--milestones``)
are checked by the command line itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

SEED_MAX = 2**32 - 1  # numpy / scikit-learn seeds (the digits split) stop here
FLOAT32_MAX = 1e38
"""The largest rate or decay a flag takes: torch's optimizers multiply float32 weights by
it (``param.add_(grad, alpha=-lr)``), and a number beyond float32's range (about 3.4e38)
fails there with a traceback instead of here."""


@dataclasses.dataclass(frozen=True)
class Domain:
    """An interval of allowed values, every float in it finite.

    Attributes:
        low: Lower bound (``-inf``: none).
        high: Upper bound (``inf``: none).
        low_open: The lower bound itself is excluded.
        high_open: The upper bound itself is excluded.
        meaning: What the value is, added to the message (``"a decay factor"``).
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def contains(self, value: float) -> bool:
        """Whether ``value`` is a finite number inside the interval."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in [0, 1)"``, ``"finite"``; with the meaning appended."""
        low, high = _show(self.low), _show(self.high)
        if self.low == -math.inf and self.high == math.inf:
            text = "finite"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {low}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {high}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{low}, {high}{right}"
        return f"{text} ({self.meaning})" if self.meaning else text


def _show(bound: float) -> str:
    whole = math.isfinite(bound) and bound == int(bound) and abs(bound) < 1e15
    return str(int(bound)) if whole else f"{bound:g}"


POSITIVE_INT = Domain(1)
COUNT = Domain(0)  # 0 means "off"
#: flag destination -> its domain. Optional flags (``None`` allowed) are checked when set.
DOMAINS: dict[str, Domain] = {
    "synthetic_samples": Domain(1, 10**9),
    "image_size": Domain(1, 4096, meaning="pixels"),
    "in_channels": Domain(1, 4096),
    "num_classes": Domain(2, 100_000, meaning="a classifier needs 2 classes or more"),
    "epochs": POSITIVE_INT,
    "steps": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "accumulation_steps": POSITIVE_INT,
    "log_every": POSITIVE_INT,
    "threads": Domain(1, 4096),
    "layers": Domain(1, 1024, meaning="transformer blocks"),
    "width": Domain(1, 65_536),
    "heads": Domain(1, 4096),
    "seq_len": Domain(1, 1_000_000, meaning="bytes per sample"),
    "text_bytes": Domain(1, 10**12),
    "checkpoint_every": COUNT,
    "checkpoint_epochs": COUNT,
    "eval_every": COUNT,
    "seed": Domain(0, SEED_MAX),
    "lr": Domain(0.0, FLOAT32_MAX, low_open=True),
    "muon_adamw_lr": Domain(0.0, FLOAT32_MAX, low_open=True),
    "momentum": Domain(0.0, 1.0, high_open=True),
    "weight_decay": Domain(0.0, FLOAT32_MAX),
    "warmup_epochs": Domain(0.0),
    "milestones": Domain(0.0, meaning="epochs"),
    "gamma": Domain(0.0, 1.0, low_open=True, meaning="a decay factor"),
    "power": Domain(0.0, low_open=True, meaning="the poly schedule's exponent"),
    "label_smoothing": Domain(0.0, 1.0, high_open=True),
    "mixup": Domain(0.0, meaning="Beta(a, a) parameter; 0 = off"),
    "target_accuracy": Domain(0.0, 1.0, low_open=True),
    "dist_timeout": Domain(0.0, 7 * 86400.0, low_open=True, meaning="seconds"),
    "shard_size": Domain(1, 1_000_000, meaning="ranks"),
}


def flag_name(dest: str) -> str:
    """``weight_decay`` -> ``--weight-decay``."""
    return "--" + dest.replace("_", "-")


def domain_error(dest: str, value: Any) -> str | None:
    """The message for ``value`` of flag ``dest`` outside its domain, else ``None``."""
    domain = DOMAINS[dest]
    values = value if isinstance(value, (list, tuple)) else [value]
    for item in values:
        if item is None or domain.contains(item):
            continue
        finite = not isinstance(item, float) or math.isfinite(item)
        described = domain.describe()
        if not finite and described != "finite":
            described = "finite and " + described
        return f"{flag_name(dest)} must be {described}, got {item!r}"
    return None


def check_domains(args: argparse.Namespace) -> str | None:
    """The first flag of ``args`` outside its domain, as a message (``None``: all fine)."""
    for dest in DOMAINS:
        if hasattr(args, dest) and (message := domain_error(dest, getattr(args, dest))):
            return message
    return None
