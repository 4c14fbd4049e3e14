"""PACE: pool-aware effective staleness control for asynchronous RL post-training.

Data flow (see docs/design.md §5): ``rollout`` (vLLM thread) → ``reward`` → ``pool`` → ``algo`` (trainer)
→ weight sync back into the rollout engine. Pure math lives in ``staleness``, ``algo.loss``,
``algo.advantages`` and ``reward``; nothing there imports an engine.
"""
