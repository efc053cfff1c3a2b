"""``chimera``: the command line (typer).

``chimera prepare [--profile cpu]`` builds the profile's model directory once (idempotent);
``chimera serve [--profile cpu]`` starts Ray Serve with the whole application;
``chimera graft ...`` trains, evaluates and prepares grafts (see ``grafting/train/cli.py``);
``chimera quantize ...`` quantizes a language model with measured fidelity (``services/quantize_cli.py``);
``chimera speculator ...`` trains EAGLE-3 draft heads with measured acceptance (``services/speculator_cli.py``).
"""

from __future__ import annotations

import importlib
import logging
import math
import signal
import threading
import time

import typer

from grafting.train.cli import graft_app

from .config.profiles import ProfileError, load_profile
from .quantize_cli import quantize_app
from .speculator_cli import speculator_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Chimera: multimodal inference service.")
BUILDERS = {"vlm": "grafting.build", "video": "video.build", "tts": "audio.build"}

# The grafting commands (synth, pretrain-tower, train, eval) live with the model code.
app.add_typer(graft_app, name="graft", help="Train, evaluate and prepare vision-LLM grafts.")
app.add_typer(quantize_app, name="quantize")
app.add_typer(speculator_app, name="speculator")


def _load(profile: str):
    try:
        return load_profile(profile)
    except ProfileError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@app.command()
def prepare(profile: str = typer.Option("cpu", help="profile name (configs/<name>.yaml) or path"),
            dry_run: bool = typer.Option(False, "--dry-run", help="print each file to fetch and its bytes; "
                                                                  "fetch and build nothing"),
            mirror: str = typer.Option(None, help="take the hub repos from this local copy (<dir>/<org>/<name>) "
                                                  "instead of the Hugging Face Hub")):
    """Build the profile's small cpu models into its model directory, and fetch the checkpoints it names by hub
    id into ``<model_dir>/<org>/<name>`` (only the files the engines read; for the tower only the shards holding
    ``vision_tower.*``). Does nothing the second time. Exit 2: profile error, ``HF_HUB_OFFLINE`` with checkpoints
    to fetch, or a repo that cannot be listed; exit 1: a local checkpoint directory is missing."""
    from .config.weights import DirSource, FetchError, HubSource, fetch, plan

    prof = _load(profile)
    model_dir = prof.resolved_model_dir()
    source = DirSource(mirror) if mirror else HubSource()
    try:
        items = plan(prof, source, model_dir)
    except (FetchError, KeyError, OSError) as err:
        typer.echo(f"cannot fetch: {err}", err=True)
        raise typer.Exit(2) from None
    missing = [i for i in items if i.state == "missing"]
    total = 0
    for i in items:
        c = i.checkpoint
        line = f"{c.where:14s} {c.ref} -> {i.dest}"
        if i.state == "fetch":
            n = sum(i.files.values())
            total += n
            typer.echo(f"{line}  {'would fetch' if dry_run else 'fetching'} {len(i.files)} files, {n} bytes "
                       f"(from the {source.name})")
            if dry_run:
                for f, size in i.files.items():
                    typer.echo(f"  {size:>14d}  {f}")
        else:
            typer.echo(f"{line}  {dict(local='local directory', present='up to date', missing='MISSING')[i.state]}")
    if dry_run:
        typer.echo(f"total to fetch: {total} bytes")
    else:
        model_dir.mkdir(parents=True, exist_ok=True)
        try:
            fetch(items, source)
        except (FetchError, OSError) as err:
            typer.echo(f"cannot fetch: {err}", err=True)
            raise typer.Exit(2) from None
        for fam, section in prof.families().items():
            if getattr(section.engine, "build", None) is None:
                continue
            t0 = time.perf_counter()
            wrote = importlib.import_module(BUILDERS[fam]).prepare(section.engine, model_dir)
            state = f"built in {time.perf_counter() - t0:.1f} s" if wrote else "up to date"
            typer.echo(f"{fam:6s} {section.model_id:16s} {state}  ({model_dir})")
    if missing:
        typer.echo("missing local checkpoint directories (not on the hub; e.g. a projector trained with "
                   "`chimera graft train`): " + ", ".join(f"{i.checkpoint.where}={i.dest}" for i in missing), err=True)
        raise typer.Exit(1)


profile_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect profiles.")
app.add_typer(profile_app, name="profile")


@profile_app.command("show")
def profile_show(profile: str = typer.Option("cpu", help="profile name (configs/<name>.yaml) or path"),
                 gpu_memory: str = typer.Option(None, help="memory of each GPU with its unit: 80GB (decimal, as "
                                                           "sold) or 74.5GiB (default: the profile's "
                                                           "ray.gpu_memory_gib, else the local CUDA devices, else "
                                                           "80GB)"),
                 gpu_memory_gib: float = typer.Option(None, help="memory of each GPU in GiB (2**30 bytes); "
                                                                 "--gpu-memory 74.5GiB says the same"),
                 gpus: int = typer.Option(None, help="number of GPUs (default: the profile's ray.num_gpus)")):
    """Print the memory plan: per deployment (and video job) the GPUs it lands on, weights, KV cache and
    activations at the profile's limits; per GPU the total (GiB, and GB in brackets). Without a GPU size from
    the options, the profile or a local CUDA device it plans for 80 GB GPUs and says so. Exit 1 when it does not
    fit, 2 on a profile error or a GPU size it cannot read."""
    from .config.memory_plan import (DEFAULT_GPU_BYTES, GIB, PlanError, both_units, format_plan, gpu_bytes_of,
                              parse_gpu_memory, plan, uses_gpus)

    prof = _load(profile)
    if not uses_gpus(prof):
        typer.echo(f"profile {prof.name}: no deployment asks for a GPU (nothing to plan)")
        return
    if gpu_memory is not None and gpu_memory_gib is not None:
        typer.echo("give the GPU size once: --gpu-memory or --gpu-memory-gib", err=True)
        raise typer.Exit(2)
    if gpu_memory is not None:
        try:
            size = parse_gpu_memory(gpu_memory)
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
    elif gpu_memory_gib is not None:
        size = int(gpu_memory_gib * GIB)
    else:
        size, source = gpu_bytes_of(prof)
        if size is None:
            size = DEFAULT_GPU_BYTES
            typer.echo(f"GPU size: {source}; planning for {both_units(size)} GPUs (pass --gpu-memory, e.g. "
                       "141GB, for another size)")
        else:
            typer.echo(f"GPU size: {both_units(size)}, from {source}")
    try:
        p = plan(prof, size, gpus)
    except PlanError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    typer.echo(format_plan(p, prof.name))
    if not p.fits:
        raise typer.Exit(1)


class _Stop(BaseException):
    """Raised in the main thread by the first SIGTERM or SIGINT of ``chimera serve``: unwinds to its shutdown."""


def _raise_stop(signum: int, _frame) -> None:
    """Signal handler: ignore further SIGTERM/SIGINT (a second Ctrl-C must not cut the shutdown short), then
    raise :class:`_Stop` in the main thread."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    raise _Stop(signum)


@app.command()
def serve(profile: str = typer.Option("cpu", help="profile name (configs/<name>.yaml) or path"),
          host: str = typer.Option(None, help="bind address (default: the profile's)"),
          port: int = typer.Option(None, help="port (default: the profile's)"),
          address: str = typer.Option(None, help="join a running Ray cluster (ray://<head>:10001, or auto for the "
                                                 "cluster of this node) instead of starting one; a cluster "
                                                 "with token auth needs RAY_AUTH_MODE=token")):
    """Start the service (Ray Serve) and keep it running until Ctrl-C / SIGTERM; either stops it in a few
    seconds (in-flight requests finish first, see ``services.serve_app.stop``) and exits with code 0. SIGHUP
    (``kill -HUP <pid>``) reloads the profile file without a restart (:func:`_reload`: e.g. a new speculative
    head for the VLM, swapped in replica by replica without dropping requests).

    "Chimera is serving ..." is printed once ``GET /readyz`` answers 200 (every model loaded); until then a line
    names the models still loading whenever that list changes.

    First the memory plan is checked (``services.config.memory_plan.check``): a profile that does not fit its GPUs is
    refused with the numbers (exit 2). With ``--address`` the application is deployed on that cluster and, on
    stop, only it is deleted (the cluster and its other applications keep running)."""
    from .api.readiness import wait_ready
    from .serve_app import APP_NAME, init_ray, run, stop

    t0 = time.monotonic()
    logging.basicConfig(level=logging.INFO)
    prof = _with_address(_load(profile), address)
    problem = _refusal(prof)
    if problem:
        typer.echo(problem, err=True)
        raise typer.Exit(2)
    # Ray's processes (GCS, raylet and, through the raylet, every worker and replica) inherit the signal mask of
    # the thread that starts them, and Ray itself blocks SIGINT in them (which is why Ctrl-C to the whole group
    # leaves them to this process's shutdown). A SIGTERM to the whole group (`timeout`, container runtimes, systemd's
    # KillMode=control-group) reached them too: the Serve controller stopped answering and serve.shutdown() waited
    # out its fixed 30 s ("Controller failed to shut down within 30.0s"; Serve has no setting for that wait). So
    # SIGTERM is blocked as well while Ray starts: a group SIGTERM then reaches only this process, which stops
    # Serve and Ray exactly as for `kill <pid>`. Nothing is orphaned by this: ray.shutdown() SIGKILLs the head
    # processes, and Ray ties them to this process's death (PR_SET_PDEATHSIG) should it be SIGKILLed itself.
    # Only SIGTERM is blocked here: the mask is restored below, once this process's own handlers are installed,
    # and a SIGTERM that arrived meanwhile is delivered then (to _raise_stop).
    prev_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        init_ray(prof)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, prev_mask)
        raise
    try:
        # After init_ray (ray.init installs its own SIGTERM handler, which exits at once with code 15) and before
        # the deployment starts, so that a signal at any moment from here on stops everything Ray started.
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, _raise_stop)
        hup = threading.Event()  # set by SIGHUP; a reload runs here, in the main thread, where _Stop can end it
        signal.signal(signal.SIGHUP, lambda _signum, _frame: hup.set())
        signal.pthread_sigmask(signal.SIG_SETMASK, prev_mask)
        url = run(prof, host, port)
        typer.echo(f"Chimera is starting at {url}: waiting for GET /readyz (Ctrl-C to stop)")
        wait_ready(_local_url(url), math.inf, poll_s=1.0, progress=_report_loading)
        typer.echo(f"Chimera is serving {', '.join(prof.model_ids())} at {url}  (ready {time.monotonic() - t0:.0f} s "
                   "after start; Ctrl-C to stop, kill -HUP to reload the profile)")
        while True:
            hup.wait()  # a signal handler's _Stop interrupts the wait
            hup.clear()  # a SIGHUP during the reload below sets it again: one more reload follows
            prof = _reload(profile, address, prof, url)
    except _Stop:
        typer.echo("shutting down")
    finally:
        if address:
            _leave_cluster(APP_NAME)
        else:
            stop()


def _with_address(prof, address: str | None):
    """``prof`` joining the Ray cluster at ``address`` (``chimera serve --address``), or ``prof`` without one."""
    if not address:
        return prof
    return prof.model_copy(update={"ray": prof.ray.model_copy(update={"address": address})})


def _refusal(prof) -> str | None:
    """Why ``prof`` must not be served (checked before Ray starts, and before a reload), or None: the memory plan
    (``services.config.memory_plan.check``: a profile that does not fit its GPUs, with the numbers), a quantized
    checkpoint that must not be served (no or foreign ``fidelity.json``, a scheme this host cannot run) or an
    EAGLE-3 head that must not be (no or foreign ``speculator.json``). Warns when the plan cannot be checked."""
    from core.quant.fidelity import QuantizedCheckpointError
    from core.spec.record import SpeculatorError

    from .config.memory_plan import PlanError, check, uses_gpus
    from .engines.vllm_server import served_checkpoint, served_speculation

    try:
        if check(prof) is None and uses_gpus(prof):
            logging.getLogger("chimera").warning("memory plan not checked: GPU memory unknown (set "
                                                 "ray.gpu_memory_gib in the profile, or run where CUDA is visible)")
    except PlanError as err:
        return str(err)
    for fam in ("vlm", "tts"):
        section = getattr(prof, fam)
        if section is None:  # a profile check refuses vllm.quantized without the vllm backend
            continue
        try:
            served_checkpoint(section.engine, prof.resolved_model_dir())
        except QuantizedCheckpointError as err:
            return f"{fam}.engine.vllm.quantized: {err}"
        try:
            served_speculation(section.engine, prof.resolved_model_dir())
        except SpeculatorError as err:
            return f"{fam}.engine.vllm.speculative: {err}"
    return None


#: Profile keys a reload cannot change: they configure Ray itself or Serve's HTTP proxies, which keep running.
RESTART_ONLY = ("ray.", "server.host", "server.port", "server.limits.", "server.request_timeout_s")


def _flat(data, prefix: str = "") -> dict:
    """A profile dump as ``{dotted key: leaf value}`` (lists and None are leaves)."""
    if isinstance(data, dict) and data:
        return {k: v for key, sub in data.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def profile_changes(old, new) -> list[str]:
    """The keys that differ between profiles ``old`` and ``new``, as ``key: old -> new`` lines in key order."""
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def _reload(profile: str, address: str | None, current, url: str):
    """SIGHUP: read the profile file again and, when it changed and passes the start's checks (:func:`_refusal`,
    and no :data:`RESTART_ONLY` key changed), deploy it over the running application
    (``services.serve_app.redeploy``): only the deployments whose section changed get new replicas, and with
    ``max_surge_percent`` (the default without GPUs) their old replicas serve until the new ones are ready. Prints
    what changed and, once ``GET /readyz`` answers 200 again, that the reload is done. Returns the profile now
    served: ``current`` when the file is unchanged, refused (the reason is printed on stderr; nothing is touched)
    or failed to deploy (Serve's message is printed and ``current`` deployed again: with surge its replicas never
    stopped)."""
    from .api.readiness import wait_ready
    from .serve_app import redeploy

    t0 = time.monotonic()
    typer.echo(f"SIGHUP: reloading the profile {profile}")
    try:
        new = _with_address(load_profile(profile), address)
    except ProfileError as err:
        typer.echo(f"reload refused, still serving the old profile: {err}", err=True)
        return current
    changes = profile_changes(current, new)
    if not changes:
        typer.echo("reload: the profile is unchanged; nothing to do")
        return current
    fixed = [c for c in changes if c.startswith(RESTART_ONLY)]
    problem = (f"these keys take a restart of chimera serve: {'; '.join(fixed)}" if fixed else None) \
        or _refusal(new)
    if problem:
        typer.echo(f"reload refused, still serving the old profile: {problem}", err=True)
        return current
    typer.echo("reload: " + "\n  ".join(["changed:"] + changes))
    try:
        redeploy(new)
    except RuntimeError as err:  # Serve's DEPLOY_FAILED: a new replica's constructor failed
        typer.echo(f"reload failed, going back to the old profile: {err}", err=True)
        redeploy(current)  # the old versions: their replicas, kept serving by the surge, are Serve's target again
        return current
    wait_ready(_local_url(url), math.inf, poll_s=1.0, progress=_report_loading)
    typer.echo(f"reload done: the new replicas are ready ({time.monotonic() - t0:.0f} s after SIGHUP)")
    return new


def _local_url(url: str) -> str:
    """``url`` with a wildcard bind address (``0.0.0.0``, ``::``) replaced by the loopback one, to reach it here."""
    return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://:::", "://127.0.0.1:")


def _report_loading(loading: list[str]) -> None:
    """Progress line of ``chimera serve``'s start-up: the models ``/readyz`` still reports loading."""
    typer.echo(f"  still loading: {', '.join(loading)}" if loading else "  waiting for the HTTP proxy to answer")


def _leave_cluster(app_name: str) -> None:
    """Delete this application from the joined cluster (its replicas drain first) and disconnect; Serve and the
    cluster keep running."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.delete(app_name)
        ray.shutdown()


if __name__ == "__main__":
    app()
