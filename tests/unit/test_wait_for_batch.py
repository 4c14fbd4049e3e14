"""train.py's wait for a batch (pace/loop.py): a wait in which groups complete and every one is
filtered says so in one line, and again each `warn_s`; a wait in which any group was pooled (or
rejected) does not. With a stand-in pool whose counts move as given (the 30B rehearsal on vLLM-CPU
filtered 1,468 groups in 9 minutes, its first batch never formed, and said nothing)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pace.loop import wait_for_batch

pytestmark = pytest.mark.unit


class _Pool:
    """form_batch never forms one (until ``release``); each call completes a group, of the fates in turn."""

    def __init__(self, fates: list[str]):
        self.fates, self.calls = fates, 0
        self.c = {"filtered": 0, "pooled": 0, "consumed": 0, "rejected": 0}
        self.release = threading.Event()

    def counts(self):
        return dict(self.c)

    def form_batch(self, step, timeout):
        self.c[self.fates[self.calls % len(self.fates)]] += 1
        self.calls += 1
        return "batch" if self.release.wait(0.02) else None


@pytest.mark.parametrize("fates, warned", [(["filtered"], True), (["filtered", "pooled"], False),
                                           (["filtered", "rejected"], False)])
def test_a_wait_in_which_every_group_is_filtered_says_so(fates, warned, capsys):
    pool = _Pool(fates)
    stop = SimpleNamespace(requested=False)
    threading.Timer(0.75, pool.release.set).start()  # the batch forms after three warn_s
    assert wait_for_batch(pool, SimpleNamespace(check=lambda: None), step=7, stop=stop, warn_s=0.2) == "batch"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: batch 7 not formed")]
    if warned:
        assert 2 <= len(lines) <= 4, lines  # every 0.2 s of 0.75
        assert "groups completed meanwhile was filtered" in lines[0]
    else:
        assert lines == []
