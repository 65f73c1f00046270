"""``skippy-llama matrix``: workloads × tiers × K/V types × backends, beside a cold plain ``Llama``.

``config`` says what a run covers, ``workloads`` builds the requests, ``runner`` runs them side
by side, ``store`` reads what the tiers kept and runs the store gates, ``gates`` turns cells into
report rows, ``portability`` measures ``cross_backend``, ``report`` writes JSON, Markdown and PNGs,
and ``run`` ties them together.
"""

from __future__ import annotations

from .config import PRESETS, Backend, MatrixConfig
from .run import run_matrix

__all__ = ["PRESETS", "Backend", "MatrixConfig", "run_matrix"]
