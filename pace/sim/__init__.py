"""A pool-dynamics simulator: the project's own `Pool` and pool policies decide every admission,
rejection and batch, while the vLLM engines, the trainer and the responses are models.

    records.py    SimGroup: a `Group` whose responses keep their token versions as spans
    responses.py  lengths and correctness per prompt (parametric or a run's logged groups); PFS drift
    engine.py     one engine: continuous batching, KV budget and preemption, updates in flight
    run.py        the event loop: engines → pool → trainer → weight sync, metrics per step
    sync.py       a weight sync's seconds and the engines' pause from its bytes (full or delta)
    output.py     the run directory of train.py (metrics.jsonl, groups/*.parquet, summary.json)
    fit.py        `python -m pace.sim.fit <run dir>`: a scenario fitted to a real run's logs
    config.py     the `sim` schema on top of the run's own

`python simulate.py +sim=<scenario> [+exp=<preset>] [overrides]` (docs/simulator.md "Simulating a cluster run").
"""
