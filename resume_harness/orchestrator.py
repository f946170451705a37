# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""The orchestrator: torchrun jobs that save and load every case, side by side on GPUs of their
own where there are enough, restarted after a case that killed them, merged into one result per
case."""

import concurrent.futures
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .cases import Shape, te_unavailable
from .results import MANIFEST, current_file, merge_rank_files, rank_file, write_json

SAVE_DONE = "SAVE_DONE"
"""Left in a saving implementation's folder when its save job exited cleanly."""

# The folder that holds this package, put on the jobs' PYTHONPATH so that they find it.
PACKAGE_PARENT = Path(__file__).resolve().parents[1]
# Each rank runs this package as ``python -m resume_harness``.
WORKER_MODULE = __package__


def _launch(role, implementation, nproc, extra, log_path, timeout, devices=None):
    """One torchrun job of this package (``python -m resume_harness``); returns its exit code
    (its output goes to ``log_path``).

    ``devices``: the GPUs the job may see (CUDA_VISIBLE_DEVICES), or None for all.
    """
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
    if implementation == "upstream":
        env["MEGATRON_OPTIMIZER_FORK"] = "0"
    else:
        env.pop("MEGATRON_OPTIMIZER_FORK", None)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--module",
        WORKER_MODULE,
        f"--{role}-with",
        implementation,
        *extra,
    ]
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            done = subprocess.run(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return "timeout"
    return done.returncode


def _log_tail(path, lines=3):
    """The last error lines of a job's log (its last lines if none), on one line.

    C++ stack frames and the launcher's own report are left out: they name no cause.
    """
    try:
        text = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return f"(no log at {path})"
    errors = [
        line
        for line in text
        if ("Error" in line or "Exception" in line)
        and not line.lstrip().startswith("frame #")
        and "ChildFailedError" not in line
    ]
    picked = [line.strip() for line in (errors or text)[-lines:]]
    return " / ".join(picked) + f" (log: {path})"


def _load_until_done(job, nproc, timeout, code):
    """Start a load job again after it died, from the case after the one it died in.

    That case gets an error naming the exit code and the log's last error lines in each rank's
    part that has no result for it yet, so the next start skips it. Stops when the job exits
    cleanly, or when a start names no case or the same case as before (nothing left to skip).

    Args:
        job: ``(role, implementation, extra, log)`` as for :func:`_launch`; ``extra`` holds
            ``--out``.
        nproc: ranks of the job.
        timeout: seconds per start.
        code: exit code of the first start.

    Returns:
        The exit code of the last start.
    """
    role, implementation, extra, log = job
    out = extra[extra.index("--out") + 1]
    extra = [*extra, "--continue-load"]
    crashed = set()
    attempt = 0
    while code not in (0, "timeout"):  # a hung case would hang again: no restart
        markers = [current_file(out, index) for index in range(nproc)]
        names = {json.loads(m.read_text(encoding="utf-8"))["case"] for m in markers if m.exists()}
        if len(names) != 1 or names & crashed:
            return code
        key = names.pop()
        crashed.add(key)
        error = f"the load job died in this case (exit {code}): {_log_tail(log)}"
        for index in range(nproc):
            part = rank_file(out, index)
            results = json.loads(part.read_text(encoding="utf-8")) if part.exists() else {}
            # A case whose result was written died in the clean-up after it: keep the result.
            # An unfinished one keeps what it measured before the load and gets the error.
            if results.get(key, {"unfinished": True}).get("unfinished"):
                results[key] = dict(results.get(key, {}), error=error)
            write_json(part, results)
        attempt += 1
        log = Path(f"{job[3]}.restart{attempt}")
        print(f"load job of {implementation} died in {key}; restarting after it", flush=True)
        code = _launch(role, implementation, nproc, extra, log, timeout)
    return code


def _visible_devices():
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [str(index) for index in range(torch.cuda.device_count())]


def _run_side_by_side(jobs, nproc, timeout, side_by_side):
    """Run ``jobs`` (``(role, implementation, extra, log)``), each on ``nproc`` GPUs of its own
    at the same time where there are enough GPUs and ``side_by_side``, else one after the
    other; their exit codes, in order."""
    devices = _visible_devices()
    if not side_by_side or len(jobs) < 2 or len(jobs) * nproc > len(devices):
        return [_launch(*job[:2], nproc, *job[2:], timeout) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(
                _launch, *job[:2], nproc, *job[2:], timeout, devices[i * nproc : (i + 1) * nproc]
            )
            for i, job in enumerate(jobs)
        ]
        return [future.result() for future in futures]


def drive(
    cases,
    pairs,
    nproc,
    steps_before=3,
    steps_after=2,
    workdir=None,
    timeout=1200,
    side_by_side=True,
    **settings,
):
    """Run every (save_with, load_with) pair over ``cases`` with the fewest torchrun jobs.

    One save job per saving implementation and one load job per loading implementation (it
    reads every checkpoint folder it needs): the save jobs first, then the load jobs, the jobs
    of each phase side by side on GPUs of their own where there are enough and
    ``side_by_side`` (pass False when timings are compared across implementations).

    Settings: ``shape`` (:class:`Shape` of the probe, default the small one),
    ``collective_timeout`` (seconds a rank waits in a collective; a rank left behind by
    another's error costs that long), ``log_dir`` (where the jobs' logs are copied at the end;
    the checkpoints stay in ``workdir``), ``reuse_saves`` (a saving implementation whose save
    job in ``workdir`` ended cleanly before, leaving ``SAVE_DONE`` in its folder, is not run
    again: its checkpoints are read again, so a repeated load costs a load job only).

    Returns:
        dict: ``Case.key(nproc, save_with, load_with)`` -> merged result; a job that failed
        leaves an ``error`` with the tail of its log in each of its cases. A case this machine
        cannot run (see :func:`te_unavailable`) is not started: its results only carry
        ``skipped`` (the reason) and ``exact`` False.
    """
    results = {}
    skipped = {case: te_unavailable(case) for case in cases}
    for case, reason in skipped.items():
        for save, load in pairs if reason else ():
            key = case.key(nproc, save, load)
            results[key] = {"case": key, "skipped": reason, "error": None, "exact": False}
    cases = [case for case in cases if not skipped[case]]
    if not cases:
        return results
    owned = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="distopt_resume_") if owned else workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    names = [case.name for case in cases]
    shape = settings.get("shape") or Shape()
    common = ["--collective-timeout", str(settings.get("collective_timeout") or 300)]
    save_failures = {}
    try:
        savers = sorted({save for save, _ in pairs})
        if settings.get("reuse_saves"):
            savers = [s for s in savers if not (workdir / f"saved_by_{s}" / SAVE_DONE).exists()]
        save_jobs = []
        for save in savers:
            (workdir / f"saved_by_{save}" / SAVE_DONE).unlink(missing_ok=True)
            extra = ["--ckpt-dir", str(workdir / f"saved_by_{save}"), "--cases", *names]
            extra += ["--steps-before", str(steps_before), "--steps-after", str(steps_after)]
            extra += ["--hidden", str(shape.hidden), "--ffn", str(shape.ffn), *common]
            save_jobs.append(("save", save, extra, workdir / f"save_{save}.log"))
        for job, code in zip(save_jobs, _run_side_by_side(save_jobs, nproc, timeout, side_by_side)):
            if code != 0:
                save_failures[job[1]] = f"save job exited {code}: {_log_tail(job[3])}"
            else:
                (workdir / f"saved_by_{job[1]}" / SAVE_DONE).touch()

        loaders = sorted({load for _, load in pairs})
        sources = {load: [saver for saver, loader in pairs if loader == load] for load in loaders}
        load_jobs = []
        for load in loaders:
            readable = [
                saver
                for saver in sources[load]
                if (workdir / f"saved_by_{saver}" / MANIFEST).exists()
            ]
            if readable:
                out = workdir / f"loaded_by_{load}.json"
                for stale in [out, *workdir.glob(f"{out.name}.*")]:
                    stale.unlink(missing_ok=True)
                extra = ["--ckpt-dir", *(str(workdir / f"saved_by_{saver}") for saver in readable)]
                extra += ["--out", str(out), *common]
                load_jobs.append(("load", load, extra, workdir / f"load_{load}.log"))
        first_codes = _run_side_by_side(load_jobs, nproc, timeout, side_by_side)
        codes = {
            job[1]: _load_until_done(job, nproc, timeout, code) if code != 0 else 0
            for job, code in zip(load_jobs, first_codes)
        }
        for load in loaders:
            merged, code, log = {}, codes.get(load), workdir / f"load_{load}.log"
            if load in codes:
                out = workdir / f"loaded_by_{load}.json"
                merged = (
                    json.loads(out.read_text(encoding="utf-8"))
                    if out.exists()
                    else merge_rank_files(out, nproc)
                )
            for case, save in itertools.product(cases, sources[load]):
                key = case.key(nproc, save, load)
                result = merged.get(key) or {"case": key, "error": "no result"}
                problems = [save_failures.get(save), result.get("error")]
                if code not in (None, 0):
                    problems.append(f"load job exited {code}: {_log_tail(log)}")
                result["error"] = " | ".join(p for p in problems if p) or None
                result["exact"] = bool(result.get("exact")) and not result["error"]
                results[key] = result
    finally:
        if settings.get("log_dir"):
            logs = Path(settings["log_dir"])
            logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log*"):
                shutil.copyfile(log, logs / log.name)
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    return results
