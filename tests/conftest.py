"""Suite-wide setup. Helpers shared by several test folders live in tests/support (put on
sys.path here; the repo root itself stays off it, so `operator` is always the standard library)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))
