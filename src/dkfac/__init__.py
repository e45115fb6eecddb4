"""dkfac: distributed Kronecker-factored natural-gradient training for PyTorch.

Public API::

    from dkfac import KFACOptimizer, KFACPreconditioner, KFACConfig
    from dkfac import Block, register_block  # a layer type of your own

Start with ``KFACOptimizer.for_model(model)``, the recommended default; every option is a
field of ``KFACConfig`` (docs/options.md).
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
