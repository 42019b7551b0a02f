"""Scoring completions: what ``prefpack score`` reads (``rows``), the scorers behind one interface (``scorers``: a
reward function; ``reward_model``: a sequence-classification model), the pairs drawn from scored samples
(``pairs``), the checkpoints that make a run resumable (``partial``), what it writes (``output``) and the run itself
(``run``). The on-policy rounds call ``Scorer.score`` and ``pairs`` directly."""
