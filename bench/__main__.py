"""`python -m freetoken_agent.bench NAME [options]` / `freetoken bench NAME [options]`.

`freetoken bench NAME --help` lists that benchmark's options and their defaults; the
environment variables below change what every offloaded engine does.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from dataclasses import dataclass

from freetoken_agent.bench.environment import ENVIRONMENT


@dataclass(frozen=True, slots=True)
class Bench:
    """One benchmark: its module (whose `main(argv)` runs it), what it measures (its line in
    `freetoken bench --help`), whether it needs CUDA, and the option that runs it on the CPU
    instead. The list's "(CUDA)" marks and the refusal without CUDA both read `cuda`."""

    module: str
    about: str
    cuda: bool = True
    cpu_mode: str | None = None

    def mark(self) -> str:
        if not self.cuda:
            return "(any CPU)"
        return f"(CUDA; {self.cpu_mode} runs on the CPU)" if self.cpu_mode else "(CUDA)"


_B = "freetoken_agent.bench."
BENCHES: dict[str, Bench] = {
    "decode": Bench(_B + "decode_baseline", "all-resident decode and prefill beside the HBM limit"),
    "offload": Bench(_B + "offload", "experts in host memory: decode per policy and routing "
                     "regime, streamed prefill with and without double buffering"),
    "cpu-experts": Bench(_B + "cpu_experts", "the CPU expert kernel's weight bandwidth beside the "
                         "host's read bandwidth", cuda=False),
    "attention-kernel": Bench(_B + "attention_kernel", "paged attention decode/prefill beside HBM "
                              "bandwidth and SDPA"),
    "moe-kernel": Bench(_B + "moe_kernel", "fused MoE decode/prefill beside HBM bandwidth and "
                        "matmul rate"),
    "profile": Bench(_B + "profile_step", "where a decode step and a prefill chunk spend their "
                     "time"),
    "profile-offload": Bench(_B + "profile_offload", "where an offloaded decode step spends its "
                             "host time, per phase"),
    "parity-precision": Bench(_B + "parity_precision", "bf16 distance from fp32, ours and "
                              "transformers', per family (also on CUDA where present)",
                              cuda=False),
    "agent": Bench(_B + "agent", "agent sessions replayed per recurrent-checkpoint mode: tokens "
                   "re-prefilled and time to first token per turn", cpu_mode="--cpu-smoke"),
    "elastic": Bench(_B + "elastic", "a growing agent session on the elastic split against two "
                     "fixed ones, with an external allocation mid-session", cpu_mode="--cpu-smoke"),
    "kv-layout": Bench(_B + "kv_layout", "paged attention over the fixed pool's, the elastic "
                       "arena's and the old interleaved KV layouts, decode and prefill at long "
                       "contexts"),
    "stream-groups": Bench(_B + "stream_groups", "the prefill streamer alone per ring group "
                           "size: tok/s beside the link's limit, host enqueue beside device time"),
    "prefill-timeline": Bench(_B + "prefill_timeline", "a streamed prefill profiled from an "
                              "emptied and a full cache: the link's busy time and its gaps, "
                              "host-late or waiting on compute"),
    "workspace": Bench(_B + "workspace", "the device memory a prefill step allocates beside the "
                       "estimate slots are sized with"),
    "gemv": Bench(_B + "gemv_kernel", "decode projections: torch's F.linear against the Triton "
                  "skinny matmul, beside HBM bandwidth"),
    "stream-threshold": Bench(_B + "stream_threshold", "prefill chunk lengths streamed and placed: "
                              "the measured crossover beside the model's"),
    "sampler": Bench(_B + "sampler_profile", "a decode step's sampling per configuration: the "
                     "Triton kernel against torch's ops, host and device time, launches"),
    "worker-teams": Bench(_B + "worker_teams", "the CPU worker's job time on its OpenMP team "
                          "against its own spinning team, beside the host's read bandwidth",
                          cuda=False),
    "step-kernels": Bench(_B + "step_kernels", "an offloaded decode step's device time kernel by "
                          "kernel, in the graphs each policy replays"),
    "fusions": Bench(_B + "fusions", "the decode step's fused kernels (router, o_proj + norm) on "
                     "and off in one all-resident engine, beside the HBM limit"),
    "cache-policies": Bench(_B + "cache_policies", "expert cache replacement policies replayed on "
                            "routing traces: LRU's miss rate beside frequency-aware ones and the "
                            "offline optimum", cuda=False),
    "side-fill": Bench(_B + "side_fill", "copies behind a decode step on a second stream: what "
                       "they cost the step's own copies and kernels, beside the link's limit"),
    "split-cuts": Bench(_B + "split_cuts", "adaptive's split path at held cuts, its trials' cut "
                        "and other worker teams, against gpu-fill, beside each row's limit"),
    "plan-kernel": Bench(_B + "plan_kernel", "the in-graph fill's plan kernel alone: device time "
                         "per plan against its misses and the slots it scans, beside the launch "
                         "floor"),
    "expert-mlp": Bench(_B + "expert_mlp", "a probe: one token's routed experts in one launch "
                        "against the decode path's three, graph-replayed at the 30B shape, "
                        "beside HBM"),
    "attention-half": Bench(_B + "attention_half", "a probe: a token's attention half of a layer "
                            "as one persistent grid against the engine's five launches, at the "
                            "30B shape"),
    "routing-prediction": Bench(_B + "routing_prediction", "how well the next layer's router on "
                                "this layer's state predicts the next layer's experts (and its "
                                "misses) in a random model", cuda=False),
    "share-rule": Bench(_B + "share_rule", "the shared path's CPU share rules replayed on routing "
                        "traces with a per-layer time model: fills, CPU experts and modelled "
                        "steps", cuda=False),
}  # fmt: skip


def usage() -> str:
    """`freetoken bench --help`: the benchmarks, each marked with where it runs."""
    first, rest = __doc__.strip().split("\n\n", 1)
    lines = [
        textwrap.fill(f"{b.about} {b.mark()}", width=98, initial_indent=f"    {name:<16}  ",
                      subsequent_indent=" " * 22, break_on_hyphens=False)  # (keeps --cpu-smoke)
        for name, b in BENCHES.items()
    ]  # fmt: skip
    return "\n\n".join([first, "\n".join(lines), rest.strip(), ENVIRONMENT.rstrip()])


def _gives(argv: list[str], option: str, short: str | None = None) -> bool:
    """Whether argv gives `option` as argparse reads it: whole, or abbreviated (`--cpu` for
    `--cpu-smoke`; an abbreviation that is ambiguous is argparse's error to report)."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == short or (len(arg) > 2 and arg.startswith("--") and option.startswith(arg)):
            return True
    return False


def refusal(name: str, argv: list[str]) -> str | None:
    """Why NAME cannot run here, one line, or None. Checked before its module is imported: the
    CUDA benchmarks' modules import triton, which a CPU-only machine may lack, and fail deep
    inside their first CUDA call otherwise. `--help` is never refused."""
    bench = BENCHES[name]
    if not bench.cuda or _gives(argv, "--help", "-h"):
        return None
    if bench.cpu_mode and _gives(argv, bench.cpu_mode):
        return None
    import torch  # (here: `freetoken bench --help` needs no torch)

    if torch.cuda.is_available():
        return None
    cpu = f"; {bench.cpu_mode} runs it on the CPU" if bench.cpu_mode else ""
    return f"freetoken bench {name} needs a CUDA device and torch sees none{cpu}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or argv[0] not in BENCHES:
        asked = not argv or argv[0] in ("-h", "--help")
        print(usage(), file=sys.stdout if asked else sys.stderr)
        if not asked:
            print(f"\nunknown benchmark {argv[0]!r}; choose one of {', '.join(BENCHES)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        return 0
    name, rest = argv[0], argv[1:]
    why = refusal(name, rest)
    if why is None:
        try:
            module = importlib.import_module(BENCHES[name].module)
        except ModuleNotFoundError as missing:
            if (missing.name or "").split(".")[0] != "triton":
                raise
            # Only where CUDA is not (CUDA builds of torch ship triton): `NAME --help`.
            why = (f"freetoken bench {name} needs triton, even to list its options (pip "
                   "install triton; CUDA builds of torch ship it)")  # fmt: skip
        else:
            return module.main(rest)
    print(why, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
