"""Run a script that compiles Triton kernels for sm_90 (no GPU needed) in a process of its own,
and return the JSON it prints last. The test process imported the kernels under the
interpreter (TRITON_INTERPRET=1), which cannot compile; the child runs with it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def compiled_json(script: str, *args: str):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
