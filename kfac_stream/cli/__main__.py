"""``python -m kfac_stream.cli``: the ``kfac-stream`` command."""

import sys

from . import main

sys.exit(main())
