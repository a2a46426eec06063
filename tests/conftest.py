"""Shared test set-up: the tests folder is importable (helpers such as reference_cases, brute_force)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
