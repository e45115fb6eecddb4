"""The cost model sees what the engine registers on transformers: attention as q, k, v and
out, every weight once, a tied tensor once (the engine's rules, ``blocks/ties.py``)."""

from __future__ import annotations

from torch import nn

from dkfac import KFACPreconditioner
from dkfac.costmodel import extract_layers


def test_an_encoder_layer_is_priced_as_the_engine_registers_it() -> None:
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    spec = extract_layers(layer)
    pre = KFACPreconditioner(layer)
    names = [entry.name for entry in spec.layers]
    assert names == list(pre.layers)
    assert "self_attn.q_proj" in names
    assert [(e.a_dim, e.g_dim) for e in spec.layers][:3] == [(9, 8)] * 3
    assert spec.other_param_numel == 4 * 8  # two LayerNorms' weight and bias


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):  # type: ignore[no-untyped-def]
        return self.head(self.embed(idx))


def test_a_tied_tensor_is_priced_once_by_its_keeper() -> None:
    spec = extract_layers(TiedLM())
    assert [entry.name for entry in spec.layers] == ["head"]
    assert spec.other_param_numel == 0
