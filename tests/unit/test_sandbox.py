"""The tool sandbox (pace/tools/sandbox.py) against hostile programs: each is contained, with a
clear message, within its time bound, and the host sees no side effect. Real bubblewrap sandboxes
(installed by scripts/setup.sh); each call takes well under a second unless it is meant to time out."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from pace.tools.sandbox import Limits, Sandbox

pytestmark = pytest.mark.unit

LIMITS = Limits(wall_s=4, cpu_s=1, memory_mb=512, file_mb=1, procs=16, output_bytes=2000)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox("bwrap", LIMITS) as sb:
        yield sb


def run(sb, code):
    t0 = time.monotonic()
    r = sb.run(code)
    return r, time.monotonic() - t0


def test_a_program_runs_and_its_output_comes_back(sandbox):
    r, _ = run(sandbox, "import math\nprint(math.factorial(20))\nprint(sum(range(10**5)))")
    assert r.status == "ok" and r.exit_code == 0 and r.output == "2432902008176640000\n4999950000\n"
    r, _ = run(sandbox, "1/0")
    assert r.status == "error" and r.output.rstrip().endswith("ZeroDivisionError: division by zero")


def test_an_endless_loop_stops_at_the_cpu_limit(sandbox):
    r, dt = run(sandbox, "while True: pass")
    assert r.status == "killed" and "CPU-time limit of 1 s exceeded" in r.output and dt < LIMITS.wall_s


def test_a_sleeping_program_stops_at_the_wall_clock(sandbox):
    r, dt = run(sandbox, "import time\nprint('start', flush=True)\ntime.sleep(60)")
    assert r.status == "timeout" and "wall-clock limit of 4 s exceeded" in r.output and r.output.startswith("start")
    assert LIMITS.wall_s <= dt < LIMITS.wall_s + 2


def test_unbounded_allocation_fails_inside(sandbox):
    r, _ = run(sandbox, "a = []\nwhile True:\n    a.append(bytearray(50 << 20))")
    assert r.status in ("error", "killed") and ("MemoryError" in r.output or "memory limit" in r.output)


def test_a_fork_bomb_is_capped(sandbox):
    code = ("import os\nn = 0\nwhile True:\n    try:\n        os.fork()\n        n += 1\n"
            "    except OSError as e:\n        print('refused', e.errno)\n        break")
    r, dt = run(sandbox, code)
    assert "refused 11" in r.output and dt < LIMITS.wall_s + 2  # EAGAIN: the process cap held


def test_writes_outside_tmp_fail_and_the_host_sees_nothing(sandbox, tmp_path):
    canary = tmp_path / "canary.txt"
    for target in (canary, Path("/usr/pace-sandbox-test"), Path("/pace-sandbox-test")):
        r, _ = run(sandbox, f"open({str(target)!r}, 'w').write('x')")
        assert r.status == "error" and ("Read-only file system" in r.output or "No such file" in r.output), r.output
        assert not target.exists()
    name = f"/tmp/pace-sandbox-{uuid.uuid4().hex}"
    r, _ = run(sandbox, f"open({name!r}, 'w').write('hi')\nprint(open({name!r}).read())")
    assert r.output == "hi\n" and not Path(name).exists()  # a private /tmp
    r, _ = run(sandbox, "open('/tmp/big', 'wb').write(b'x' * (4 << 20))")
    assert r.status in ("error", "killed")  # the file-size limit (1 MB)


def test_no_network_and_no_host_files(sandbox):
    r, _ = run(sandbox, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert r.status == "error" and "Network is unreachable" in r.output
    r, _ = run(sandbox, "import os\nprint(sorted(os.listdir('/')))\nprint(os.path.exists('/etc/passwd'), os.path.exists('/home'))")
    assert "False False" in r.output


def test_endless_output_is_cut_at_the_cap(sandbox):
    r, dt = run(sandbox, "while True:\n    print('y' * 100)")
    assert r.status == "truncated" and "[output truncated at 2000 bytes" in r.output
    assert len(r.output) < 2100 and dt < 2


def test_warm_sandboxes_run_one_program_each():
    with Sandbox("bwrap", LIMITS, warm=2) as sb:
        first = sb.run("import os\nopen('/tmp/state', 'w').write('x')\nprint(os.getpid())")
        second = sb.run("import os\nprint(os.path.exists('/tmp/state'))")
    assert first.ok and second.output == "False\n"  # nothing carries over between calls


def test_the_process_fallback_still_enforces_limits():
    with Sandbox("process", LIMITS) as sb:
        assert sb.run("print(2 + 2)").output == "4\n"
        assert sb.run("while True: pass").status == "killed"
    with pytest.raises(ValueError, match="tools.sandbox='docker' is not one of bwrap, process"):
        Sandbox("docker")


def test_a_program_runs_in_a_process_with_a_thousand_files_open(sandbox):
    """The wait for a program's exit holds a pidfd: past fd 1023 (the ReTool rehearsal's trainer, its
    servers' connections and tool pipes open) select() raised 'filedescriptor out of range' and killed the
    rollout thread. Every fd below 1100 is taken here, so the pidfd's number is past select's limit."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE {hard}: cannot open 1100 files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while (fd := os.open(os.devnull, os.O_RDONLY)) < 1100:
            held.append(fd)
        os.close(fd)  # the lowest free number is now past 1023: the next pidfd's
        assert min(held) < 1024 <= max(held)
        r, _ = run(sandbox, "print(6 * 7)")
        assert r.status == "ok" and r.output == "42\n", r
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
