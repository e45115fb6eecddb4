"""The GPT of ``--model gpt``: layout against a hand-written forward, causality, K-FAC coverage,
and a few training steps of the language-model task through the CLI."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.cli import main
from dkfac.app.gpt import GPT, Block
from dkfac.app.models import build_model
from dkfac.app.report import read_metrics
from dkfac.bench.step import model_and_batch
from dkfac.preconditioner import KFACPreconditioner


def _tiny(**sizes: int) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 256, "context": 12, "layers": 2, "width": 16, "heads": 4, **sizes})


def _reference_forward(model: GPT, tokens: Tensor) -> Tensor:
    """The pre-LayerNorm decoder written out: explicit causal mask, softmax(q k^T / sqrt d)."""
    n, t = tokens.shape
    x = model.tokens.weight[tokens] + model.positions.weight[:t]
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    for block in model.blocks:
        assert isinstance(block, Block)
        att = block.attention
        h = F.layer_norm(x, (x.shape[-1],), block.norm1.weight, block.norm1.bias)
        heads, d = att.heads, x.shape[-1] // att.heads

        def split(lin: nn.Linear, h: Tensor = h, heads: int = heads, d: int = d) -> Tensor:
            return (h @ lin.weight.T + lin.bias).view(n, t, heads, d).transpose(1, 2)

        q, k, v = split(att.query), split(att.key), split(att.value)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(n, t, -1)
        x = x + y @ att.proj.weight.T + att.proj.bias
        h = F.layer_norm(x, (x.shape[-1],), block.norm2.weight, block.norm2.bias)
        up, down = block.mlp[0], block.mlp[2]
        assert isinstance(up, nn.Linear) and isinstance(down, nn.Linear)
        x = x + F.gelu(h @ up.weight.T + up.bias) @ down.weight.T + down.bias
    x = F.layer_norm(x, (x.shape[-1],), model.norm.weight, model.norm.bias)
    return x @ model.head.weight.T


def test_forward_matches_the_written_out_decoder() -> None:
    model = _tiny().double()
    tokens = torch.randint(0, 256, (3, 10))
    out = model(tokens)
    assert out.shape == (3, 10, 256)
    torch.testing.assert_close(out, _reference_forward(model, tokens), rtol=1e-10, atol=1e-10)


def test_causal_a_later_token_never_changes_earlier_logits() -> None:
    model = _tiny().double()
    tokens = torch.randint(0, 256, (2, 12))
    base = model(tokens)
    for t in (0, 5, 11):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert (out[:, t:] - base[:, t:]).abs().amax() > 1e-6  # the token does matter


def test_every_weight_matrix_is_preconditioned_once_per_forward() -> None:
    model = _tiny()
    weighted = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert len(weighted) == 2 + 2 * 6 + 1  # embeddings, q k v proj up down per block, head
    calls = dict.fromkeys(weighted, 0)
    for name in weighted:
        model.get_submodule(name).register_forward_hook(
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)
        )
    model(torch.randint(0, 256, (2, 12)))
    assert set(calls.values()) == {1}
    assert list(KFACPreconditioner(model).layers) == weighted


def test_sizes_and_tying() -> None:
    assert _tiny().head.weight is not _tiny().tokens.weight  # untied by default
    tied = _tiny(tie_weights=True)
    assert tied.head.weight is tied.tokens.weight
    with pytest.raises(ValueError, match=r"--width \(30\) must be a multiple of --heads \(4\)"):
        _tiny(width=30)
    with pytest.raises(ValueError, match=r"--layers must be in \[1, 1024\]"):
        _tiny(layers=0)
    with pytest.raises(ValueError, match="13 tokens exceeds the context 12"):
        _tiny()(torch.zeros(1, 13, dtype=torch.long))
    model = build_model("gpt", in_channels=1, image_size=9, num_classes=7, layers=1, width=8)
    assert isinstance(model, GPT) and len(model.blocks) == 1
    assert model(torch.zeros(2, 9, dtype=torch.long)).shape == (2, 9, 7)


def test_residual_projections_are_scaled_down() -> None:
    model = _tiny(layers=8, width=64)
    block = model.blocks[0]
    assert isinstance(block, Block)
    assert float(block.attention.query.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    assert float(block.attention.proj.weight.detach().std()) == pytest.approx(0.02 / 4.0, rel=0.1)


def test_bench_step_builds_a_gpt_batch() -> None:
    args = argparse.Namespace(model="gpt", layers=1, width=8, heads=2, seq_len=6, batch_size=3)
    model, x, y = model_and_batch(args, torch.device("cpu"))
    assert model(x).shape == (3, 6, 256) and y.shape == (3, 6)


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", "0.5"), ("kfac", "0.1")])
def test_a_few_steps_reduce_the_loss(optimizer: str, lr: str, tmp_path: Path) -> None:
    words = b"the quick brown fox jumps over the lazy dog and then some more words ".split()
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (2500,), generator=g).tolist()
    (tmp_path / "tiny.txt").write_bytes(b" ".join(words[i] for i in picks))
    argv = ["train", "--model", "gpt", "--data", "text", "--text-path", str(tmp_path / "tiny.txt")]
    argv += ["--layers", "1", "--width", "16", "--heads", "2", "--seq-len", "16"]
    argv += ["--batch-size", "8", "--steps", "20", "--optimizer", optimizer, "--lr", lr]
    argv += ["--log-every", "1", "--threads", "1", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    first = records[0]
    final = [r for r in records if r["kind"] == "eval"][-1]
    # Small initial logits: the first batch costs about ln 256 nats per byte.
    assert first["loss"] == pytest.approx(math.log(256), abs=0.1)
    assert final["step"] == 20
    assert final["loss"] < first["loss"] - 1.5
