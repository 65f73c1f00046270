"""Restore points on a synthetic hybrid model (issue 46): a chat and a shared document, CPU.

Two workloads, each run by plain ``llama_cpp.Llama`` and by ``SkippyLlama`` (L3 on) on the same
synthetic GGUF (``skippy_llama.testing.synthetic``, a larger shape than the tests' so prefill
dominates as it does on real models), one thread each, greedy, outputs compared token for token
and by first-token logits:

- ``chat``: a system prompt and 8 turns. Each turn's history keeps only the second half of the
  previous reply (as Qwen3.5's chat template drops an earlier turn's reasoning), so the next
  prompt extends the previous *prompt* but not the live sequence: plain ``Llama`` would have to
  roll its recurrent state back and re-evaluates the whole prompt; SkippyLlama restores the
  point at the previous prompt's end. Reported: the total of the 8 turns, skippy ÷ plain
  (target ≤ 0.5).
- ``doc``: a 2,000-token document and 6 questions (prompt = document + question). Reported: the
  TTFT of questions 2-6 ÷ plain ``Llama``'s (cold: it re-evaluates every prompt), in process
  (restore points at multiples of 256 tokens of the document, from L1) and after a restart (a
  new process on the same L3 directory answers questions 2-6: L3, then L1), target ≤ 0.3.

Two more arms carry the document's points to another host (issue 46's remote tier and
bundles), each answered by a new process whose own L3 is empty:

- ``remote`` (with ``--redis-server BIN``: a ``redis-server`` started on a Unix socket in a
  scratch directory): the in-process SkippyLlama also pushes its points to the server; the new
  process restores from there (then L1).
- ``bundle``: the deepest point of the document's prefill, with the shallower ones it extends,
  exported from the first L3 as a signed bundle (``skippy_llama.handoff.points``) and imported
  into an empty L3, which the new process reads.

Reported as TTFT of questions 2-6 ÷ plain ``Llama``'s, like the restart.

``--family gemma3`` runs the document workload on Gemma 3 270M Q4_K_M (sliding window, the
``model`` extra; no chat): its restore points sit on multiples of 512 tokens
(``skippy_llama.runtime.restore_points.SWA_ALIGN`` and ``n_ubatch``). Plain ``Llama`` answers
each question from an empty context there (cold): it can keep a sliding-window model's document
cells in its live sequence, which only that one process and conversation has.

Usage::

    .venv/bin/python benchmarks/bench_restore_points.py --family qwen35 --rounds 3 \\
        --out benchmarks/results/restore-points-bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from patched_common import provenance

from skippy_llama import SkippyLlama
from skippy_llama.config import Settings
from skippy_llama.testing.synthetic import FAMILIES, Shape, write_model
from skippy_llama.tiers.l3.tier import DiskTier

_quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept: llama.cpp holds the pointer

#: prefill dominates a request here as on real models (the tests' default shape decodes a
#: token in about the time it prefills a few)
SHAPE = Shape(n_layer=8, n_embd=256, n_ff=768, n_head=4, n_head_kv=2)
N_CTX = 4096
SYSTEM, USER, REPLY, TURNS = 400, 40, 16, 8
DOC, QUESTION, ANSWER, QUESTIONS = 2000, 20, 4, 6


def _tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 400, size=n)]


#: the remote arm's server: (url, secret file), set by main() with --redis-server
REMOTE: tuple[str, Path] | None = None


def _settings(l3: Path, remote: tuple[str, Path] | None = None) -> Settings:
    extra: dict[str, Any] = {}
    if remote is not None:
        extra["remote"] = {"url": remote[0], "secret_file": str(remote[1])}
    return Settings(
        l3={"mode": "fixed", "budget": "4GiB", "directory": str(l3), "minimum_free": "1GiB"},
        **extra,
    )


def _open(path: Path, l3: Path | None) -> llama_cpp.Llama:
    kwargs: dict[str, Any] = {
        "n_ctx": N_CTX,
        "n_threads": 1,
        "n_threads_batch": 1,
        "verbose": False,
    }
    if l3 is None:
        return llama_cpp.Llama(str(path), **kwargs)
    return SkippyLlama(str(path), cache_settings=_settings(l3, REMOTE), **kwargs)


def _ask(llm: llama_cpp.Llama, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens, first-token logits' digest, TTFT and total seconds."""
    t0 = time.perf_counter()
    tokens: list[int] = []
    ttft = 0.0
    first = b""
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        if not tokens:
            ttft = time.perf_counter() - t0
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
            )
            first = logits.tobytes()
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    total = time.perf_counter() - t0
    event = getattr(llm, "last_cache_event", None)
    return {
        "ttft_s": ttft,
        "total_s": total,
        "tokens": tokens,
        "logits_bytes": first,
        "tier": getattr(event, "tier", None),
        "cached": getattr(event, "cached_tokens", None),
    }


def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "logits_bytes"}


def chat(path: Path, l3: Path | None) -> dict[str, Any]:
    llm = _open(path, l3)
    try:
        prompt = _tokens(SYSTEM, 1)
        turns = []
        t0 = time.perf_counter()
        for i in range(TURNS):
            prompt = prompt + _tokens(USER, 100 + i)
            row = _ask(llm, prompt, REPLY)
            turns.append(row)
            # the history keeps the answer, not the reasoning (the reply's first half)
            prompt = prompt + row["tokens"][REPLY // 2 :]
        total = time.perf_counter() - t0
    finally:
        llm.close()
    return {"total_s": total, "turns": turns}


def doc(path: Path, l3: Path | None, questions: range, *, cold: bool = False) -> dict[str, Any]:
    """The document's questions; ``cold``: each from an empty context (plain ``Llama`` would
    otherwise keep the document's cells of a sliding-window model and decode only the
    question, which no restart or other prompt in between leaves it)."""
    llm = _open(path, l3)
    document = _tokens(DOC, 7)
    rows = []
    try:
        for q in questions:
            if cold:
                llm.reset()
            rows.append(_ask(llm, document + _tokens(QUESTION, 200 + q), ANSWER))
    finally:
        llm.close()
    return {"questions": list(questions), "rows": rows}


def _points(l3: Path) -> dict[str, int]:
    """Restore points the L3 directory holds and their bytes (read-only, as kv-cache status)."""
    tier = DiskTier(_settings(l3).l3, read_only=True, close_at_exit=False)
    try:
        usage = tier.status().usage
    finally:
        tier.close()
    return {"points": usage.restore_points, "bytes": usage.restore_point_bytes}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return all(
        x["tokens"] == y["tokens"] and x["logits_bytes"] == y["logits_bytes"]
        for x, y in zip(a, b, strict=True)
    )


def _child(args: argparse.Namespace) -> None:
    """The restart, remote and bundle arms: a new process on the L3 directory (with the
    remote server when given) answers the questions 2-6."""
    global REMOTE
    llama_cpp.llama_log_set(_quiet, None)
    if args.remote_url:
        REMOTE = (args.remote_url, args.remote_secret)
    result = doc(args.model, args.l3, range(1, QUESTIONS))
    for row in result["rows"]:
        row["logits_bytes"] = row["logits_bytes"].hex()
    print(json.dumps(result))


def _restart(model: Path, l3: Path, remote: tuple[str, Path] | None = None) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--model", str(model), "--l3", str(l3)]
    if remote is not None:
        argv += ["--remote-url", remote[0], "--remote-secret", str(remote[1])]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ),
        cwd=Path.cwd(),
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    for row in result["rows"]:
        row["logits_bytes"] = bytes.fromhex(row["logits_bytes"])
    return result


def _start_redis(binary: str, scratch: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A ``redis-server`` on a Unix socket in ``scratch``: (process, url, secret file)."""
    from bench_remote import ping_until_up  # imports redis: only where a server is asked for

    sock = scratch / "redis.sock"
    proc = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
         "--save", "", "--appendonly", "no", "--dir", str(scratch)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"unix://{sock}?db=0"
    ping_until_up(url)
    secret = scratch / "remote.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    return proc, url, secret


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()


def _bundle(source: Path, target: Path, scratch: Path) -> dict[str, Any]:
    """Export the deepest point of the document's prefill (and the shallower ones it extends)
    from L3 ``source`` and import it into the empty L3 ``target``."""
    from skippy_llama.handoff.bundle import generate_keypair, load_trust, read_signed
    from skippy_llama.handoff.points import export_points, import_points, read_point_bundle

    key, pub = scratch / "bundle.pem", scratch / "bundle.pub.pem"
    if not key.exists():
        generate_keypair(key, pub)
    out = scratch / "doc.skb"
    tier = DiskTier(_settings(source).l3, close_at_exit=False)
    try:
        deepest = max(
            (m for m in tier.point_metas() if m.n_tokens <= DOC), key=lambda m: m.n_tokens
        )
        t0 = time.perf_counter()
        exported = export_points(tier, deepest.key.hex(), out, key)
        export_s = time.perf_counter() - t0
    finally:
        tier.close()
    tier = DiskTier(_settings(target).l3, close_at_exit=False)
    try:
        t0 = time.perf_counter()
        bundle = read_point_bundle(out, read_signed(out, load_trust(pub)))
        imported = import_points(tier, bundle)
        import_s = time.perf_counter() - t0
    finally:
        tier.close()
    return {
        "tokens": exported.tokens,
        "bytes": exported.bytes,
        "snapshot_bytes": exported.snapshot_bytes,
        "page_bytes": exported.page_bytes,
        "export_s": export_s,
        "import_s": import_s,
        "stored": imported.stored,
    }


def main() -> None:
    global REMOTE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen35", choices=[*sorted(FAMILIES), "gemma3"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--redis-server", metavar="BIN", help="run the remote arm on this redis-server binary"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--remote-url", help=argparse.SUPPRESS)
    parser.add_argument("--remote-secret", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--l3", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    llama_cpp.llama_log_set(_quiet, None)
    scratch = Path(tempfile.mkdtemp(prefix="bench-rp-"))
    server: subprocess.Popen[bytes] | None = None
    try:
        remote: tuple[str, Path] | None = None
        if args.redis_server:
            server, url, secret = _start_redis(args.redis_server, scratch)
            remote = (url, secret)
        swa = args.family == "gemma3"
        if swa:
            from skippy_llama.models import gemma3_model_path

            model = gemma3_model_path()
        else:
            model = write_model(scratch / f"{args.family}.gguf", args.family, shape=SHAPE)
        probe = SkippyLlama(
            str(model),
            n_ctx=N_CTX,
            n_threads=1,
            verbose=False,
            cache_settings=_settings(scratch / "probe"),
        )
        on = probe.restore_points is not None
        probe.close()
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            l3 = scratch / f"l3-{r}"
            empty: dict[str, Any] = {"total_s": float("nan"), "turns": []}
            plain_chat = empty if swa else chat(model, None)
            skippy_chat = empty if swa else chat(model, l3 / "chat")
            plain_doc = doc(model, None, range(QUESTIONS), cold=swa)
            if remote is not None:  # each round's host A starts from an empty server
                _flush(remote[0])
            REMOTE = remote  # host A pushes its points to the server too (off the TTFT)
            skippy_doc = doc(model, l3 / "doc", range(QUESTIONS))
            REMOTE = None
            restart = _restart(model, l3 / "doc")
            moved = _bundle(l3 / "doc", l3 / "bundle", scratch)
            from_bundle = _restart(model, l3 / "bundle")
            from_remote = _restart(model, l3 / "remote", remote) if remote else None
            cold = [row["ttft_s"] for row in plain_doc["rows"][1:]]
            warm = [row["ttft_s"] for row in skippy_doc["rows"][1:]]
            again = [row["ttft_s"] for row in restart["rows"]]
            summary = {
                "chat_total_ratio": skippy_chat["total_s"] / plain_chat["total_s"],
                "doc_ttft_q2_6_ratio": sum(warm) / sum(cold),
                "doc_ttft_q2_6_ratio_max": max(w / c for w, c in zip(warm, cold, strict=True)),
                "restart_ttft_q2_6_ratio": sum(again) / sum(cold),
                "restart_ttft_q2_6_ratio_max": max(a / c for a, c in zip(again, cold, strict=True)),
                "chat_equal": swa or _same(plain_chat["turns"], skippy_chat["turns"]),
                "doc_equal": _same(plain_doc["rows"], skippy_doc["rows"]),
                "restart_equal": _same(plain_doc["rows"][1:], restart["rows"]),
                "bundle_ttft_q2_6_ratio": sum(r["ttft_s"] for r in from_bundle["rows"]) / sum(cold),
                "bundle_equal": _same(plain_doc["rows"][1:], from_bundle["rows"]),
            }
            if from_remote is not None:
                summary["remote_ttft_q2_6_ratio"] = sum(
                    r["ttft_s"] for r in from_remote["rows"]
                ) / sum(cold)
                summary["remote_equal"] = _same(plain_doc["rows"][1:], from_remote["rows"])
            print(f"round {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))
            rounds.append(
                {
                    "summary": summary,
                    "chat": {
                        "plain": {**plain_chat, "turns": [_strip(t) for t in plain_chat["turns"]]},
                        "skippy": {
                            **skippy_chat,
                            "turns": [_strip(t) for t in skippy_chat["turns"]],
                        },
                    },
                    "doc": {
                        "plain": [_strip(t) for t in plain_doc["rows"]],
                        "skippy": [_strip(t) for t in skippy_doc["rows"]],
                        "restart": [_strip(t) for t in restart["rows"]],
                        "bundle": [_strip(t) for t in from_bundle["rows"]],
                        "remote": [_strip(t) for t in from_remote["rows"]] if from_remote else [],
                    },
                    "bundle": moved,
                    "l3_bytes": sum(f.stat().st_size for f in l3.rglob("*") if f.is_file()),
                    "l3_points": {
                        "chat": {} if swa else _points(l3 / "chat"),
                        "doc": _points(l3 / "doc"),
                    },
                }
            )
        keys = rounds[0]["summary"].keys()
        medians = {
            k: statistics.median(float(r["summary"][k]) for r in rounds)
            for k in keys
            if not k.endswith("_equal")
        }
        result = {
            **provenance("bench_restore_points.py"),
            "family": args.family,
            "memory": "sliding window" if swa else FAMILIES[args.family],
            "shape": {"model": model.name} if swa else vars(SHAPE),
            "restore_points_on": on,
            "workloads": {
                "chat": {"system": SYSTEM, "user": USER, "reply": REPLY, "turns": TURNS},
                "doc": {"doc": DOC, "question": QUESTION, "answer": ANSWER, "n": QUESTIONS},
            },
            "load": os.getloadavg(),
            "medians": medians,
            "all_equal": all(r["summary"][k] for r in rounds for k in keys if k.endswith("_equal")),
            "rounds": rounds,
        }
        print(json.dumps({"medians": medians, "all_equal": result["all_equal"]}, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
