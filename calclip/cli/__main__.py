"""``python -m calclip.cli train|demo|diagnose|compare`` and ``accelerate launch -m calclip.cli train ...``."""

import sys

from calclip.cli import main

sys.exit(main())
