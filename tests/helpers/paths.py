"""Where things are, for tests at any depth under tests/ (unit/<package>/, e2e/)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
