"""The preflight probe: a candidate op against its float64 oracle across the inputs real training produces and
the ones benchmark verifiers forget (`divergence probe --kernel SLOT --candidate SPEC`, `make probe`; also run
before every A/B run unless skipped). See run.py for the checks and inputs.py for the input families."""
from .run import format_table, run_probe, verdict_line

__all__ = ["run_probe", "format_table", "verdict_line"]
