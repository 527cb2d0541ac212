"""Every input family of a slot: the synthetic ones (inputs.py), inputs captured from a live training run
(captured.py) and the magnitude sweeps (magnitudes.py). Those two import inputs.py's Case and Family, so they are
joined here rather than in inputs.families(), which would make an import loop."""
from __future__ import annotations

from .captured import captured_families
from .inputs import families as synthetic_families
from .magnitudes import magnitude_families


def families(slot: str, device: str, recipe=None, text=None) -> tuple:
    """(the families to run on `device`, notes on those left out). `recipe` (a name, a Recipe, or None for the
    probe's default) is the one whose training run the captured families come from; `text`: inputs.RealText."""
    fams, notes = synthetic_families(slot, device, text)
    captured, more = captured_families(slot, device, recipe)
    return fams + captured + magnitude_families(slot), notes + more
