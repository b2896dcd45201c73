"""`contract` on the default configuration of every model type the installed transformers knows.

For each model type: its config class with default values is saved with ``save_pretrained`` to a temporary
folder (the form a checkpoint's config.json takes), transformers itself is asked to build a model from it on
the meta device (the denominator: types whose model transformers can build), and ``normscope.artifacts.contract``
reads the file. Each type runs in a worker process with a time limit; the CPU seconds and the rise of the
worker's peak resident memory are its own (the worker has imported torch, transformers' modelling base and
normscope once, as a long-lived process has: a fresh `normscope contract` adds those imports, a few seconds).
The table prints ok / refused (by class) / failed, and the types outside the target.

    python bench/contract_coverage.py                 # every type, 2 workers (about an hour on 2 cores)
    python bench/contract_coverage.py --sample 70     # a fixed sample spread over the list
    python bench/contract_coverage.py llama bart      # the named types, with each refusal's message
    python bench/contract_coverage.py --json out.json # the rows as JSON too

Target (docs/contract.md): a contract for ≥ 95 % of the types transformers builds, each ≤ 10 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

LIMIT_S = 60  # wall seconds a type may take before its worker is killed (the target is 10 s of CPU)

WORKER = r"""
import json, os, sys, tempfile, threading, time, warnings
parent = os.getppid()
def orphaned():  # the bench was stopped: a worker busy on one type must not run on
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)
threading.Thread(target=orphaned, daemon=True).start()
warnings.filterwarnings("ignore")
import torch, transformers
transformers.logging.set_verbosity_error()
from transformers.models.auto import configuration_auto, modeling_auto
from normscope.artifacts import contract
from normscope.errors import NormscopeError
import transformers.modeling_utils, normscope.sites, normscope.model  # what every read imports, once per process

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])  # KiB

def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

MAPPINGS = [getattr(modeling_auto, n) for n in dir(modeling_auto) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")]
MAPPINGS.sort(key=lambda m: m is not modeling_auto.MODEL_MAPPING_NAMES)  # the base model first

def buildable(config):
    # transformers' own build from the config, on the meta device: the base model, else any head it maps
    for mapping in MAPPINGS:
        name = mapping.get(config.model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        cls = getattr(transformers, name, None) if name else None
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                cls(config)
            return name
        except Exception as exc:
            return None
    return None

print("ready", flush=True)
for line in sys.stdin:
    model_type = line.strip()
    row = {"type": model_type}
    try:
        config = configuration_auto.CONFIG_MAPPING[model_type]()
    except Exception as exc:
        row.update(outcome="no-config", message=f"{type(exc).__name__}: {exc}"[:300])
        print(json.dumps(row), flush=True)
        continue
    row["builds"] = buildable(config)
    print(json.dumps({"builds": row["builds"]}), flush=True)  # known to the bench even if the read then times out
    with tempfile.TemporaryDirectory() as tmp:
        try:
            config.save_pretrained(tmp)
        except Exception as exc:
            row.update(outcome="no-config", message=f"save_pretrained: {type(exc).__name__}: {exc}"[:300])
            print(json.dumps(row), flush=True)
            continue
        reset_peak()
        base = status("VmRSS")
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            c = contract(os.path.join(tmp, "config.json"))
            row.update(outcome="ok", sites=len(c.sites), notes=c.notes[-1:] if c.notes else [])
        except NormscopeError as exc:
            row.update(outcome="refused", message=str(exc).replace(tmp, "CONFIG")[:600])
        except Exception as exc:
            row.update(outcome="error", message=f"{type(exc).__name__}: {exc}"[:600])
        row.update(cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall,
                   rise_mib=(status("VmHWM") - base) / 1024)
    print(json.dumps(row), flush=True)
"""

#: refusal classes, by the words of the message (first match)
CLASSES = [
    ("too large to build", "too large (meta device refused, no reduced build)"),
    ("could not build", "transformers could not build it"),
    ("not an architecture", "unknown model_type"),
    ("could not be scanned", "scan refused"),
    ("no normalization site", "no norm site"),
    ("must be a positive integer", "config validation"),
    ("must be a finite number", "config validation"),
    ("no model_type", "config validation"),
    ("the ε", "ε not stated"),
    ("", "other"),
]


def classify(message: str) -> str:
    return next(name for key, name in CLASSES if key in message)


def model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


class Worker:
    def __init__(self, src: Path):
        env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.lines.get(timeout=900)  # a loaded machine takes minutes to import torch and transformers
        if ready.strip() != "ready":
            raise SystemExit(f"a worker did not start: {ready!r}")

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def run(self, model_type: str) -> dict | None:
        self.proc.stdin.write(model_type + "\n")
        self.proc.stdin.flush()
        self.builds = None
        try:
            line = self.lines.get(timeout=LIMIT_S)
            first = json.loads(line) if line else None
            if first is None or "outcome" in first:  # no config: no build line came first
                return first
            self.builds = first["builds"]
            line = self.lines.get(timeout=LIMIT_S)
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def kill(self):
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("types", nargs="*", help="model types to run (default: all)")
    p.add_argument("--sample", type=int, help="a fixed sample of N types spread over the sorted list")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", help="write the rows to this file (and each as it comes to FILE + 'l', JSON lines)")
    args = p.parse_args()
    src = Path(__file__).resolve().parent.parent / "src"
    types = args.types or model_types()
    if args.sample:
        step = len(types) / args.sample
        types = [types[int(i * step)] for i in range(args.sample)]
    todo: queue.Queue[str] = queue.Queue()
    for t in types:
        todo.put(t)
    rows: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def drive():
        worker = Worker(src)
        while True:
            try:
                t = todo.get_nowait()
            except queue.Empty:
                break
            row = worker.run(t)
            if row is None:  # timed out or died: a fresh worker for the next type
                worker.kill()
                row = {"type": t, "builds": worker.builds, "outcome": "timeout",
                       "message": f"over {LIMIT_S} s or the worker died"}
                worker = Worker(src)
            with lock:
                rows.append(row)
                if args.json:  # row by row, so a run stopped part-way still leaves what it measured
                    with open(args.json + "l", "a") as f:
                        f.write(json.dumps(row) + "\n")
                done = len(rows)
                print(f"[{done}/{len(types)} {time.perf_counter() - t0:5.0f}s] {t}: {row['outcome']}"
                      + (f" {row.get('cpu_s', 0):.1f}s" if row["outcome"] == "ok" else
                         f" — {row.get('message', '')[:150]}"), file=sys.stderr, flush=True)
        worker.kill()

    threads = [threading.Thread(target=drive) for _ in range(args.workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows.sort(key=lambda r: r["type"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    report(rows, verbose=bool(args.types))


def report(rows: list[dict], verbose: bool = False) -> None:
    built = [r for r in rows if r.get("builds")]
    ok = [r for r in built if r["outcome"] == "ok"]
    fast = [r for r in ok if r["cpu_s"] <= 10]
    print(f"\nmodel types: {len(rows)}; transformers builds a model from the default config for {len(built)}")
    if built:
        print(f"contract: {len(ok)}/{len(built)} ({100 * len(ok) / len(built):.1f} %) of those; "
              f"{len(fast)} within 10 s of CPU")
        for mib in (512, 1024):
            within = sum(r["rise_mib"] <= mib for r in fast)
            print(f"  within 10 s of CPU and {mib} MiB: {within} ({100 * within / len(built):.1f} %)")
    if ok:
        cpu = sorted(r["cpu_s"] for r in ok)
        rise = sorted(r["rise_mib"] for r in ok)
        print(f"CPU s: median {cpu[len(cpu) // 2]:.1f}, max {cpu[-1]:.1f}; peak memory rise MiB: median "
              f"{rise[len(rise) // 2]:.0f}, max {rise[-1]:.0f}")
    classes = Counter(classify(r.get("message", "")) if r["outcome"] == "refused" else r["outcome"]
                      for r in built if r["outcome"] != "ok")
    if classes:
        print("not ok, of the types transformers builds:")
        for name, n in classes.most_common():
            print(f"  {n:4d}  {name}")
    others = Counter(r["outcome"] for r in rows if not r.get("builds"))
    print(f"types transformers does not build from the default config: {sum(others.values())} "
          f"({', '.join(f'{k} {v}' for k, v in others.items())})")
    slow = [r for r in ok if r["cpu_s"] > 10]
    if slow:
        print("over 10 s of CPU: " + ", ".join(f"{r['type']} {r['cpu_s']:.0f}s" for r in slow))
    for r in rows:
        if verbose or (r.get("builds") and r["outcome"] != "ok"):
            msg = re.sub(r"\s+", " ", r.get("message", "")) or f"{r.get('sites')} sites, {r.get('cpu_s', 0):.1f}s"
            print(f"  {r['type']:32s} {r['outcome']:8s} {msg[:240]}")


if __name__ == "__main__":
    main()
