"""``muon_float32.patch()`` for the probes that import it: ``--muon-dtype float32``'s patch.

The benchmarks take ``--muon-dtype float32`` (:mod:`dkfac.bench.muon_precision`); this module
keeps the name the probes import.
"""

from __future__ import annotations

from dkfac.bench.muon_precision import float32_newton_schulz, use_float32_muon

__all__ = ["float32_newton_schulz", "patch"]

patch = use_float32_muon
