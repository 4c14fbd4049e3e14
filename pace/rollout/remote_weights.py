"""Weight updates of the rollout servers over vLLM's RL routes: a mixin of `RemoteFleet`
(pace/rollout/remote.py): the weight calls of the `Fleet` interface (pace/rollout/fleet.py), whose
`update` and `end_update` run them in the same sequence as for the engines in this host.

Each update: `/pause?mode=keep` (requests in flight keep their KV), vLLM's `HTTPVLLMWeightSyncClient`
(`/start_weight_update`, `/update_weights` while trainer rank 0 broadcasts, `/finish_weight_update`),
the reload checks of pace/weights/reload.py and the weight fingerprints of pace/weights/fingerprint.py through
`/collective_rpc`, the version label through `/update_weight_version`, `/resume`. Every call goes
to every server in the weight-transfer group at once (those serving, a joiner being caught up, a
draining one: pace/rollout/healing.py): the broadcast is a collective over the trainer and every
server's workers.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pace.errors import EngineFailed
from pace.rollout.server_state import DRAINING, JOINING, LEFT, READY

WEIGHT_CALL_TIMEOUT_S = 1800.0  # the transfer calls of a fleet built without `rollout.update_timeout_s`
# The transfer calls (the rendezvous, update_weights, finish_weight_update) wait for the broadcast: each
# gets `rollout.update_timeout_s` (the update's deadline; a server frozen inside it is failed then). The
# other calls (pause, resume, the version label, the reload check) return in seconds; one that takes
# `rollout.engine_timeout_s` fails its server. A server whose engine behind it has died can answer /health
# and hang here (vLLM's data-parallel API server with a dead headless engine does: README).


class RemoteWeightsMixin:
    def _each(self, call, what: str) -> list:
        """``call(server)`` on every server in the weight-transfer group at once (a collective over the servers' workers and
        the trainer returns on none of them until it runs on all); the results of those that
        answered. A server that cannot be reached or answers with a server error has failed: it is
        taken out (`take_failures` reports it; the weight-transfer group is formed again without it
        before the broadcast). A refused call (HTTP 4xx) raises EngineFailed naming the server."""
        import requests

        servers = [s for s in self.servers if s.in_group]

        def timed(s):
            t0 = time.perf_counter()
            s.calling, s.answered = True, True
            try:
                return call(s)
            except (requests.ConnectionError, requests.Timeout):
                s.answered = False  # unreachable, or no answer within its timeout (wait_failed: to blame first)
                raise
            finally:
                s.calling = False
                s.sync_s += time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=max(len(servers), 1), thread_name_prefix="pace-weights") as pool:
            futures = [pool.submit(timed, s) for s in servers]
            results = []
            for s, f in zip(servers, futures):
                try:
                    results.append(f.result())
                except (requests.ConnectionError, requests.Timeout) as exc:
                    self._fail(s, f"{what}: {type(exc).__name__}")
                except requests.HTTPError as exc:
                    text = " ".join(exc.response.text.split())[:300] if exc.response is not None else ""  # one line
                    if exc.response is not None and exc.response.status_code >= 500:
                        self._fail(s, f"{what}: {exc} {text}")
                        continue
                    raise EngineFailed(f"rollout engine {s.index} ({s.url}): {what} refused: {exc} {text}") from exc
        return results

    @staticmethod
    def _post(s, path: str, body: dict | None = None, params: dict | None = None, timeout: float = WEIGHT_CALL_TIMEOUT_S):
        import requests

        r = requests.post(s.url + path, json=body, params=params, timeout=timeout)
        r.raise_for_status()
        return r.json() if r.content else None

    def _client(self, s, timeout: float | None = None):
        """vLLM's HTTP client of server ``s``; its calls time out at ``timeout`` (default: the update's deadline)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(s.url, timeout=self.update_timeout_s if timeout is None else timeout)

    def transfer_workers(self) -> int:
        """Weight-transfer ranks of the servers in the group."""
        return sum(s.workers for s in self.servers if s.in_group)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every server in the group joins the weight-transfer group; with ranks (NCCL, gloo), server
        s's workers after those of the servers before it (pace/rollout/fleet.py). The servers that
        left release their engine; outside an update so do the others first, of an earlier group or
        an earlier run (vLLM's `init_weight_transfer_engine` replaces an engine without closing it:
        on a GPU, an NCCL communicator per regroup)."""
        self._init_info = dict(init_info)
        self._lost = False  # a member failing from here on forms it again at the next update
        self.release_engines()
        group = [s for s in self.servers if s.in_group]
        infos, offset = {}, init_info.get("rank_offset")
        for s in group:
            infos[s.index] = dict(init_info)
            if offset is not None:
                infos[s.index]["rank_offset"] = offset
                offset += s.workers
        quiet = not self._updating
        for s in group:  # a worker in the rendezvous does not step: no output is not a stall
            s.paused = True
        try:
            self._each(lambda s: self._client(s).init_weight_transfer_engine(infos[s.index]), "init_weight_transfer_engine")
        finally:
            for s in group:
                s.grouped = True
                if quiet:
                    s.paused, s.last_output = False, time.monotonic()

    def group_members(self) -> list[int]:
        return [s.index for s in self.servers if s.in_group]

    def release_engines(self) -> None:
        """The servers that left release their engine (and go: stopped if this run started them);
        outside an update every member releases its engine too (safe to repeat: none is released)."""
        self._release_left()
        if not self._updating:  # a server may hold one of an earlier group, or of an earlier run
            self._each(self._release, "shutdown_weight_transfer_engine")

    def _release_left(self) -> None:
        for s in self.servers:
            if s.state == LEFT and s.grouped:  # drained: it goes (a server this run started is stopped)
                s.grouped = False
                try:
                    self._release(s)
                except Exception:  # noqa: BLE001 - it leaves either way
                    pass
                if s.process is not None:
                    threading.Thread(target=s.process.kill, daemon=True).start()
                print(f"rollout engine {s.index} ({s.url}) left the fleet", file=sys.stderr, flush=True)

    def begin_update(self) -> None:
        def begin(s):
            s.paused = True
            # clear_cache with "keep": vLLM preempts the running requests (KV dropped, prefilled again
            # under the new weights at /resume) and empties the prefix cache
            clear = "true" if self.reprefill_on_update else "false"
            self._post(s, "/pause", params={"mode": "keep", "clear_cache": clear}, timeout=self.engine_timeout_s)
            self._client(s, self.engine_timeout_s).start_weight_update()

        self._admit_groupless()
        self._updating = True
        try:
            self._each(begin, "start_weight_update")
        except BaseException:
            self._resume()
            raise

    def _admit_groupless(self) -> None:
        """A backend without a group (shm: a file each server reads): a ready server joins at any
        update, with the engine the others have."""
        if self._init_info is None or "world_size" in self._init_info:
            return  # nccl, gloo: admitted when the group is formed again (regroup_due)
        for s in self.servers:  # a drained server leaves here (no group to form again)
            with self._lock:
                if s.state == DRAINING and s.drained:
                    s.state = LEFT
        self._release_left()
        for s in [s for s in self.servers if s.state == READY]:
            try:
                self._client(s, self.engine_timeout_s).init_weight_transfer_engine(self._init_info)
                if self._fingerprinting:
                    self._post(s, "/collective_rpc", {"method": "pace_fingerprint_updates"}, timeout=self.engine_timeout_s)
            except Exception as exc:  # noqa: BLE001 - it failed, not the update
                self._fail(s, f"init_weight_transfer_engine: {type(exc).__name__}")
                continue
            with self._lock:
                if s.state == READY:
                    s.state, s.grouped = JOINING, True

    def load(self, update_info: dict) -> None:
        self._each(lambda s: self._client(s).update_weights(update_info), "update_weights")

    def _finish_update(self) -> None:
        self._each(lambda s: self._client(s).finish_weight_update(), "finish_weight_update")

    def _update_failures(self) -> list:
        """The reload checks of the servers in service; a joiner whose check failed is failed
        (brought back again: pace/rollout/healing.py), not the update."""
        from pace.weights.reload import split_reports

        joining = set(self.joining())
        failures = []
        for i, found in self._rpc_by_server("pace_weight_update_failure", "the reload check").items():
            found = [f for f in found if f]
            failed, _ = split_reports(found)  # a catch-up is whole: only a failure fails the joiner
            if i in joining and failed:
                self._fail(self.servers[i], f"its catch-up update did not load: {failed[0]}")
            else:
                failures += found
        return failures

    def _resume(self) -> None:
        def resume(s):
            self._post(s, "/resume", timeout=self.engine_timeout_s)
            s.paused = False
            s.last_output = time.monotonic()

        try:
            self._each(resume, "resume")
        finally:
            self._updating = False

    def _rpc_by_server(self, method: str, what: str) -> dict[int, list]:
        """``method`` of pace/weights/transfer.py's `WorkerExtension` on the workers of every server in
        the group: each answering server's results, by its index."""
        out = {}

        def call(s):
            out[s.index] = (self._post(s, "/collective_rpc", {"method": method}, timeout=self.engine_timeout_s) or {}
                            ).get("results", [])

        self._each(call, what)
        return out

    def _rpc(self, method: str, what: str) -> list:
        return [r for results in self._rpc_by_server(method, what).values() for r in results]

    def fingerprint_updates(self) -> None:
        self._fingerprinting = True
        self._rpc("pace_fingerprint_updates", "the fingerprint switch")

    def fingerprints(self) -> list:
        """Each server's workers' fingerprints of their last update (pace/weights/fingerprint.py)."""
        return self._rpc("pace_weight_fingerprint", "the weight fingerprints")

    def weights_reloaded(self) -> dict[int, bool]:
        """Each answering server in the group: whether its served model has loaded an update since it
        started (a server that served an earlier run, or this run before a resume, has)."""
        return {i: any(r["reloaded"] for r in found)
                for i, found in self._rpc_by_server("pace_weights_reloaded", "the reload probe").items()}

    def fingerprints_by_engine(self) -> dict[int, list]:
        """`fingerprints`, by server index (a joiner is judged on its own: pace/rollout/worker.py)."""
        return self._rpc_by_server("pace_weight_fingerprint", "the weight fingerprints")

    def set_version(self, version: int) -> None:
        self._each(lambda s: self._post(s, "/update_weight_version", {"new_version": str(version)},
                                           timeout=self.engine_timeout_s), "update_weight_version")
        self.version = version

    def sync_seconds(self) -> dict[int, float]:
        """Seconds each server has spent in weight-update calls (summed over the run)."""
        return {s.index: s.sync_s for s in self.servers}


