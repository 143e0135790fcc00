"""bench/decode_profile.py on the CPU smoke model: both engines run a prefill and a decode under
each measurement, and their lines carry what the device run is read for."""

from __future__ import annotations

import random
import re

from freetoken_agent.bench import decode_profile


def test_cpu_smoke_profiles_both_engines(capsys, rng_seed):
    tokens = random.Random(rng_seed).randint(6, 12)
    argv = ["--cpu-smoke", "--context", "200", "--tokens", str(tokens), "--top", "5"]
    decode_profile.main([*argv, "--squeeze-gb", "0.0002"])
    out = capsys.readouterr().out
    heads = re.findall(r"^== (\S+): prefill (\d+) ms, decode ([\d.]+) ms/step", out, re.M)
    assert [h[0] for h in heads] == ["elastic", "fixed-last"], out
    assert all(float(h[2]) > 0 for h in heads)
    # The elastic engine's safe points are measured; the fixed split has none.
    sp = re.findall(r"safe points in both ([\d.]+);", out)
    assert float(sp[0]) > 0 and float(sp[1]) == 0
    assert out.count("host functions by own time") == 4
    # Each timed prefill says what it moved; a smoke chunk of 128 tokens streams its layers.
    moved = re.findall(
        r"^-- (\S+) prefill of 200 tokens: (\d+) layers streamed, ([\d.]+) GB "
        r"host-to-device, (\d+) split changes",
        out,
        re.M,
    )
    assert [m[0] for m in moved] == ["elastic", "fixed-last"], out
    assert all(int(m[1]) > 0 for m in moved), out
    # The squeeze (elastic only): a budget cut and restored, decode timed again after it.
    assert re.findall(r"^-- squeeze .* decode [\d.]+ -> [\d.]+ ms/step$", out, re.M), out


def test_cpu_smoke_hog_squeeze_yields_to_the_other_program_and_times_decode_again(capsys, rng_seed):
    tokens = random.Random(rng_seed).randint(6, 12)
    argv = ["--cpu-smoke", "--context", "96", "--tokens", str(tokens), "--top", "3"]
    decode_profile.main([*argv, "--hog-gb", "1"])
    out = capsys.readouterr().out
    hogs = re.findall(
        r"^-- hog ([\d.e-]+) GB \(got ([\d.e-]+)\).* decode [\d.]+ -> [\d.]+ ms/step, waiting on "
        r"the device [\d.]+ -> [\d.]+$",
        out,
        re.M,
    )
    assert len(hogs) == 2, out  # both engines
    (asked, got_elastic), (_, got_fixed) = hogs
    # The elastic engine gives the other program all it asks; the fixed split cannot.
    assert float(got_elastic) == float(asked) > float(got_fixed), out
