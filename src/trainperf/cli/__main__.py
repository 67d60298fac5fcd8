"""``python -m trainperf.cli``: the ``trainperf`` command."""

import sys

from . import main

sys.exit(main())
