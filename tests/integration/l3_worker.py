"""A real process that answers prompts with ``SkippyLlama`` (settings from ``SKIPPY_*`` env).

Run as ``python l3_worker.py SPEC_JSON``; prints one JSON line with the outputs, the cache event of
every request and the L3 status of this process (after its queued writes were flushed). Used by
``test_l3_runtime.py`` so that L3 is exercised across real process restarts and concurrency.

SPEC keys: ``model`` (path), ``prompts`` (list of str), ``max_tokens`` (int), ``n_ctx`` (int),
``llama`` (extra ``Llama`` keyword arguments), ``start_at`` (unix time to wait for after loading,
so that several workers prefill at once), ``always_restore`` (L1/L2/L3 restores go ahead
whatever the measured costs say: the ``AlwaysRestore`` cost model, as the fixture of that name), ``gpu_like`` (a GPU
build's granule and record deferral, as ``SKIPPY_TEST_GPU_LIKE=1`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main(spec: dict[str, Any]) -> None:
    from skippy_llama.runtime.llama import SkippyLlama

    # the patches tests/conftest.py applies, from tests/runtime_patches.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import runtime_patches

    if spec.get("gpu_like"):
        runtime_patches.gpu_like()

    # no cache_settings: SKIPPY_* environment variables must be enough to turn L3 on
    from skippy_llama.costs import AlwaysRestore

    costs = AlwaysRestore() if spec.get("always_restore") else None
    llm = SkippyLlama(
        spec["model"],
        n_ctx=spec.get("n_ctx", 2048),
        verbose=False,
        cost_model=costs,
        **spec.get("llama", {}),
    )
    disk = llm.prefix_cache.disk
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "state_at_open": None if disk is None else disk.state,
        "outputs": [],
        "events": [],
        "granule": llm.granule,
    }
    if spec.get("start_at"):
        time.sleep(max(0.0, spec["start_at"] - time.time()))
    for prompt in spec["prompts"]:
        done = llm.create_completion(prompt, max_tokens=spec.get("max_tokens", 8), temperature=0.0)
        out["outputs"].append(done["choices"][0]["text"])
        event = llm.last_cache_event
        out["events"].append(None if event is None else event.to_dict())
    out["restores_skipped"] = llm.prefix_cache.counters.restores_skipped
    if disk is not None:
        out["flushed"] = llm.flush_cache(60)
        out["status"] = disk.status().to_json()
    out["counters"] = llm.cache_status()["counters"]
    out["tiers"] = llm.prefix_cache.status()  # every tier's status, through the protocol
    llm.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
