"""Add a rollout server to a running job, drain one, or list them, through the job's control
endpoint (pace/rollout/control.py).

    python -m pace.rollout.fleetctl join http://node3:8100 --run-dir outputs/2026-12-05/10-00-00
    python -m pace.rollout.fleetctl drain 2 --control http://node0:41234      # or drain http://node3:8100
    python -m pace.rollout.fleetctl list --run-dir outputs/2026-12-05/10-00-00

The endpoint's URL is `--control`, else read from `<run dir>/fleet.json` (written by rank 0 while the
run goes on). Exit codes: 0 done (queued: a joining server serves after the next weight update, a
draining one leaves at it); 1 the fleet refused it (the reason on one line); 2 bad usage; 3 the
endpoint cannot be found or does not answer.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from pace.rollout.control import FLEET_FILE  # a light import: aiohttp is loaded by the endpoint only

COLUMNS = ("index", "url", "state", "restarts", "requests", "started_by_run")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # rank 0 is on the cluster's network: no proxy


class Unreachable(RuntimeError):
    """No control endpoint to talk to (exit code 3)."""


class Refused(RuntimeError):
    """The endpoint answered with an error (exit code 1)."""


def control_url(control: str | None, run_dir: str | None) -> str:
    if control:
        return control.rstrip("/")
    if not run_dir:
        raise Unreachable("give --control URL or --run-dir DIR (the run directory holding fleet.json)")
    file = Path(run_dir) / FLEET_FILE
    try:
        return json.loads(file.read_text())["control"].rstrip("/")
    except FileNotFoundError:
        raise Unreachable(f"{file}: not found (the run is not running, or has no control endpoint: "
                          f"rollout.control_port=null or rollout.engine_process is not server)") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise Unreachable(f"{file}: not a fleet file (expected {{\"control\": \"http://host:port\"}})") from None


def call(control: str, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    """The endpoint's JSON answer to GET (no ``body``) or POST ``body`` at ``path``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(control + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]
        except (json.JSONDecodeError, KeyError, TypeError):
            reason = f"HTTP {exc.code} {exc.reason}"
        raise Refused(reason) from None
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(f"{control}: no answer ({getattr(exc, 'reason', exc)}): is the run still running?") from None


def table(servers: list[dict]) -> str:
    rows = [COLUMNS] + [tuple(str(s.get(c, "")) for c in COLUMNS) for s in servers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def parser() -> argparse.ArgumentParser:
    where = argparse.ArgumentParser(add_help=False)
    group = where.add_mutually_exclusive_group()
    group.add_argument("--control", help="the control endpoint's URL (http://host:port)")
    group.add_argument("--run-dir", help="the run directory: its fleet.json names the endpoint")
    p = argparse.ArgumentParser(prog="python -m pace.rollout.fleetctl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("join", parents=[where], help="add a running server").add_argument("url")
    sub.add_parser("drain", parents=[where], help="let a server leave (by index or URL)").add_argument("server")
    sub.add_parser("list", parents=[where], help="the fleet's servers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        url = control_url(args.control, args.run_dir)
        if args.command == "join":
            index = call(url, "/fleet/join", {"url": args.url})["index"]
            print(f"{args.url}: engine {index}, joins at the next weight update")
        elif args.command == "drain":
            body = {"index": int(args.server)} if args.server.isdigit() else {"url": args.server}
            index = call(url, "/fleet/drain", body)["index"]
            print(f"engine {index}: draining, leaves at the next weight update")
        else:
            print(table(call(url, "/fleet")["servers"]))
    except Refused as exc:
        print(f"fleetctl {args.command}: {exc}", file=sys.stderr)
        return 1
    except Unreachable as exc:
        print(f"fleetctl {args.command}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
