"""A fleet of rollout servers that heals and grows: a mixin of `RemoteFleet` (pace/rollout/remote.py).

Replacement. A server that failed (remote.py's `_fail`; its requests already moved by the rollout
thread: pace/rollout/failover.py) is brought back after a backoff of `rollout.restart_backoff_s`·2^k
(at most a minute), k its restarts so far:
- one this run started is started again once its old process group is gone (the engine core's
  memory free): the same flags, seed, GPUs and log (appended to), on a new port;
- one given by URL (`rollout.servers`) is probed until it answers `/health` three times in a row,
  then cleaned: resumed if it was left paused, whatever it still runs aborted, its old
  weight-transfer engine released.
`rollout.max_engine_restarts` bounds the restarts of the whole run (a crash loop stops there, with
one line; the run goes on with the engines it has).

Growth. `join(url)` registers a server started by hand (scripts/launch_rollout_server.sh with
`JOIN=`, or `python -m pace.rollout.fleetctl join URL`), probed like a returning one; one on another
host is refused while the weight-transfer group meets rank 0 on the loopback
(`RemoteFleet.transfer_address`). `drain(i)` takes no new groups to server i, lets its requests
finish (after `rollout.drain_timeout_s` the rest move to the others as a failed server's do), and has
it leave at the next update: its weight-transfer engine released, stopped if this run started it,
left running otherwise.

Admission: nothing enters the weight-transfer group between updates. A server ready to join waits
for the next weight update, where the one group of trainer rank 0 and every engine worker is
formed again with it (`regroup_due`, before the update starts: the survivors' previous engines are
released first, so a GPU keeps one NCCL communicator, not one per regroup). That update sends θ
whole to every rank (the group is new: pace/weights/delta.py), the joiner is checked with the
others (the reload check of pace/weights/reload.py and, with `trainer.sync_fingerprint`, its weight
fingerprints, judged on their own), labelled with the version, and only then `promote`d to serving
by the rollout thread. A joiner whose check fails is failed (and brought back again), not the run.
One group formed again rather than a group per server: vLLM 0.32's groups have a fixed size
(`StatelessProcessGroup`, an NCCL communicator), so either design re-initialises at a join, but one
group keeps a single broadcast per update, where per-server groups would send θ once per server
at every full sync (docs/weight-sync.md).
"""
from __future__ import annotations

import asyncio
import sys
import time

from pace.rollout.server_state import DEAD, DRAINING, JOINING, LEFT, READY, SERVING, STARTING, EngineFailure, Server, world_size

MAX_BACKOFF_S = 60.0
PROBE_INTERVAL_S = 2.0
PROBE_OKS = 3  # /health answers in a row that make a probed server ready


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class HealingMixin:
    # --- replacement (the fleet's event loop) ---------------------------------------------
    async def _revive(self, server, cause: str) -> None:
        if server.process is not None:
            await asyncio.to_thread(server.process.kill)
        while not self._closing:
            with self._lock:
                spent = self.restarts >= self.max_restarts
                if not spent:
                    self.restarts += 1
                    server.restarts += 1
                    server.state = STARTING
            if spent:
                _say(f"warning: rollout engine {server.index} ({server.url}): restart budget spent "
                     f"(rollout.max_engine_restarts={self.max_restarts}; it failed: {cause}); going on with "
                     f"{len(self.alive)} engine(s)")
                return
            await asyncio.sleep(min(self.restart_backoff_s * 2 ** (server.restarts - 1), MAX_BACKOFF_S))
            try:
                if server.process is not None:
                    await self._start_again(server)
                else:
                    await self._probe(server, deadline=None)
                what = "started again" if server.process is not None else "answers again"
            except Exception as exc:  # noqa: BLE001 - one failed restart: the next one, or the budget line
                if self._closing:
                    return
                cause = f"restart {server.restarts} failed: {str(exc)[:300]}"
                _say(f"warning: rollout engine {server.index} ({server.url}): {cause}")
                if server.process is not None:
                    await asyncio.to_thread(server.process.kill)
                server.state = DEAD
                continue
            self._ready(server, f"{what} (restart {server.restarts} of at most {self.max_restarts})")
            return

    async def _start_again(self, server) -> None:
        old = server.process
        deadline = time.monotonic() + 60.0
        while not old.gone():  # its engine core too: on a GPU its memory must be free first
            if time.monotonic() > deadline:
                raise RuntimeError(f"its old processes (group {old.proc.pid}) did not exit")
            await asyncio.sleep(0.1)
        if self._closing:
            return
        proc = old.respawn()  # here, not in a thread: shutdown() (which stops `server.process`) cannot miss it
        server.process, server.url = proc, proc.url
        await asyncio.to_thread(proc.wait_ready, time.monotonic() + self.start_timeout_s)
        server.workers = await asyncio.to_thread(world_size, server.url, f"rollout engine {server.index}")

    async def _probe(self, server, deadline: float | None) -> None:
        """Until ``server`` answers /health `PROBE_OKS` times in a row (or ``deadline``), then cleaned."""
        import aiohttp

        oks = 0
        while oks < PROBE_OKS:
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"no answer to /health within rollout.server_start_timeout_s={self.start_timeout_s:g}")
            await asyncio.sleep(PROBE_INTERVAL_S if oks == 0 else 0.5)
            try:
                async with self._session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    oks = oks + 1 if r.status == 200 else 0
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                oks = 0
        server.workers = await asyncio.to_thread(world_size, server.url, f"rollout engine {server.index}")
        await asyncio.to_thread(self._clean, server)

    def _clean(self, server) -> None:
        """A server that comes (back) from outside this run's hands: nothing paused, running or
        connected that this run did not start now."""
        import requests

        while self._updating:  # it may still be a rank of the broadcast under way: no finish or release now
            time.sleep(0.2)
        if requests.get(server.url + "/is_paused", timeout=30).json().get("is_paused"):
            self._post(server, "/resume", timeout=self.engine_timeout_s)
        self._post(server, "/abort_requests", {}, timeout=self.engine_timeout_s)
        self._release(server)

    def _release(self, server) -> None:
        """Its weight-transfer engine released (an update left unfinished is finished first: the
        next update overwrites what it loaded). A server with none: nothing happens."""
        import requests

        try:
            self._post(server, "/shutdown_weight_transfer_engine", timeout=self.engine_timeout_s)
        except requests.HTTPError:  # an update in progress (500): finished, then released
            self._post(server, "/finish_weight_update", timeout=self.engine_timeout_s)
            self._post(server, "/shutdown_weight_transfer_engine", timeout=self.engine_timeout_s)

    def _ready(self, server, what: str) -> None:
        with self._lock:
            if self._closing or server.state != STARTING:
                return
            server.state, server.grouped, server.paused = READY, False, False
        _say(f"rollout engine {server.index} ({server.url}) {what} at θ_{self.version}: it joins at the next weight update")
        asyncio.ensure_future(self._watch(server))

    # --- growth (any thread: the control endpoint, tests) ---------------------------------
    def join(self, url: str) -> int:
        """Register a running server (http://host:port); its engine index. It joins at the next
        weight update once it answers. ValueError if it is in the fleet already, or if it is on another
        host while the weight-transfer group meets rank 0 on the loopback (the run's servers all on
        this host, `rollout.transfer_address` unset): its rendezvous there would time out inside the
        regroup, outside the broadcast's recovery, and end the run."""
        from urllib.parse import urlparse

        from pace.net import is_loopback

        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"join: {url!r} is not a URL (http://host:port)")
        if is_loopback(self.transfer_address) and not is_loopback(urlparse(url).hostname):
            raise ValueError(f"join: {url} is not on this host, and the servers of this run reach trainer rank 0 for "
                             f"the weight transfer at {self.transfer_address}: a server on another host joins a run "
                             f"started with rollout.transfer_address=<the address other hosts reach trainer rank 0 at> "
                             f"(one on this host joins as http://127.0.0.1:PORT)")
        with self._lock:
            if self._closing:
                raise ValueError("join: the run is stopping")
            same = [s for s in self.servers if s.url == url and s.state not in (DEAD, LEFT)]
            if same:
                raise ValueError(f"join: {url} is rollout engine {same[0].index} already ({same[0].state})")
            server = Server(len(self.servers), url, state=STARTING, since=time.monotonic())
            self._load.append(0)
            self.servers.append(server)
        _say(f"rollout engine {server.index} ({url}) registered: it joins at the next weight update once it answers")
        asyncio.run_coroutine_threadsafe(self._admit_new(server), self._loop)
        return server.index

    async def _admit_new(self, server) -> None:
        try:
            await self._probe(server, deadline=time.monotonic() + self.start_timeout_s)
        except Exception as exc:  # noqa: BLE001 - an operator's server that never answered: one line
            server.state = DEAD
            _say(f"warning: rollout engine {server.index} ({server.url}) not admitted: {str(exc)[:300]}")
            return
        self._ready(server, "answers")

    def drain(self, index: int) -> None:
        """Server ``index`` takes no new groups; it leaves at the first update after its requests
        finished (or moved, at `rollout.drain_timeout_s`). ValueError for one not serving, or the last."""
        with self._lock:
            if not 0 <= index < len(self.servers):
                raise ValueError(f"drain: no rollout engine {index} (engines 0..{len(self.servers) - 1})")
            server = self.servers[index]
            if server.state != SERVING:
                raise ValueError(f"drain: rollout engine {index} is {server.state}, not serving")
            if len(self.alive) == 1:
                raise ValueError(f"drain: rollout engine {index} is the last one serving")
            server.state, server.leaving = DRAINING, True
        _say(f"rollout engine {index} ({server.url}) draining: no new groups; it leaves at the first weight update "
             f"after its {self._load[index]} requests finish")
        asyncio.run_coroutine_threadsafe(self._drain(server), self._loop)

    async def _drain(self, server) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self._load[server.index] > 0 and server.state == DRAINING and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        with self._lock:
            if server.state != DRAINING:
                return  # failed meanwhile
            if self._load[server.index] > 0:  # moved as a failed server's are (counted the same)
                self._failures.append(EngineFailure(server.index, server.url, "its requests did not finish within "
                                                    f"rollout.drain_timeout_s={self.drain_timeout_s:g}", drained=True))
            server.drained = True
        self._out.put(None)

    def describe(self) -> list[dict]:
        """Each server: index, url, state, restarts, requests in flight, whether this run started it."""
        return [{"index": s.index, "url": s.url, "state": s.state, "restarts": s.restarts,
                 "requests": self._load[s.index], "started_by_run": s.process is not None} for s in list(self.servers)]

    # --- admission (the weight sync, then the rollout thread) ------------------------------
    def regroup_due(self, admit: bool) -> bool:
        """Trainer rank 0, at the start of a weight update: whether the weight-transfer group must be
        formed again: a rank failed, and (``admit``: before the engines pause) a server is ready to
        join (it becomes a joiner: in the group, no requests) or a drained one leaves."""
        with self._lock:
            due = self._lost
            if admit:
                for s in self.servers:
                    if s.state == READY:
                        s.state, due = JOINING, True
                    elif s.state == DRAINING and s.drained:
                        s.state, due = LEFT, True
            return due

    def joining(self) -> list[int]:
        return [s.index for s in self.servers if s.state == JOINING]

    def promote(self, index: int) -> float | None:
        """Rollout thread, after the update that caught joiner ``index`` up was checked: it takes
        requests. The seconds since it failed (or was registered); None if it is not a joiner."""
        with self._lock:
            server = self.servers[index]
            if server.state != JOINING:
                return None
            server.state, server.last_output = SERVING, time.monotonic()
        _say(f"rollout engine {index} ({server.url}) serves again: caught up with θ_{self.version}")
        return time.monotonic() - server.since

    def fail_engine(self, index: int, cause: str) -> None:
        self._fail(self.servers[index], cause)
