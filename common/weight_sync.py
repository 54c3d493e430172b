"""Old home of the learner's weight-sync API, now ``common.weights.publisher``.

Kept only so that importers not yet switched (``learner/rl/weight_push.py``,
``learner/controller/rollout_client.py``, ``tests/helpers/rollout_harness.py``) keep working;
delete it once they import ``common.weights.publisher``.
"""

from common.weights.publisher import PushReport, WeightPublisher, WeightSyncError

__all__ = ["PushReport", "WeightPublisher", "WeightSyncError"]
