"""Which of a prefill chunk's planned boundaries get a checkpoint row, and where a chunk ends so
that they all can.

The kernels write a chunk's snapshots during one forward pass, so each needs its own device row
at once (CheckpointPool.reserve); between steps the pool spills them to its host tier. When a
chunk crosses more boundaries than there are device rows it can reserve:
- `chunk_length` ends it early, at the last boundary that gets a row, when that keeps at least
  MIN_KEPT of its tokens: the rest go in the next step, once the pool can spill these (one
  shorter step more, rather than anchors lost). A shorter cut is not made: on a model whose
  experts stream over PCIe every prefill chunk pays a whole pass over the experts, so chunks
  must not shrink without bound where anchors are dense and rows few;
- with no row left at all (the step's other chunks hold them: a request admitted into the
  budget an earlier chunk left), it ends just before its first boundary, which the next step
  snapshots with the rows free again;
- otherwise `kept_boundaries` spreads the rows over the chunk: its shallowest and deepest
  boundaries and evenly spaced ones between, so an edit anywhere in the chunk resumes at most
  about len(chunk) / rows tokens before its divergence. (The deepest alone, the earlier rule,
  lost a chunk's shallowest boundaries: in a history's first chunk the end of the system
  prompt and tools, which every session of the same agent shares, so a new session, or an edit
  of the first message, re-prefilled from token 0.)
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_KEPT = 0.75  # the least share of a chunk's tokens an early end keeps


def chunk_length(boundaries: Sequence[int], start: int, n: int, rows: int) -> int:
    """The tokens to prefill from `start`: `n`, or fewer, ending at a boundary, so that every
    boundary inside gets one of the `rows` reservable device rows. `boundaries`: the sorted
    planned boundaries in (start, start + n] not yet given a row; `rows` 0 only while rows
    exist but are held (a pool without device rows never cuts: nothing would come of it)."""
    if len(boundaries) <= rows:
        return n
    if rows < 1:  # (a chunk that starts right before its first boundary crosses it: progress)
        end = boundaries[0] - 1 - start
        return end if end >= 1 else n
    end = boundaries[rows - 1] - start
    return end if end >= MIN_KEPT * n else n


def kept_boundaries(boundaries: Sequence[int], rows: int) -> list[int]:
    """At most `rows` of the sorted `boundaries`: all of them when they fit, else the first, the
    last and evenly spaced ones between (sorted)."""
    k = len(boundaries)
    if k <= rows:
        return list(boundaries)
    if rows < 1:
        return []
    if rows == 1:
        return [boundaries[-1]]  # the deepest: where a request continuing the history resumes
    # k > rows: consecutive picks are more than one index apart, so they are distinct
    return [boundaries[round(i * (k - 1) / (rows - 1))] for i in range(rows)]
