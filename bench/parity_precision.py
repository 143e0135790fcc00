"""How far bf16 runs sit from fp32 on tiny random checkpoints: ours and transformers', on the
CPU and on CUDA, per family. A diagnostic for the bf16 parity tests (which compare ours with
transformers' bf16 run): when transformers' own bf16 logits are far from its fp32 ones, the
model itself is ill-conditioned in bf16 (routing near-ties), not our engine.

    python -m freetoken_agent.bench.parity_precision [--seeds 3] [--tokens 300]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

from freetoken_agent.engine.engine import Engine
from freetoken_agent.help_format import DefaultsHelpFormatter


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="freetoken bench parity-precision",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, default=3, help="random models per family")
    parser.add_argument("--tokens", type=int, default=300, help="prompt tokens compared")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_models import FAMILIES, make_tiny

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{'family':10} {'seed':>4} {'dev':5} {'ours-vs-hf':>10} {'ours-vs-fp32':>12} "
          f"{'hf-vs-fp32':>10} {'argmax':>7}")  # fmt: skip
    for family in FAMILIES:
        for seed in range(args.seeds):
            folder = Path(tempfile.mkdtemp())
            hf = make_tiny(family, folder, seed, dtype=torch.bfloat16)
            ids = [random.Random(seed).randrange(3, 320) for _ in range(args.tokens)]
            for dev in devices:
                hf.to(dev)
                batch = torch.tensor([ids], device=dev)
                with torch.no_grad():
                    ref = hf.to(torch.bfloat16)(batch).logits[0].float().cpu()
                    truth = hf.float()(batch).logits[0].float().cpu()
                hf.to(torch.bfloat16)
                kw = {"max_model_len": 1024} if dev == "cuda" else {"kv_tokens": 2048}
                engine = Engine.load(folder, device=dev, progress=False, **kw)
                ours = engine.score(ids)
                agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
                errs = (_rel(ours, ref), _rel(ours, truth), _rel(ref, truth))
                print(f"{family:10} {seed:4} {dev:5} {errs[0]:10.2e} {errs[1]:12.2e} "
                      f"{errs[2]:10.2e} {agree:7.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
