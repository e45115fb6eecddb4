"""Low-rank (Sherman–Morrison–Woodbury, SKFAC) factors and their solver."""
