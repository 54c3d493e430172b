"""``reward_first_char_parity`` made slow: each call sleeps ``RAYLESS_TEST_REWARD_SLEEP_S``
seconds first (default 0.5), so the data side (generate + score) is the slow one in a test."""

import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_parity", Path(__file__).with_name("reward_first_char_parity.py"))
_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parity)


def reward_func(queries, prompts, labels, **kwargs):
    time.sleep(float(os.environ.get("RAYLESS_TEST_REWARD_SLEEP_S", "0.5")))
    return _parity.reward_func(queries, prompts, labels, **kwargs)
