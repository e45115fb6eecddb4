"""Layer blocks: what the Kronecker factors of each module type are."""

from dkfac.blocks.base import Block, Rows
from dkfac.blocks.conv2d import Conv2dBlock
from dkfac.blocks.linear import LinearBlock
from dkfac.blocks.registry import make_block, register_block

__all__ = ["Block", "Conv2dBlock", "LinearBlock", "Rows", "make_block", "register_block"]
