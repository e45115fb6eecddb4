"""dkfac: distributed Kronecker-factored natural-gradient training for PyTorch.

Public API::

    from dkfac import KFACPreconditioner, KFACOptimizer, KFACConfig
"""

from dkfac.blocks import Block, register_block
from dkfac.config import KFACConfig
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

__version__ = "0.1.0"

__all__ = [
    "Block",
    "KFACConfig",
    "KFACOptimizer",
    "KFACPreconditioner",
    "__version__",
    "register_block",
]
