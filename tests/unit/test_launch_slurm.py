"""scripts/launch_slurm.sh without Slurm: stand-in `scontrol`, `srun` (runs the command it is given,
except a rollout server's, which it only records), `curl` and `accelerate` on PATH; the trainer node
and the rollout node are both this host. And `python -m pace.net HOST`, which the script runs on the
trainer node for the weight-transfer address."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "launch_slurm.sh"

STAND_INS = {
    # the nodes of the allocation: the trainer, then one rollout node (this host by name)
    "scontrol": 'printf "%s\\n" trainer-node "$FAKE_ROLLOUT_NODE"\n',
    # srun OPTIONS... CMD: a rollout server's launch (bash -c ...) is recorded and sleeps (or exits at once
    # with FAKE_SERVER_EXITS); any other command runs here
    "srun": ('while [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done\n'
             'if [[ "$1" == bash && "$2" == -c ]]; then\n'
             '  echo "$3" >> "$FAKE_LOG/servers"\n'
             '  [[ -n "${FAKE_SERVER_EXITS:-}" ]] && exit 3\n'
             '  exec sleep 60\n'
             'fi\n'
             'exec "$@"\n'),
    "curl": 'exit "${FAKE_CURL_RC:-0}"\n',  # /health answers (0) or the connection is refused (7)
    "accelerate": 'printf "%s\\n" "$@" > "$FAKE_LOG/trainer"\n',
}


@pytest.fixture
def slurm(tmp_path):
    """``slurm(**env)``: the script run under the stand-ins → (exit code, stderr, seconds, log dir)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    procs = []

    def run(**env):
        env = {**{k: v for k, v in os.environ.items() if k != "TRANSFER_ADDRESS"}, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "PYTHONPATH": str(ROOT), "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "trainer-node,rollout",
               "SLURM_GPUS_ON_NODE": "2", "FAKE_LOG": str(log), "FAKE_ROLLOUT_NODE": "localhost", "HEALTH_POLL_S": "0.1",
               **env}
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", str(SCRIPT), "+exp=async_tiny"], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - t0, log

    yield run
    for proc in procs:  # the stand-in servers still sleeping
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_the_trainer_gets_the_servers_and_its_address_on_the_route_to_them(slurm):
    rc, err, _, log = slurm()
    assert rc == 0, err
    args = (log / "trainer").read_text().splitlines()
    assert "rollout.servers=[http://localhost:8100,http://localhost:8101]" in args and "rollout.engines=2" in args
    # toward the rollout node (this host, by name): the loopback's address, whatever `hostname -I` lists first
    assert args[-1] == "rollout.transfer_address=127.0.0.1"
    deadline = time.monotonic() + 30  # each server's srun runs in the background: it may record after the script ends
    while len(servers := _lines(log / "servers")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(s.split()[0] for s in servers) == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]
    rc, err, _, log = slurm(TRANSFER_ADDRESS="10.0.0.7")  # chosen by hand
    assert rc == 0 and (log / "trainer").read_text().splitlines()[-1] == "rollout.transfer_address=10.0.0.7"


def test_a_server_that_never_answers_fails_the_job_at_the_deadline_in_one_line(slurm):
    rc, err, seconds, log = slurm(FAKE_CURL_RC="7", SERVER_START_TIMEOUT_S="2")
    assert rc == 1 and seconds < 30
    assert err == ("launch_slurm.sh: rollout server http://localhost:8100 did not answer /health within 2 s "
                   "(SERVER_START_TIMEOUT_S; its log: rollout-server-localhost-8100.log)\n")
    assert not (log / "trainer").exists()


def test_a_server_whose_step_ended_fails_the_job_at_once(slurm):
    rc, err, seconds, log = slurm(FAKE_CURL_RC="7", FAKE_SERVER_EXITS="1")  # the 900 s deadline is far
    assert rc == 1 and seconds < 30
    assert err == ("launch_slurm.sh: rollout server http://localhost:8100 exited before answering /health "
                   "(its log: rollout-server-localhost-8100.log)\n")


def test_pace_net_prints_the_address_on_the_route_to_a_host():
    def route(host):
        out = subprocess.run([sys.executable, "-m", "pace.net", host], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert route("localhost") == route("127.0.0.1") == "127.0.0.1"
    ip = shutil.which("ip")
    probe = subprocess.run([ip, "route", "get", "192.0.2.77"], capture_output=True, text=True) if ip else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no `ip route` toward a documentation address (TEST-NET-1) on this host to compare with")
    words = probe.stdout.split()
    assert route("192.0.2.77") == words[words.index("src") + 1]  # the kernel's source address, as `ip route get`
