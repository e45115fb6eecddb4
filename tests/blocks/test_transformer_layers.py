"""nn.TransformerEncoderLayer and nn.TransformerDecoderLayer: K-FAC gives them exactly the
update of hand-written twins whose attentions are four nn.Linear layers (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dkfac import KFACPreconditioner
from tests.blocks.twins import (
    TwinDecoderLayer,
    TwinEncoderLayer,
    assert_same_attention,
    train_with_kfac,
)

E, H, FF, N, L, S = 8, 2, 12, 3, 4, 5


class Net(nn.Module):
    """A transformer layer then a Linear head on the mean over positions."""

    def __init__(self, layer: nn.Module, batch_first: bool) -> None:
        super().__init__()
        self.layer, self.batch_first = layer, batch_first
        self.head = nn.Linear(E, 3).double()

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
        """``x``, ``memory`` batch-first; the layer gets its own layout."""
        if not self.batch_first:
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        if isinstance(self.layer, nn.TransformerDecoderLayer):
            y = self.layer(x, memory, tgt_mask=mask)
        elif isinstance(self.layer, nn.TransformerEncoderLayer):
            y = self.layer(x, src_mask=mask)
        elif isinstance(self.layer, TwinDecoderLayer):
            y = self.layer(x, memory, mask)
        else:
            y = self.layer(x, mask)
        y = y if self.batch_first else y.transpose(0, 1)
        return self.head(y).mean(dim=1)


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
@pytest.mark.parametrize(
    ("decoder", "norm_first", "batch_first"),
    [(False, False, True), (False, True, False), (True, False, False), (True, True, True)],
)
def test_transformer_layer_update_equals_twin(
    method: str, decoder: bool, norm_first: bool, batch_first: bool
) -> None:
    torch.manual_seed(0)
    kind = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    layer = kind(E, H, FF, dropout=0.0, batch_first=batch_first, norm_first=norm_first).double()
    with torch.no_grad():  # torch starts the attention biases at zero; make them matter
        for name, param in layer.named_parameters():
            if name.endswith("in_proj_bias") or name.endswith("out_proj.bias"):
                param.normal_()
    twin_layer = (TwinDecoderLayer if decoder else TwinEncoderLayer)(layer)  # type: ignore[arg-type]
    net, twin = Net(layer, batch_first), Net(twin_layer, batch_first)
    twin.head.load_state_dict(net.head.state_dict())
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    data = [
        (
            torch.randn(N, L, E, dtype=torch.float64),
            torch.randn(N, S, E, dtype=torch.float64),
            mask,
            torch.randint(0, 3, (N,)),
        )
        for _ in range(3)
    ]
    pre, twin_pre = train_with_kfac(net, method, data), train_with_kfac(twin, method, data)
    attentions = ["self_attn", "multihead_attn"] if decoder else ["self_attn"]
    expected = [
        f"layer.{attn}.{proj}_proj" for attn in attentions for proj in ("q", "k", "v", "out")
    ]
    assert list(pre.layers) == [*expected, "layer.linear1", "layer.linear2", "head"]
    assert set(twin_pre.layers) == set(pre.layers)
    for attn in attentions:
        assert_same_attention(getattr(layer, attn), getattr(twin_layer, attn))
    for name in ("linear1", "linear2"):
        want = getattr(twin_layer, name).weight
        torch.testing.assert_close(getattr(layer, name).weight, want, rtol=0, atol=1e-10)
    twin_factors = twin_pre.factors()
    for name, (a, g) in pre.factors().items():
        torch.testing.assert_close(a, twin_factors[name][0], rtol=0, atol=1e-10, msg=name)
        torch.testing.assert_close(g, twin_factors[name][1], rtol=0, atol=1e-10, msg=name)
    inner = {row["name"] for row in pre.describe() if row["block"] == "inner optimizer"}
    norms = [f"layer.norm{i}" for i in range(1, 4 if decoder else 3)]
    assert inner == {f"{n}.{p}" for n in norms for p in ("weight", "bias")}


def test_eval_forward_of_a_registered_encoder_is_the_module_own() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=True).double()
    x = torch.randn(N, L, E, dtype=torch.float64)
    layer.eval()
    with torch.no_grad():
        before = layer(x)
    KFACPreconditioner(layer)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
