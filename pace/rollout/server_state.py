"""One rollout server of a `RemoteFleet` (pace/rollout/remote.py) as the fleet tracks it: its state,
and what a failure reports.

    serving ──fail──▶ dead ──revive──▶ starting ──up──▶ ready ──next update──▶ joining ──checked──▶ serving
    serving ──drain──▶ draining ──requests done, next update──▶ left

serving: takes requests. starting: started again, or probed (pace/rollout/healing.py). ready: up,
waiting for the next weight update. joining: in the weight-transfer group for the update that catches
it up, no requests. draining: no new groups, still in the group. dead: out, not coming back (the
restart budget is spent, or it was leaving), and briefly between a failure and its revival. left:
drained and gone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pace.errors import ConfigError

SERVING, STARTING, READY, JOINING, DRAINING, DEAD, LEFT = (
    "serving", "starting", "ready", "joining", "draining", "dead", "left")
WATCHED = (SERVING, READY, JOINING, DRAINING)  # states whose health is checked
# A server's progress: its engine's token counters (vLLM's /metrics, Prometheus text `name{labels} value`,
# a line per engine of a data-parallel server), read while it delivers nothing (pace/rollout/remote.py)
PROGRESS_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
PROBE_EVERY_S = 5.0  # at most this long between two reads of a silent server's counters


@dataclass
class EngineFailure:
    index: int
    url: str
    cause: str
    request_ids: list = field(default_factory=list)  # the requests it held, filled in by take_failures
    drained: bool = False  # not a failure: a draining server's requests moved at rollout.drain_timeout_s
    serving: bool = True  # it took requests (a server failing while it starts or catches up fails no run)


@dataclass
class Server:
    index: int
    url: str
    process: object = None  # a LocalServer this run started, else None
    state: str = SERVING
    paused: bool = False
    workers: int = 1  # weight-transfer ranks (TP × PP × DP workers)
    last_output: float = 0.0  # when it last delivered output (or was resumed, or took its first request)
    last_progress: float = 0.0  # when its token counters (/metrics) were last seen to move
    tokens: float | None = None  # its token counters' sum at the last probe (None: not read, or it has none)
    probed: float = 0.0  # when they were last read
    sync_s: float = 0.0  # seconds in weight-update calls, summed
    calling: bool = False  # a weight call to it is unanswered
    answered: bool = True  # its last weight call was answered (a server error is an answer: it ran)
    restarts: int = 0  # times started again (or re-admitted)
    since: float = 0.0  # when it failed, or was registered: its join time counts from here
    grouped: bool = False  # holds a weight-transfer engine of this run's trainer (released before a new one)
    leaving: bool = False  # draining: not started again if it fails
    drained: bool = False  # its requests finished (or moved): it leaves at the next update

    @property
    def alive(self) -> bool:
        """Takes requests."""
        return self.state == SERVING

    @property
    def in_group(self) -> bool:
        """A rank of the weight-transfer group: every weight call goes to it."""
        return self.state in (SERVING, JOINING, DRAINING)


def tokens_counted(metrics: str) -> float | None:
    """The sum of `PROGRESS_COUNTERS` over a Prometheus text page (every engine's), or None if it has none."""
    total, seen = 0.0, False
    for line in metrics.splitlines():
        if line.partition(" ")[0].split("{")[0] in PROGRESS_COUNTERS:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def world_size(url: str, what: str = "rollout.servers") -> int:
    """A server's weight-transfer ranks (TP × PP, times DP if it has several); ConfigError naming
    ``what`` if it cannot say."""
    import requests

    try:
        r = requests.get(f"{url}/get_world_size", params={"include_dp": "true"}, timeout=30)
        r.raise_for_status()
    except requests.RequestException as exc:
        hint = ("it is not started with VLLM_SERVER_DEV_MODE=1 (scripts/launch_rollout_server.sh)"
                if isinstance(exc, requests.HTTPError) else "it does not answer")
        raise ConfigError(f"{what}: {url}: {hint} ({type(exc).__name__})") from exc
    return int(r.json()["world_size"])
