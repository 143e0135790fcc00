"""The environment variables that change an offloaded engine's CPU branch, host pool, decode
kernels and starting bandwidths: no bench option sets them (the engine reads them when it
loads), so `freetoken bench --help` and the `--help` of every bench that loads an offloaded
engine list them (issue 3: `--help` documents every knob)."""

from __future__ import annotations

ENVIRONMENT = """\
environment (read when the engine loads; a bench run obeys them as the engine does):
  FREETOKEN_CPU_THREADS=N   threads of the CPU expert kernel (as llama.cpp's -t) and of the
                            decode graphs' CPU worker's team (default: the physical cores, less
                            one where no SMT sibling is left for the driving thread; the
                            worker's spinning team: less a quarter, at least two left free)
  FREETOKEN_WORKER_CPUS=L   pin the CPU worker's spinning team to the cores L ("0-11",
                            "0,2,4-7"), as llama.cpp's --cpu-mask with --cpu-strict (default:
                            unpinned; the spin team only)
  FREETOKEN_WORKER_TEAM=T   the CPU worker's kernel threads: spin (a team of its own spinning
                            between jobs; the default) or omp (its OpenMP team, asleep between
                            jobs)
  FREETOKEN_HUGE_PAGES=1    the host expert pool's pages (and other page-exclusive host
                            buffers) ask for transparent huge pages (default off)
  FREETOKEN_CPU_EXPERTS=B   the CPU expert kernel's build: avx512, avx2 or torch (default: the
                            widest this CPU runs; torch where no compiler built one)
  FREETOKEN_PDL=WORDS       programmatic dependent launch of the decode kernels (CUDA): on,
                            exit, light, prefetch or off, a comma list (default light;
                            kernels/triton/pdl.py)
  FREETOKEN_HOST_EMBEDDINGS=0  keep an offloaded model's token embedding table on the GPU
                            (default: in pinned host memory, its bytes given to expert slots)
  FREETOKEN_CACHE=DIR       the folder of calibration.json (`freetoken calibrate`; default
                            ~/.cache/freetoken): an offloaded engine starts from its entry for
                            this machine and expert shape (B_P, B_H, the stream knee, the fill
                            copies' programs), else from built-in guesses it then measures;
                            the benches that take --copy-programs set that one themselves
"""
