"""Faults a rehearsal injects into the rollout servers its run started (rank 0; `rehearsal.*`): the two
ways a healthy-looking server has hung a run that only a running run can show.

- **A slowed server** (`rehearsal.slow_engine`): while the rollout thread validates (θ_`slow_version`,
  or any version), that server's engine core is stopped and continued (SIGSTOP, SIGCONT) so that it runs `slow_factor`× slower:
  it goes on making tokens, but its validation requests (n = k, returned whole) take longer than
  `rollout.engine_timeout_s`. Its API server keeps answering /health and /metrics.
- **A blocked broadcast** (`rehearsal.block_update`): as the weight update to that version starts its
  transfer, the engine core of server `block_engine` is frozen (SIGSTOP, never continued): its
  API server answers /health, its update call never returns, its rank of the transfer group never
  receives, as a GPU whose NCCL kernel waits on a dead peer.

Only the engine core processes are stopped (every process of the server's process group but its API
server, the group's leader: pace/rollout/server.py). What was stopped is continued at `close` (a
SIGKILL at the run's end needs none, but a stopped process holds its memory until then).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

# One stop-and-continue cycle of the slowed engine: it runs 1/slow_factor of each second (200: 5 ms, about one
# engine step a second: a 60-token response took 54 s on this CPU, 0.4 s unslowed). A shorter cycle slows it
# less than its factor: the tiny model's steps are so cheap that the windows' overheads dominate
PERIOD_S = 1.0


def engine_cores(leader: int) -> list[int]:
    """The processes of ``leader``'s process group but itself (a server's engine core, its helpers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == leader:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == leader:  # pgrp (the fifth field of stat; the third after the command)
            pids.append(int(entry))
    return pids


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Faults:
    """The faults `rehearsal` asks for, on ``fleet`` (a `RemoteFleet` whose servers this run started)
    driven by ``rollout`` (its `validating` flag). `start` after the rollout thread starts; `close` at the end."""

    def __init__(self, rehearsal, fleet, rollout, resumed_at: int | None = None):
        self.cfg, self.fleet, self.rollout = rehearsal, fleet, rollout
        self.stopped: set[int] = set()  # frozen for good (the blocked broadcast)
        self.slowed_s = 0.0  # seconds the slowed engine spent stopped
        self._closing = threading.Event()
        self._thread = None
        # a run resumed at or past the frozen update is the operator's answer to it: it happened once
        if rehearsal.block_update is not None and (resumed_at is None or resumed_at < rehearsal.block_update):
            self._wrap_load()

    @classmethod
    def of(cls, cfg, fleet, rollout, resumed_at: int | None = None) -> "Faults | None":
        """The faults of a run (None: none asked for); ``resumed_at``: the version a resumed run starts from."""
        r = cfg.rehearsal
        if not r.enabled or (r.slow_engine is None and r.block_update is None):
            return None
        servers = getattr(fleet, "servers", None)
        if servers is None or any(s.process is None for s in servers):
            from pace.errors import ConfigError

            raise ConfigError("rehearsal.slow_engine / rehearsal.block_update act on servers this run starts: "
                              "rollout.engine_process=server with rollout.servers=[]")
        return cls(r, fleet, rollout, resumed_at)

    def _leader(self, engine: int) -> int:
        return self.fleet.servers[engine].process.proc.pid

    def _wrap_load(self) -> None:
        load = self.fleet.load

        def load_with_fault(update_info: dict) -> None:
            if update_info.get("version") == self.cfg.block_update and not self.stopped:
                cores = engine_cores(self._leader(self.cfg.block_engine))
                _signal(cores, signal.SIGSTOP)
                self.stopped.update(cores)
                print(f"rehearsal: rollout engine {self.cfg.block_engine}'s engine core frozen (SIGSTOP) as the update "
                      f"to θ_{self.cfg.block_update} starts its transfer", file=sys.stderr, flush=True)
            return load(update_info)

        self.fleet.load = load_with_fault  # the instance's: what the weight sync's client calls

    def start(self) -> None:
        if self.cfg.slow_engine is not None:
            self._thread = threading.Thread(target=self._slow, name="pace-rehearsal-slow", daemon=True)
            self._thread.start()

    def _slow(self) -> None:
        """While the rollout validates: each `PERIOD_S`, the engine core runs 1/slow_factor of it (its
        processes listed once a second: reading /proc while they run would run them longer)."""
        run = PERIOD_S / max(self.cfg.slow_factor, 1.0)
        said, cores, listed = False, [], 0.0
        while not self._closing.is_set():
            validating = self.rollout.validating
            if validating is None or self.cfg.slow_version not in (None, validating):
                time.sleep(0.01)
                continue
            if not said:
                said = True
                print(f"rehearsal: rollout engine {self.cfg.slow_engine} slowed {self.cfg.slow_factor:g}x while it "
                      f"validates θ_{validating} (its engine core stopped and continued)", file=sys.stderr, flush=True)
            if time.monotonic() - listed > 1.0:  # a server started again has other processes
                cores, listed = engine_cores(self._leader(self.cfg.slow_engine)), time.monotonic()
            _signal(cores, signal.SIGSTOP)
            self._closing.wait(PERIOD_S - run)
            self.slowed_s += PERIOD_S - run
            _signal(cores, signal.SIGCONT)
            time.sleep(run)

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(2.0)
        _signal(sorted(self.stopped), signal.SIGCONT)
