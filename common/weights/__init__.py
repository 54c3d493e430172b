"""Weight sync: the learner's weights into the rollout servers' vLLM engines.

- ``base``: the backend interface (``WeightSender``, ``SendGroup``) and registry
  (``SENDERS``, ``resolve_backend``, ``sender_class``);
- ``gloo``, ``nccl``: one file per backend (the learner's half; the workers' half is vLLM's
  engine of the same name, or ``rollout_service/weight_receiver*.py`` where vLLM has none);
- ``wire``: bucket layout and the fan-out sender, shared by both sides;
- ``source``: ``ModelWeights`` (what is pushed) and ``unwrap``;
- ``publisher``: ``WeightPublisher``, the learner's API.

Only ``base`` is imported here (no torch at import): ``common.weights.resolve_backend`` is
cheap for a process that has only parsed its config. See docs/rollout.md, "Weight sync".
"""

from common.weights.base import AUTO, SENDERS, known_backends, resolve_backend, sender_class

__all__ = ["AUTO", "SENDERS", "known_backends", "resolve_backend", "sender_class"]
