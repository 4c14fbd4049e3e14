"""The process that holds a connection a request in flight raises its soft limit of open files to the
hard one (pace/rollout/protocol.py `allow_open_files`, called by the remote fleet and the stream reader):
the ReTool rehearsal's rank 0 held ~970 sockets at 48 groups in flight; a GPU node's 192 hold thousands."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.unit

CHECK = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # a cluster's default soft limit
from pace.rollout.protocol import allow_open_files
print(allow_open_files(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def test_the_soft_limit_of_open_files_is_raised_to_the_hard_one():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    said, soft, hard = (int(x) for x in out.split())
    if hard <= 1024:
        pytest.skip(f"the hard limit is {hard}: nothing to raise")
    assert said == soft == (hard if hard != -1 else 65536)
