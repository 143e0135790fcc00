"""A program that ends while its engine service is generating exits cleanly: the service's
thread is stopped between two steps at exit (killed inside a torch op it aborted the process:
"terminate called without an active exception", exit code 134, every time)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

from freetoken_agent.demo_model import ensure_demo_model

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from freetoken_agent import Engine, SamplingParams
    from freetoken_agent.service import service_for
    engine = Engine.load(sys.argv[1], device="cpu", progress=False, kv_tokens=4096,
                         max_model_len=2048)
    events = []
    prompt = [int(t) for t in sys.argv[2].split(",")]
    service_for(engine).submit(prompt, SamplingParams(max_tokens=1500, ignore_eos=True),
                               events.append)
    while len(events) < 3:  # it is generating
        time.sleep(0.01)
    print("leaving mid-generation", flush=True)
    """
)


def test_a_program_ending_mid_generation_exits_cleanly(tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    model = ensure_demo_model(tmp_path)
    prompt = ",".join(str(rng.randrange(3, 1000)) for _ in range(rng.randint(5, 60)))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), prompt],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "leaving mid-generation" in done.stdout
