"""``skippy-llama kv-cache`` through the real CLI, and L3 shared by real processes.

Stores are real diskcache directories filled through DiskTier with synthetic pages (no model):
the CLI runs as ``python -m skippy_llama.cli.main`` and worker processes run :data:`WORKER`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import diskcache
import pytest

from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier

KiB = 1 << 10
GiB = 1 << 30

# Runs in worker processes (``python -c WORKER SPEC``) and, via exec, in this one, so both build
# byte-identical records from the same labels.
WORKER = r"""
import json, random, sys, time
import xxhash
from skippy_llama.config import L3Settings
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PageBlob, PrefixRecord

ROOT = b"\0" * 16


def make_record(labels, size, model="m1"):
    pages, parent = [], ROOT
    for label in labels:
        key = xxhash.xxh3_128_digest(parent + label.encode())
        # page magic + random (incompressible) bytes, stored as they are (compression "none")
        payload = b"SKPG" + random.Random(key).randbytes(size - 4)
        tokens = random.Random(label).randbytes(4 * 128)
        pages.append(PageBlob(key, parent, 128, tokens, payload, 128))
        parent = key
    return PrefixRecord("c" * 32, model, "Model " + model, 128 * len(pages), tuple(pages))


def open_tier(spec):
    settings = L3Settings(
        mode="fixed",
        budget=spec.get("budget", "1GiB"),
        directory=spec["dir"],
        minimum_free=spec.get("minimum_free", "1GiB"),
        compression="none",
    )
    return DiskTier(settings, verify=spec.get("verify", False))


def main(spec):
    tier = open_tier(spec)
    out = {"state": tier.state, "reason": tier.reason, "recorded": [], "read": []}
    if spec.get("start_at"):
        time.sleep(max(0.0, spec["start_at"] - time.time()))
    model = spec.get("model", "m1")
    for labels in spec.get("record", []):
        out["recorded"].append(tier.record(make_record(labels, spec["size"], model)))
    if spec.get("exit_without_close"):
        print(json.dumps(out))
        return  # the atexit hook must land the queued records
    out["flushed"] = tier.flush(60)
    for labels in spec.get("read", []):
        rec = make_record(labels, spec["size"], model)
        out["read"].append(len(tier.read([p.key for p in rec.pages])))
    tier.flush(60)
    status = tier.status()
    out["process_activity"] = status.process_activity.to_json()
    out["quarantined"] = status.usage.quarantined
    out["reconciliation"] = tier.reconciliation.to_json()
    tier.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""

_NS: dict[str, Any] = {"__name__": "kvcache_worker"}
exec(WORKER, _NS)
make_record = _NS["make_record"]


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    base.update(extra)
    return base


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """A private HOME/XDG cache, so nothing lands in the real default directory."""
    h = tmp_path / "home"
    h.mkdir()
    return env(HOME=str(h), XDG_CACHE_HOME=str(h / ".cache"))


def cli(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skippy_llama.cli.main", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=environ if environ is not None else env(),
        timeout=120,
    )


def flags(directory: Path, *extra: str) -> list[str]:
    return [
        "--l3-mode",
        "fixed",
        "--l3-budget",
        "1GiB",
        "--l3-dir",
        str(directory),
        "--l3-minimum-free",
        "1GiB",
        *extra,
    ]


def status_json(directory: Path, *extra: str, environ: dict[str, str] | None = None) -> Any:
    done = cli("kv-cache", "status", "--json", *flags(directory, *extra), environ=environ)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fill(directory: Path, records: list[tuple[list[str], str]], size: int = 100 * KiB) -> None:
    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=directory, minimum_free="1GiB", compression="none"
    )
    tier = DiskTier(settings, close_at_exit=False)
    for labels, model in records:
        assert tier.record(make_record(labels, size, model))
        assert tier.flush(30)
    tier.close()


def worker(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )


def finish(proc: subprocess.Popen[str]) -> Any:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    return json.loads(out)


def page_file(directory: Path, key: bytes) -> Path:
    with diskcache.Cache(str(directory)) as cache:
        handle = cache.get(b"\x07" + key, read=True)
        assert handle is not None and not isinstance(handle, bytes)
        with handle:
            return Path(handle.name)


# ---------------------------------------------------------------------- status


def test_status_json(tmp_path: Path, home: dict[str, str]) -> None:
    store = tmp_path / "l3"
    fill(store, [(["s", "a"], "m1"), (["s", "b"], "m1"), (["x"], "m2")])
    report = status_json(store, environ=dict(home, SKIPPY_L3__WRITER_QUEUE="8"))
    assert set(report) >= {
        "configured",
        "effective",
        "usage",
        "activity",
        "reconciliation",
        "inventory",
    }
    configured = report["configured"]
    assert configured["l3.mode"] == {"value": "fixed", "source": "cli"}
    assert configured["l3.budget"] == {"value": "1GiB", "source": "cli"}
    assert configured["l3.writer_queue"] == {"value": 8, "source": "env"}
    assert configured["page_tokens"]["source"] == "default"
    assert report["effective"]["state"] == "active" and report["effective"]["reason"] is None
    usage = report["usage"]
    assert usage["budget_bytes"] == GiB and usage["minimum_free_bytes"] == GiB
    assert usage["filesystem_available_bytes"] > 0 and usage["used_bytes"] >= 4 * 100 * KiB
    assert (usage["manifests"], usage["pages"], usage["quarantined"]) == (3, 4, 0)
    activity = report["activity"]
    for name in ("hits", "misses", "writes", "evictions", "corrupt_entries", "bytes_read"):
        assert name in activity
    assert activity["writes"] == 4 and activity["bytes_written"] == 4 * 100 * KiB
    assert activity["dropped_writes"] == 0
    assert report["reconciliation"]["ran"] is True
    inventory = {e["model_identity"]: e for e in report["inventory"]}
    assert inventory["m1"] == {
        "model_identity": "m1",
        "model_name": "Model m1",
        "manifests": 2,
        "pages": 3,
        "bytes": 3 * 100 * KiB,
        "tokens": 4 * 128,
    }
    assert inventory["m2"]["manifests"] == 1
    # what L1 will hold beside the context: by default n_ctx tokens, ≤ 2× plain Llama's KV
    assert report["l1"]["enabled"] is True and report["l1"]["budget_tokens"] == "n_ctx"
    human = cli("kv-cache", "status", *flags(store), environ=home)
    assert human.returncode == 0 and "L3 disk cache: active" in human.stdout
    assert "l3.mode = 'fixed' (cli)" in human.stdout
    assert "KV memory ≤ 2× that of plain Llama" in human.stdout
    budget = status_json(store, environ=dict(home, SKIPPY_L1__BUDGET_TOKENS="8192"))
    assert budget["l1"]["budget_tokens"] == 8192


def test_status_off_creates_no_directory(tmp_path: Path, home: dict[str, str]) -> None:
    store = tmp_path / "never"
    done = cli("kv-cache", "status", "--json", "--l3-dir", str(store), environ=home)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["effective"]["state"] == "off"
    assert report["configured"]["l3.mode"] == {"value": "off", "source": "default"}
    assert not store.exists()
    assert not (Path(home["XDG_CACHE_HOME"]) / "skippy-llama").exists()


# ---------------------------------------------------------------------- prune and clear


def test_prune_to_target(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    fill(store, [([f"r{i}a", f"r{i}b"], "m1") for i in range(6)])
    before = status_json(store)["usage"]["used_bytes"]
    target = before // 2
    done = cli("kv-cache", "prune", "--target", f"{target}B", "--yes", "--json", *flags(store))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["target_bytes"] == target and result["reached_target"] is True
    assert result["bytes_before"] == before and result["bytes_after"] <= target
    # eviction takes pages (by the store's policy, deepest first on ties): a prefix that loses
    # its last page is cut back to its first one, a prefix that loses both is removed
    assert 0 <= result["manifests_removed"] < 6
    assert 2 * result["manifests_removed"] <= result["pages_removed"] < 12
    usage = status_json(store)["usage"]
    assert usage["used_bytes"] <= target
    assert usage["manifests"] == 6 - result["manifests_removed"]
    assert usage["pages"] == 12 - result["pages_removed"]
    human = cli("kv-cache", "prune", "--target", "1GiB", "--yes", *flags(store))
    assert human.returncode == 0 and "pruned 0 prefixes" in human.stdout


def test_prune_keeps_entries_in_use(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    records = [([f"r{i}a", f"r{i}b"], "m1") for i in range(4)]
    fill(store, records)
    settings = L3Settings(mode="fixed", budget="1GiB", directory=store, minimum_free="1GiB")
    holder = DiskTier(settings, reconcile=False, close_at_exit=False)
    in_use = make_record(records[0][0], 100 * KiB)
    keys = [p.key for p in in_use.pages]
    with holder.pinned(keys):  # this live process is using the oldest entry
        done = cli("kv-cache", "prune", "--target", "1B", "--yes", "--json", *flags(store))
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["kept_in_use"] == 1 and result["manifests_removed"] == 3
        assert result["reached_target"] is False
        assert "in use" in done.stderr
        assert status_json(store)["usage"]["manifests"] == 1
        assert len(holder.read(keys)) == 2
    holder.close()
    done = cli("kv-cache", "prune", "--target", "1B", "--yes", "--json", *flags(store))
    assert json.loads(done.stdout)["manifests_removed"] == 1


def test_clear_by_model_then_all(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    fill(store, [(["a1", "a2"], "m1"), (["b1"], "m2"), (["b1", "b2"], "m2")])
    done = cli("kv-cache", "clear", "--model-identity", "m2", "--yes", "--json", *flags(store))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["manifests_removed"] == 2 and result["manifests_left"] == 0
    assert result["pages_removed"] == 2
    report = status_json(store)
    assert [e["model_identity"] for e in report["inventory"]] == ["m1"]
    done = cli("kv-cache", "clear", "--yes", *flags(store))
    assert done.returncode == 0 and "cleared 1 prefixes" in done.stdout
    usage = status_json(store)["usage"]
    assert (usage["manifests"], usage["pages"]) == (0, 0)


@pytest.mark.parametrize("action", ["prune", "clear"])
def test_model_identity_errors(tmp_path: Path, action: str) -> None:
    store = tmp_path / "l3"
    fill(store, [(["a"], "m1"), (["b"], "m2")])
    unknown = cli("kv-cache", action, "--model-identity", "nope", "--yes", *flags(store))
    assert unknown.returncode == 2
    assert "unknown model identity 'nope'" in unknown.stderr
    assert "m1 (Model m1)" in unknown.stderr and "m2 (Model m2)" in unknown.stderr
    blank = cli("kv-cache", action, "--model-identity=", "--yes", *flags(store))
    assert blank.returncode == 2 and "blank" in blank.stderr
    assert status_json(store)["usage"]["manifests"] == 2


def test_confirmation_needed_without_a_terminal(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    fill(store, [(["a"], "m1")])
    for action in (["prune", "--target", "1B"], ["clear"]):
        done = cli("kv-cache", *action, *flags(store))
        assert done.returncode == 2
        assert "--yes" in done.stderr and done.stderr.startswith("skippy-llama: error:")
    assert status_json(store)["usage"]["manifests"] == 1


def test_prune_with_l3_off_is_an_error(tmp_path: Path, home: dict[str, str]) -> None:
    done = cli("kv-cache", "clear", "--yes", "--l3-dir", str(tmp_path / "x"), environ=home)
    assert done.returncode == 2 and "L3 is off" in done.stderr


# ---------------------------------------------------------------------- config rejections


@pytest.mark.parametrize(
    ("args", "extra_env", "field"),
    [
        (["--l3-mode", "fixed", "--l3-budget", "100"], {}, "l3.budget"),
        (["--l3-mode", "fixed", "--l3-budget", "10GB"], {}, "l3.budget"),
        (["--l3-mode", "fixed", "--l3-budget", "0MiB"], {}, "l3.budget"),
        (["--l3-mode", "fixed", "--l3-budget=-1GiB"], {}, "l3.budget"),
        (["--l3-mode", "auto", "--l3-dir", "relative/dir"], {}, "l3.directory"),
        (["--l3-mode", "fixed"], {}, "l3.budget"),
        (["--l3-mode", "auto", "--l3-minimum-free", "512MiB"], {}, "l3.minimum_free"),
        (["--l2-budget", "64"], {}, "l2.budget"),
        ([], {"SKIPPY_L3__MODE": "fixed", "SKIPPY_L3__BUDGET": "2GB"}, "l3.budget"),
        ([], {"SKIPPY_L3__MINIMUM_FREE": "100MiB"}, "l3.minimum_free"),
    ],
)
def test_config_rejections_through_the_cli(
    home: dict[str, str], args: list[str], extra_env: dict[str, str], field: str
) -> None:
    done = cli("kv-cache", "status", *args, environ=dict(home, **extra_env))
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith("skippy-llama: error: invalid setting")
    assert field in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_target_size_is_rejected(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    fill(store, [(["a"], "m1")])
    done = cli("kv-cache", "prune", "--target", "5GB", "--yes", *flags(store))
    assert done.returncode == 2 and "--target" in done.stderr and "'5GB'" in done.stderr


# ---------------------------------------------------------------------- shared by processes


def test_four_processes_write_each_page_once(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    labels = [["sys", "doc", f"q{i}", f"t{i}"] for i in range(3)]  # 2 shared + 2×3 own pages
    distinct = 2 + 2 * 3
    spec = {
        "dir": str(store),
        "size": 64 * KiB,
        "record": labels,
        "read": labels,
        "start_at": time.time() + 2.0,  # all four record at the same moment
    }
    procs = [worker(spec) for _ in range(4)]
    outs = [finish(p) for p in procs]
    for out in outs:
        assert out["state"] == "active" and all(out["recorded"]) and out["flushed"]
        activity = out["process_activity"]
        assert activity["storage_errors"] == 0 and activity["dropped_writes"] == 0
        assert out["read"] == [4, 4, 4]
    assert sum(o["process_activity"]["writes"] for o in outs) == distinct
    usage = status_json(store)["usage"]
    assert (usage["pages"], usage["manifests"]) == (distinct, 3)


def test_pending_writes_land_at_normal_exit(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    labels = [[f"p{i}", "x", "y"] for i in range(5)]
    spec = {"dir": str(store), "size": 200 * KiB, "record": labels, "exit_without_close": True}
    out = finish(worker(spec))
    assert out["recorded"] == [True] * 5
    usage = status_json(store)["usage"]
    assert (usage["manifests"], usage["pages"]) == (5, 15)


def test_low_space_is_read_only_and_still_serves(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    fill(store, [(["a", "b"], "m1")])
    spec = {
        "dir": str(store),
        "size": 100 * KiB,
        "minimum_free": "1000TiB",  # more than any disk here has free
        "record": [["new"]],
        "read": [["a", "b"]],
    }
    out = finish(worker(spec))
    assert out["state"] == "read_only_low_space"
    assert out["recorded"] == [False] and out["read"] == [2]
    assert out["process_activity"]["writes"] == 0
    assert out["process_activity"]["dropped_low_space"] == 1
    report = status_json(store, "--l3-minimum-free", "1000TiB")
    assert report["effective"]["state"] == "read_only_low_space"
    assert report["usage"]["manifests"] == 1


def test_flipped_byte_is_quarantined_and_reported(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    labels = ["a", "b", "c"]
    fill(store, [(labels, "m1")])
    rec = make_record(labels, 100 * KiB)
    path = page_file(store, rec.pages[1].key)
    data = bytearray(path.read_bytes())
    data[12345] ^= 0x40
    path.write_bytes(bytes(data))

    out = finish(worker({"dir": str(store), "size": 100 * KiB, "read": [labels, labels]}))
    assert out["read"] == [1, 1]  # the valid prefix, before and after the quarantine
    assert out["process_activity"]["corrupt_entries"] == 1

    report = status_json(store)
    assert report["usage"]["quarantined"] == 1
    assert report["activity"]["corrupt_entries"] == 1

    # the next process (no walk at open: reconciliation is off the request path) still reports
    # the quarantine record and serves the valid prefix
    again = finish(worker({"dir": str(store), "size": 100 * KiB, "read": [labels]}))
    assert again["quarantined"] == 1
    assert again["read"] == [1]
    assert status_json(store)["usage"]["quarantined"] == 1


def test_status_lists_restore_points_per_model(tmp_path: Path, home: dict[str, str]) -> None:
    """Restore points (recurrent and hybrid models) are listed with each point's length and
    bytes, in JSON and in text."""
    import numpy as np

    from skippy_llama.restore_points import PointOwner, RestorePoint

    directory = tmp_path / "l3"
    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=directory, minimum_free="1GiB", compression="none"
    )
    tier = DiskTier(settings, close_at_exit=False)
    owner = PointOwner("model-a", "Hybrid A")
    for n in (90, 300):
        tokens = np.arange(3, 3 + n, dtype=np.int32)
        assert tier.put_point(b"\0" * 16, RestorePoint(tokens, bytes(5000 + n)), owner)
    tier.close()
    report = status_json(directory, environ=home)
    (entry,) = report["restore_points"]
    assert entry["model_identity"] == "model-a" and entry["points"] == 2
    assert [n for n, _ in entry["sizes"]] == [90, 300]
    assert report["usage"]["restore_points"] == 2
    assert report["usage"]["restore_point_bytes"] == entry["bytes"] > 10_000
    text = cli("kv-cache", "status", *flags(directory), environ=home)
    assert text.returncode == 0, text.stderr
    assert "restore points (recurrent and hybrid models): 2" in text.stdout
    assert "Hybrid A: 2 points" in text.stdout
