"""What an ``attnrewrite bench`` sweep is asked: the model, the method, the lengths, the budgets
and how runs are repeated (BenchConfig), with the defaults the command line offers."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnrewrite.bench_machine import physical_memory_bytes
from attnrewrite.errors import AttnRewriteError

DEFAULT_LENGTHS = [128 * 2**i for i in range(8)]  # 128 .. 16384
DEFAULT_BUDGET_SECONDS = 10.0
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1
VARIANTS = ("original", "rewritten", "identity", "fused")


@dataclasses.dataclass
class BenchConfig:
    model: str
    method: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    lengths: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_LENGTHS))
    batch: int = 1
    budget_seconds: float = DEFAULT_BUDGET_SECONDS
    budget_gb: float | None = None  # None: 3/4 of physical memory
    provider: str = "cpu"
    fp16: bool = False
    threads: int | None = None
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    # Fresh processes per (model, N), their runs pooled: one process's speed varies by several
    # percent with where its memory lands, more than the differences some comparisons need.
    trials: int = 1
    # the fused-exact column; None: on for CUDA, where unfused exact attention is a straw man
    fused: bool | None = None

    def __post_init__(self):
        if self.repeats < 1 or self.warmup < 0 or self.batch < 1 or self.trials < 1 or self.budget_seconds <= 0:
            raise AttnRewriteError(
                "bench needs repeats >= 1, warmup >= 0, batch >= 1, trials >= 1 and a positive time budget"
            )
        if self.budget_gb is not None and self.budget_gb <= 0:
            raise AttnRewriteError("--budget-gb must be positive")
        if not self.lengths or min(self.lengths) < 1:
            raise AttnRewriteError("bench needs at least one positive length")

    @property
    def with_fused(self) -> bool:
        return self.provider == "cuda" if self.fused is None else self.fused

    @property
    def variants(self) -> tuple[str, ...]:
        return VARIANTS if self.with_fused else VARIANTS[:-1]

    @property
    def budget_bytes(self) -> int:
        gb = self.budget_gb if self.budget_gb is not None else 0.75 * physical_memory_bytes() / 2**30
        return int(gb * 2**30)
