"""Lightning's console noise, turned down for every verb that trains."""
from __future__ import annotations

import os


def quiet_lightning():
    """Lightning's banners (GPU available, tips, deprecations) bury our own output; keep its errors."""
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    os.environ.setdefault("LITLOGGER_DISABLE_TIP", "1")
