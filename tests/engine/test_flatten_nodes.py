"""The spellings of a flatten that ``flattened_inputs="graph"`` recognises: each found map
is checked against the input the linear layer really reads (the convolution map flattened
channel-major), and the reshapes that do not flatten a map's own rows find none."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from dkfac.engine.roles import flattened_conv_inputs

Flatten = Callable[[Tensor], Tensor]


def _view(x: Tensor) -> Tensor:
    return x.view(x.size(0), -1)


def _reshape_shape(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1)


def _reshape_size_item(x: Tensor) -> Tensor:
    return x.reshape(x.size()[0], -1)


def _view_tuple(x: Tensor) -> Tensor:
    return x.view((x.size(dim=0), -1))


def _torch_reshape(x: Tensor) -> Tensor:
    batch = x.shape[0]
    return torch.reshape(x, (batch, -1))


def _flatten_keyword(x: Tensor) -> Tensor:
    return torch.flatten(x, start_dim=1)


def _flatten_method_keyword(x: Tensor) -> Tensor:
    return x.flatten(start_dim=1, end_dim=-1)


def _flatten_both_positional(x: Tensor) -> Tensor:
    return torch.flatten(x, 1, -1)


class _Net(nn.Module):
    """A convolution (8 channels) pooled to 4×4, flattened by ``flatten``, then a linear
    layer; the map its input really is is recorded by a hook."""

    def __init__(self, flatten: Flatten) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 16, 3)
        self.flatten = flatten

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.flatten(self.pool(torch.relu(self.conv(x)))))


@pytest.mark.parametrize(
    "flatten",
    [
        _view,
        _reshape_shape,
        _reshape_size_item,
        _view_tuple,
        _torch_reshape,
        _flatten_keyword,
        _flatten_method_keyword,
        _flatten_both_positional,
    ],
)
def test_each_spelling_of_a_flatten_finds_the_map_the_layer_reads(flatten: Flatten) -> None:
    model = _Net(flatten)
    assert flattened_conv_inputs(model) == {"fc": (8, 16)}
    seen: dict[str, Tensor] = {}
    model.pool.register_forward_hook(lambda _m, _i, out: seen.update(map=out))
    model.fc.register_forward_hook(lambda _m, inputs, _o: seen.update(read=inputs[0]))
    model(torch.randn(5, 2, 8, 8))
    # the layer reads each sample's 8-channel map of 4×4 positions, channel-major
    assert seen["map"].shape == (5, 8, 4, 4)
    assert torch.equal(seen["read"], seen["map"].reshape(5, 8, 16).reshape(5, 128))


class _Frames(nn.Module):
    """Frames ``(B·T, C, H, W)`` regrouped per clip by a batch size read off the input:
    the linear layer reads ``T·C·H·W`` features, time-major, not a ``C``-channel map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 16, 2)

    def forward(self, clips: Tensor) -> Tensor:
        batch = clips.shape[0]
        frames = self.conv(clips.flatten(0, 1))
        return self.fc(frames.view(batch, -1))


def _permuted(x: Tensor) -> Tensor:
    return x.permute(0, 2, 3, 1).reshape(x.size(0), -1)  # position-major


def _rows_by_features(x: Tensor) -> Tensor:
    return x.view(-1, 8 * 16)  # rows are not read off the map: no proof they are samples


def _partial(x: Tensor) -> Tensor:
    return torch.flatten(x, 1, 2).flatten(1)  # a flatten of a flatten: not the map's


@pytest.mark.parametrize("flatten", [_permuted, _rows_by_features, _partial])
def test_reshapes_that_do_not_flatten_the_maps_own_rows_find_none(flatten: Flatten) -> None:
    assert flattened_conv_inputs(_Net(flatten)) == {}


def test_rows_read_off_another_tensor_find_none() -> None:
    model = _Frames()
    assert model(torch.randn(2, 3, 2, 4, 4)).shape == (2, 2)
    assert flattened_conv_inputs(model) == {}
