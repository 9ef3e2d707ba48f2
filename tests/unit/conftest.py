from __future__ import annotations

import sys
from pathlib import Path

# Let unit tests import the capture helper beside them.
sys.path.insert(0, str(Path(__file__).parent))
