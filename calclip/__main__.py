"""``python -m calclip train|demo|diagnose`` (the same entry point as the ``calclip`` script)."""

import sys

from calclip.cli import main

sys.exit(main())
