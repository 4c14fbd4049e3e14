"""The fleet's control endpoint: a small HTTP app on trainer rank 0 through which an operator (or
scripts/launch_rollout_server.sh with `JOIN=`) adds rollout servers to a running job and lets one leave.

    POST /fleet/join   {"url": "http://host:port"}        → 200 {"index": i}   | 400 {"error": "..."}
    POST /fleet/drain  {"index": i} or {"url": "http://..."} → 200 {"index": i} | 400 {"error": "..."}
    GET  /fleet                                             → 200 {"servers": [...], "control": url}

It runs on the fleet's own asyncio loop (`fleet._loop`) and only queues work: `fleet.join`,
`fleet.drain` and `fleet.describe` return at once, from any thread (pace/rollout/remote.py does the
probing, the weight catch-up and the moving of requests). Its URL goes to `<run dir>/fleet.json`,
which `python -m pace.rollout.fleetctl --run-dir` reads, and is removed when it stops.

No authentication: whoever reaches the port can add a server (which is then sent the weights) or
drain one. It listens on `rollout.control_host`, by default the address the servers reach rank 0 at
(127.0.0.1 when every server is on this host), not on every interface. A server on another host is
refused (400) while that address is the loopback, wherever the endpoint listens: `fleet.join`.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

from pace.rollout.server_state import DEAD, LEFT

FLEET_FILE = "fleet.json"  # in the run directory: {"control": url}
GONE = (DEAD, LEFT)  # states of a server that holds no place in the fleet


class Control:
    """A running endpoint: ``url`` to reach it, ``stop()`` to close it (before the fleet's loop stops)."""

    def __init__(self, runner, loop, url: str, file: Path | None):
        self._runner, self._loop, self.url, self.file = runner, loop, url, file

    def stop(self, timeout: float = 5.0) -> None:
        """Close the endpoint and remove fleet.json (any thread but the loop's; twice is harmless)."""
        runner, self._runner = self._runner, None
        if self.file is not None:
            self.file.unlink(missing_ok=True)
        if runner is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout)


def _body(request_text: str, route: str, usage: str) -> dict:
    try:
        body = json.loads(request_text)
    except json.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise ValueError(f"{route}: the body must be a JSON object {usage}")
    return body


def _url_of(body: dict, route: str) -> str:
    url = body.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{route}: \"url\" must be a server URL (http://host:port), got {url!r}")
    return url.rstrip("/")


def app(fleet, control_url: str = ""):
    """The aiohttp application over ``fleet`` (join / drain / describe)."""
    from aiohttp import web

    def answer(fn):
        async def handler(request):
            try:
                return web.json_response(fn(await request.text()))
            except ValueError as exc:  # bad input, or the fleet refused it: one line
                return web.json_response({"error": str(exc).splitlines()[0]}, status=400)
            except Exception as exc:  # noqa: BLE001 - a bug in the fleet: the caller sees it, the run goes on
                return web.json_response({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}, status=500)
        return handler

    def join(text: str) -> dict:
        url = _url_of(_body(text, "join", '{"url": "http://host:port"}'), "join")
        return {"index": fleet.join(url), "url": url}

    def drain(text: str) -> dict:
        body = _body(text, "drain", '{"index": i} or {"url": "http://host:port"}')
        if ("index" in body) == ("url" in body):
            raise ValueError('drain: give one of "index" or "url"')
        if "index" in body:
            index = body["index"]
            if not isinstance(index, int) or isinstance(index, bool):
                raise ValueError(f'drain: "index" must be an engine index (an integer), got {index!r}')
        else:
            url = _url_of(body, "drain")
            held = [s["index"] for s in fleet.describe() if s["url"].rstrip("/") == url and s["state"] not in GONE]
            if not held:
                raise ValueError(f"drain: no server of the fleet is at {url}")
            index = held[0]
        fleet.drain(index)
        return {"index": index}

    def describe(_text: str) -> dict:
        return {"servers": fleet.describe(), "control": control_url}

    application = web.Application()
    application.add_routes([web.post("/fleet/join", answer(join)), web.post("/fleet/drain", answer(drain)),
                            web.get("/fleet", answer(describe))])
    return application


def advertised(bind: str, rollout_cfg) -> str:
    """The host the servers reach the endpoint at: the bound address, or for a wildcard bind the
    address they reach rank 0 at (this host's name when that is the loopback)."""
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    from pace.net import transfer_address

    host = transfer_address(rollout_cfg)
    return socket.gethostname() if host.startswith("127.") else host


async def _start(fleet, host: str, port: int, advertise: str):
    from aiohttp import web

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    url = f"http://{f'[{advertise}]' if ':' in advertise else advertise}:{sock.getsockname()[1]}"
    runner = web.AppRunner(app(fleet, url), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, url


def serve(fleet, cfg, run_dir) -> Control | None:
    """Start the endpoint of ``fleet`` at `rollout.control_host`:`rollout.control_port` on the fleet's
    loop and write ``run_dir``/fleet.json; None when `rollout.control_port` is null."""
    from pace.errors import ConfigError

    rollout = cfg.rollout
    if rollout.control_port is None:
        return None
    if rollout.control_host:
        host = rollout.control_host
    else:
        from pace.net import transfer_address

        host = transfer_address(rollout)
    start = _start(fleet, host, rollout.control_port, advertised(host, rollout))
    try:
        runner, url = asyncio.run_coroutine_threadsafe(start, fleet._loop).result(30)
    except OSError as exc:
        raise ConfigError(f"rollout.control_port={rollout.control_port}: cannot listen on {host} "
                          f"({exc.strerror or exc})") from exc
    file = None
    if run_dir is not None:
        file = Path(run_dir) / FLEET_FILE
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(FLEET_FILE + ".tmp")
        tmp.write_text(json.dumps({"control": url}) + "\n")
        tmp.replace(file)  # a reader never sees half a file
    print(f"fleet control: {url} (python -m pace.rollout.fleetctl list --control {url})", file=sys.stderr)
    return Control(runner, fleet._loop, url, file)
