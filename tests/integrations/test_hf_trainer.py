"""HuggingFace's ``Trainer`` (and accelerate under it) with ``KFACOptimizer``, for real: a tiny
random GPT-2 built from a config (Conv1D layers, tied embedding and head, a position
embedding broadcast over the batch; nothing downloaded), each run against its twin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dkfac import KFACOptimizer
from tests.integrations.twins import max_difference

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 64, 16


def tiny_gpt2() -> nn.Module:
    """A two-block GPT-2 without dropout (so runs are deterministic), seeded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each its own label (the model shifts them)."""

    def __init__(self, count: int = 64) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    out: Path,
    *,
    batch: int = 8,
    accumulation: int = 1,
    steps: int = 4,
    options: dict | None = None,
    resume: str | None = None,
    adamw: bool = False,
    **arguments,
) -> nn.Module:
    """Trains the tiny GPT-2 with ``KFACOptimizer.for_model`` through a ``Trainer`` (with
    ``adamw``: the Trainer's own AdamW)."""
    model = tiny_gpt2()
    if arguments.pop("checkpointing", False):
        model.gradient_checkpointing_enable()
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **{"save_strategy": "no", **arguments},
    )
    opt = None if adamw else KFACOptimizer.for_model(model, lr=3e-3, **(options or {}))
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None)
    )
    trainer.train(resume_from_checkpoint=resume)
    return model


def _accumulation_gap(tmp_path: Path, **how: Any) -> float:
    full = train(tmp_path, batch=16, steps=3, **how)
    return max_difference(full, train(tmp_path, batch=8, accumulation=2, steps=3, **how))


def test_accumulation_equals_the_unaccumulated_batch(tmp_path: Path) -> None:
    """Two micro-batches of 8 against one of 16, no count given to dkfac (the Trainer
    divides each micro-batch's token sum by the step's token count; dkfac counts the two
    backward passes): the damped eigen method equal to float32 rounding, and the default's
    Adam in the eigenbasis as close as the Trainer's own AdamW. The position embedding's
    factor is singular: its null space gets a canonical basis and Adam a rounding floor
    (without them the default ended 1e-2 apart). The default's orthogonalised update of the
    hidden Conv1D matrices is left out here: it turns rounding differences into update
    differences (3e-3 apart after 3 steps; the same batch with its rows in reverse order
    moves them as far), so it cannot tell the step's counting from rounding."""
    adamw = _accumulation_gap(tmp_path, adamw=True)
    assert _accumulation_gap(tmp_path, options={"method": "eigen"}) < 1e-6
    unorthogonal = {"orthogonal_layers": ()}
    assert _accumulation_gap(tmp_path, options=unorthogonal) < 4 * max(adamw, 1e-6)


def test_gradient_checkpointing_changes_nothing(tmp_path: Path) -> None:
    plain = train(tmp_path, steps=3)
    checkpointed = train(tmp_path, steps=3, checkpointing=True)
    assert max_difference(plain, checkpointed) < 1e-6


def test_resume_from_its_own_checkpoint_is_exact(tmp_path: Path) -> None:
    """``optimizer.pt`` (loaded by the Trainer with ``weights_only=True``) restores dkfac."""
    straight = train(tmp_path / "a", steps=4, save_strategy="steps", save_steps=2)
    resumed = train(
        tmp_path / "b",
        steps=4,
        save_strategy="steps",
        save_steps=2,
        resume=str(tmp_path / "a" / "checkpoint-2"),
    )
    assert max_difference(straight, resumed) == 0.0
