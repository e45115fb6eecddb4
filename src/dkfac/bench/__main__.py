"""``python -m dkfac.bench <name> ...``."""

import sys

from dkfac.bench import main

sys.exit(main())
