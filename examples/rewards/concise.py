"""An example reward function for `prefpack score --reward-fn examples/rewards/concise.py:reward`: a verifier-style
score with no model. It prefers replies that answer in few words and do not refuse. Replace it with your own check
(an exact-match answer, a unit test run, a regular expression): prefpack imports this file only when --reward-fn
names it."""


def reward(prompt: str, completion: str, row: dict) -> float:
    """Higher is better. `row` is the input row (passthrough fields such as a reference answer or label)."""
    words = len(completion.split())
    text = completion.lower().replace("\u2019", "'")  # hh-rlhf writes most apostrophes curly: "I’m sorry"
    refusal = any(w in text for w in ("i can't", "i cannot", "i'm sorry", "i am sorry"))
    return -0.01 * words - (1.0 if refusal else 0.0)
