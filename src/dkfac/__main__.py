"""``python -m dkfac``: the training program (see :mod:`dkfac.app.cli`)."""

from dkfac.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
