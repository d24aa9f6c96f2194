"""A persistent compile cache, so that a worker joining a running fleet starts warm.

Two layers, both torch's own:

- a cache **directory** (``TORCHINDUCTOR_CACHE_DIR``): inductor's FX-graph cache, the
  AOTAutograd cache and the Triton kernels it generates. Workers on one machine, or on a
  shared filesystem, point at the same directory; the first one fills it, later ones skip
  code generation. Dynamo still traces each graph (seconds per block variant).
- a single **artifact file** (``torch.compiler.save_cache_artifacts``, the "mega-cache"): the
  same entries as one blob, written by a warm worker and loaded by a new one before it
  compiles anything, for machines that share no filesystem (ship the file with the image or
  an object store).

Both are keyed by torch / Triton versions, the GPU and the graph itself; an entry that does
not match is simply a miss, never a wrong kernel.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("omnirl.models.compile")


def use_cache_dir(path: str | Path) -> Path:
    """Point inductor (and its Triton kernels) at ``path``, created if missing.

    Takes effect for graphs compiled after the call (inductor reads the variable per
    lookup). Turns on the FX-graph and AOTAutograd caches where a torch build has them off.
    """
    path = Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "fx_graph_cache"):
        inductor_config.fx_graph_cache = True
    try:
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "enable_autograd_cache"):
            functorch_config.enable_autograd_cache = True
    except ImportError:  # pragma: no cover - older torch
        pass
    return path


def save_artifacts(path: str | Path) -> int:
    """Write every compile-cache entry made in this process to ``path`` (atomically).

    Returns the number of bytes written, 0 when there is nothing to save or this torch has
    no mega-cache (``torch.compiler.save_cache_artifacts``, torch >= 2.7).
    """
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        log.warning("this torch has no torch.compiler.save_cache_artifacts; nothing saved")
        return 0
    result = save()
    if result is None:
        return 0
    blob = result[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    log.info("saved %d bytes of compile cache to %s", len(blob), path)
    return len(blob)


def load_artifacts(path: str | Path) -> bool:
    """Load a file written by :func:`save_artifacts` into this process's caches.

    Call before the first compile. Returns False (and logs why) when the file is missing,
    or this torch cannot load it; compilation then simply starts cold.
    """
    path = Path(path)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not path.is_file():
        log.warning("no compile cache loaded from %s (missing file or torch < 2.7)", path)
        return False
    try:
        info = load(path.read_bytes())  # None: torch could not read the file (logged)
    except Exception as err:  # a file of another torch version: start cold
        log.warning("compile cache %s not loaded: %s", path, err)
        return False
    if info is None:
        log.warning("compile cache %s not loaded (unreadable or empty)", path)
        return False
    log.info("loaded compile cache %s", path)
    return True
