"""Memory plan: whether a profile's deployments fit their GPUs, computed before anything loads.

The model math is in each family (``grafting.memory``, ``video.memory``, ``audio.memory``, on ``core.memory``:
weights from parameter counts of the real architecture configs on the meta device, KV cache and activations at the
profile's limits).
This module reads those configs, places the deployments on GPUs and adds up what lands on each:

- architecture configs come from the checkpoint directory when it is local (fetched by ``chimera prepare`` into
  ``<model_dir>/<org>/<name>``), else from ``configs/published/<org>/<name>`` (the published ``config.json`` files);
- placement: replicas in profile order (vlm, video front, tts), first fit, as Ray hands out whole GPUs for ``num_gpus >= 1``
  and packs fractions; the video job workers (``jobs.workers`` of ``jobs.gpus_per_job`` GPUs each) then take theirs;
  a deployment's surge replicas (``deployment.max_surge_percent`` set on a GPU deployment: the replicas a reload
  starts beside the old ones, ``DeploymentOptions.surge_replicas``) are placed after its replicas, as ``vlm[surge 0]``;
- each process on a GPU gets :data:`CUDA_CONTEXT_BYTES` (CUDA context and allocator slack: an allowance);
- with vLLM, the LLM's GPUs each give vLLM ``gpu_memory_utilization`` of their memory (vLLM's default 0.9 when
  unset): weights / tp + activations + the KV cache of one full-length sequence must fit in that share (vLLM
  refuses to start otherwise); what is left of it is KV cache, reported as full-length sequences. The speech LM on
  vLLM: its weights, activations and the KV cache of ``max_ongoing_requests`` full sentences must fit in its share;
  SNAC stays in the replica, beside the share.

:func:`check` raises :class:`PlanError` with the numbers when a GPU is over its memory; ``chimera serve`` calls it
before starting Ray, ``chimera profile show`` prints :func:`format_plan`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from core.memory import DTYPE_BYTES, Need, read_config

from .profiles import CONFIG_DIR, Profile

GIB = 1 << 30
GB = 10**9  # GPUs are sold in decimal gigabytes: an "80 GB" GPU has 80e9 bytes = 74.5 GiB
#: The GPU size ``chimera profile show`` plans for when none is given, the profile has no ``ray.gpu_memory_gib``
#: and no CUDA device is visible: an 80 GB GPU (A100/H100 80GB).
DEFAULT_GPU_BYTES = 80 * GB
CUDA_CONTEXT_BYTES = GIB
PUBLISHED = CONFIG_DIR / "published"
VLLM_DEFAULT_UTILIZATION = 0.9


class PlanError(ValueError):
    """The profile does not fit its GPUs (the message has the per-GPU numbers), or an architecture config is
    missing."""


def config_dir(model_dir: Path, ref: str, marker: str = "config.json") -> Path:
    """Directory holding the architecture config(s) of checkpoint ``ref``: the local checkpoint when it has
    ``marker``, else ``configs/published/<ref>``. Raises PlanError when neither has it."""
    p = Path(ref).expanduser()
    for d in ([p] if p.is_absolute() else [model_dir / p, PUBLISHED / p]):
        if (d / marker).exists():
            return d
    raise PlanError(f"no architecture config for {ref}: neither {model_dir / ref} nor {PUBLISHED / ref} has "
                    f"{marker} (run `chimera prepare`, or add the published config there)")


@dataclass
class Placement:
    """One process's share of the GPUs: ``owner`` (e.g. ``vlm[0]``), ``gpus`` (indices), ``per_gpu`` (needs on
    every one of them), ``first`` (needs only on the first), ``notes`` (what the numbers mean)."""

    owner: str
    gpus: list[int]
    per_gpu: list[Need] = field(default_factory=list)
    first: list[Need] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class MemoryPlan:
    """The plan: ``gpu_bytes`` per GPU, ``placements``, ``used[i]`` bytes on GPU i, ``problems`` (empty: fits)."""

    gpu_bytes: int
    n_gpus: int
    placements: list[Placement]
    used: list[int]
    problems: list[str]

    @property
    def fits(self) -> bool:
        """True when no GPU is over its memory and every deployment got its GPUs."""
        return not self.problems


class _GPUs:
    def __init__(self, n: int):
        self.free = [1.0] * n

    def take(self, g: float) -> list[int] | None:
        if g >= 1:
            whole = [i for i, f in enumerate(self.free) if f == 1.0][:math.ceil(g)]
            if len(whole) < math.ceil(g):
                return None
            for i in whole:
                self.free[i] = 0.0
            return whole
        for i, f in enumerate(self.free):
            if f >= g - 1e-9:
                self.free[i] = f - g
                return [i]
        return None


def _ctx() -> Need:
    return Need("cuda context", CUDA_CONTEXT_BYTES, "allowance per process and GPU")


def _vllm_share(options, gpu_bytes: int) -> Need:
    """What vLLM takes of each of its GPUs: ``gpu_memory_utilization`` (vLLM's default when unset) x the GPU's
    bytes."""
    util = options.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    return Need("vLLM share", int(util * gpu_bytes), f"gpu_memory_utilization {util:g} x {gpu_bytes / GIB:.1f} GiB")


def _quantized(needs: list[Need], what: str, engine, lm_config: dict, dtype_bytes: int, model_dir: Path,
               divide: int, notes: list[str]) -> list[Need]:
    """``needs`` with the LM weights (``what``) as the ``vllm.quantized`` checkpoint holds them: the units its
    ``fidelity.json`` lists at the scheme's weight bits (:func:`core.quant.units.quantized_weight_saving`), over
    ``divide`` GPUs. Unchanged, with a note, while that checkpoint is not made yet."""
    if engine.vllm.quantized is None:  # set only with the vllm backend (a profile check)
        return needs
    from core.config import resolve_path
    from core.quant.fidelity import QuantizedCheckpointError, read_fidelity
    from core.quant.schemes import scheme
    from core.quant.units import quantized_weight_saving

    path = resolve_path(model_dir, engine.vllm.quantized)
    try:
        rec = read_fidelity(path)
    except QuantizedCheckpointError:
        notes.append(f"quantized checkpoint {path} not made yet (`chimera quantize`): weights counted at full "
                     f"precision")
        return needs
    sch = scheme(rec["scheme"])
    saving = quantized_weight_saving(lm_config, rec["quantized_units"], dtype_bytes, sch.weight_bits) // divide
    units = f"{len(rec['quantized_units'])}/{rec['units_total']} units {sch.name} ({sch.weight_bits}-bit weights)"
    return [Need(n.what, n.bytes - saving, f"{n.how}, {units}") if n.what == what else n for n in needs]


def _vlm(profile: Profile, model_dir: Path, gpus: list[int], gpu_bytes: int, owner: str) -> Placement:
    from grafting.memory import vlm_needs

    e = profile.vlm.engine
    tower = read_config(config_dir(model_dir, e.tower))
    llm = read_config(config_dir(model_dir, e.llm))
    proj_dir = Path(e.projector) if Path(e.projector).is_absolute() else model_dir / e.projector
    proj = read_config(proj_dir) if (proj_dir / "config.json").exists() else None
    n = vlm_needs(e, tower.get("vision_config", tower), llm, proj, len(gpus))
    pl = Placement(owner, gpus, first=n.replica + [_ctx()])
    n = replace(n, llm=_quantized(n.llm, "llm weights", e, llm, DTYPE_BYTES[e.vllm.dtype or e.dtype], model_dir,
                                  len(gpus), pl.notes))
    kv = Need("kv cache, one full sequence", n.kv_per_sequence, f"{n.context} tokens (prompt + new) per GPU")
    if proj is None:
        pl.notes.append(f"projector sizes assumed (no {proj_dir / 'config.json'}): {e.projector}")
    if e.backend == "vllm":
        pl.per_gpu = [_vllm_share(e.vllm, gpu_bytes)]
        share = pl.per_gpu[0].bytes
        inside = n.llm + [kv, _ctx()]
        need = sum(x.bytes for x in inside)
        pool = share - need + kv.bytes
        seqs = pool // kv.bytes if kv.bytes else 0
        pl.notes.append("inside vLLM's share, per GPU: " + ", ".join(f"{x.what} {x.bytes / GIB:.2f} GiB" for x in inside)
                        + f"; its KV cache holds {seqs} full-length sequences ({n.sequences} decoded together)")
        if need > share:
            pl.notes.append(f"PROBLEM: vLLM needs {need / GIB:.2f} GiB per GPU (weights, activations, one "
                            f"{n.context}-token sequence) but gets {share / GIB:.2f} GiB")
    else:
        pl.per_gpu = n.llm + [Need(f"kv cache, {n.sequences} sequences", n.kv_per_sequence * n.sequences,
                                   f"{n.context} tokens each")]
    return pl


def _tts(profile: Profile, model_dir: Path, gpus: list[int], gpu_bytes: int, owner: str) -> Placement:
    from audio.memory import tts_needs

    s = profile.tts
    e = s.engine
    lm = read_config(config_dir(model_dir, e.lm))
    needs = tts_needs(e, lm, read_config(config_dir(model_dir, e.snac)), s.deployment.max_ongoing_requests)
    notes: list[str] = []
    needs = _quantized(needs, "lm weights", e, lm, DTYPE_BYTES[e.dtype], model_dir, 1, notes)
    if e.backend != "vllm":
        return Placement(owner, gpus, first=needs + [_ctx()])
    # vLLM's server holds the LM (weights, KV cache, activations) inside its share; the replica keeps SNAC
    in_vllm = [n for n in needs if n.what.startswith(("lm ", "kv "))]
    pl = Placement(owner, gpus, first=[n for n in needs if n not in in_vllm] + [_ctx()], notes=notes)
    pl.per_gpu = [_vllm_share(e.vllm, gpu_bytes)]
    share = pl.per_gpu[0].bytes
    inside = in_vllm + [_ctx()]
    need = sum(x.bytes for x in inside)
    pl.notes.append("inside vLLM's share: " + ", ".join(f"{x.what} {x.bytes / GIB:.2f} GiB" for x in inside))
    if need > share:
        pl.notes.append(f"PROBLEM: vLLM needs {need / GIB:.2f} GiB (LM weights, activations, the KV cache of "
                        f"{s.deployment.max_ongoing_requests} requests) but gets {share / GIB:.2f} GiB")
    return pl


def _video_job(profile: Profile, model_dir: Path, gpus: list[int], owner: str) -> Placement:
    from video.memory import video_needs

    e = profile.video.engine
    d = config_dir(model_dir, e.model, "transformer/config.json")
    needs = video_needs(e, read_config(d, "transformer"), read_config(d, "vae"), read_config(d, "text_encoder"))
    return Placement(owner, gpus, first=needs + [_ctx()])


def _on_gpu(section) -> bool:
    return section.deployment.num_gpus > 0


def plan(profile: Profile, gpu_bytes: int, n_gpus: int | None = None) -> MemoryPlan:
    """Place ``profile``'s deployments on ``n_gpus`` GPUs of ``gpu_bytes`` each (default: ``ray.num_gpus``, else
    as many as the deployments ask for plus one for video jobs) and add up each GPU. Raises PlanError when an
    architecture config is missing."""
    model_dir = profile.resolved_model_dir()
    asks = [(fam, s) for fam, s in profile.families().items() if _on_gpu(s)]
    jobs = profile.video.engine.jobs.gpus_per_job if profile.video is not None else 0
    if n_gpus is None:
        n_gpus = int(profile.ray.num_gpus) if profile.ray.num_gpus is not None else \
            math.ceil(sum(s.deployment.num_gpus * (s.deployment.num_replicas + s.deployment.surge_replicas())
                          for _, s in asks)) + \
            math.ceil(jobs) * (profile.video.engine.jobs.workers if jobs else 0)
    pool = _GPUs(n_gpus)
    placements, problems = [], []
    for fam, s in asks:
        n = s.deployment.num_replicas
        for r in range(n + s.deployment.surge_replicas()):
            owner = f"{fam}[{r}]" if r < n else f"{fam}[surge {r - n}]"
            got = pool.take(s.deployment.num_gpus)
            if got is None:
                problems.append(f"{owner} needs {s.deployment.num_gpus:g} GPUs; not enough free of {n_gpus}")
                continue
            if fam == "vlm":
                placements.append(_vlm(profile, model_dir, got, gpu_bytes, owner))
            elif fam == "tts":
                placements.append(_tts(profile, model_dir, got, gpu_bytes, owner))
            else:  # the video front loads no model (its jobs do): only its process
                placements.append(Placement(owner, got, first=[_ctx()]))
    if jobs > 0:  # the job manager starts jobs.workers workers, each holding jobs.gpus_per_job GPUs and an engine
        workers = profile.video.engine.jobs.workers
        for k in range(workers):
            got = pool.take(jobs)
            if got is None:
                problems.append(f"video job worker {k} of {workers} needs {jobs:g} GPUs; not enough free of {n_gpus}")
                break
            placements.append(_video_job(profile, model_dir, got, f"video job worker {k}"))
    used = [0] * n_gpus
    for p in placements:
        for i, g in enumerate(p.gpus):
            used[g] += sum(x.bytes for x in p.per_gpu) + (sum(x.bytes for x in p.first) if i == 0 else 0)
        problems += [f"{p.owner}: {n[len('PROBLEM: '):]}" for n in p.notes if n.startswith("PROBLEM: ")]
    for g, u in enumerate(used):
        if u > gpu_bytes:
            parts = [f"{p.owner} {x.what} {x.bytes / GIB:.2f}" for p in placements if g in p.gpus
                     for x in p.per_gpu + (p.first if p.gpus[0] == g else [])]
            problems.append(f"GPU {g}: {u / GIB:.2f} GiB > {gpu_bytes / GIB:.2f} GiB ({', '.join(parts)})")
    return MemoryPlan(gpu_bytes, n_gpus, placements, used, problems)


def format_plan(p: MemoryPlan, name: str) -> str:
    """The plan as text: per process its GPUs and every need (GiB and formula), per GPU the total, the verdict."""
    out = [f"profile {name}: {p.n_gpus} GPUs x {both_units(p.gpu_bytes)}"]
    for pl in p.placements:
        out.append(f"{pl.owner} on GPU {','.join(map(str, pl.gpus))}")
        for x in pl.per_gpu:
            out.append(f"  {x.what:30s} {x.bytes / GIB:8.2f} GiB  on each GPU: {x.how}")
        for x in pl.first:
            out.append(f"  {x.what:30s} {x.bytes / GIB:8.2f} GiB  on GPU {pl.gpus[0]}: {x.how}")
        out += [f"  note: {n}" for n in pl.notes]
    for g, u in enumerate(p.used):
        out.append(f"GPU {g}: {u / GIB:.2f} of {p.gpu_bytes / GIB:.2f} GiB ({u / GB:.2f} of {p.gpu_bytes / GB:.2f} GB)")
    out.append("fits" if p.fits else "DOES NOT FIT:\n" + "\n".join(f"  {x}" for x in p.problems))
    return "\n".join(out)


def parse_gpu_memory(text: str) -> int:
    """Bytes of a GPU size written with its unit: ``80GB`` / ``80 GB`` (decimal, as GPUs are sold: 80e9 bytes) or
    ``74.5GiB`` (binary, 2**30 bytes each); the unit is case-insensitive and required. Raises ValueError otherwise
    (a bare number, another unit, a size that is not positive)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(gib|gb)\s*", text, re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"GPU memory {text!r}: write a positive size with its unit, e.g. 80GB or 74.5GiB")
    return int(float(m.group(1)) * (GIB if m.group(2).lower() == "gib" else GB))


def both_units(n_bytes: int) -> str:
    """``n_bytes`` as ``74.5 GiB (80.0 GB)``: binary and decimal gigabytes, one decimal each."""
    return f"{n_bytes / GIB:.1f} GiB ({n_bytes / GB:.1f} GB)"


def gpu_bytes_of(profile: Profile) -> tuple[int | None, str]:
    """The memory of each GPU ``profile`` runs on, in bytes, and where it came from: the profile's
    ``ray.gpu_memory_gib``, else the smallest visible CUDA device; ``(None, reason)`` when neither is known."""
    if profile.ray.gpu_memory_gib:
        return int(profile.ray.gpu_memory_gib * GIB), "the profile's ray.gpu_memory_gib"
    local = local_gpu_bytes()
    if local is not None:
        return local, "the visible CUDA devices"
    return None, "no ray.gpu_memory_gib in the profile and no CUDA device here"


def uses_gpus(profile: Profile) -> bool:
    """True when a deployment or the video jobs ask Ray for GPUs."""
    fams = profile.families()
    return any(_on_gpu(s) for s in fams.values()) or \
        ("video" in fams and profile.video.engine.jobs.gpus_per_job > 0)


def local_gpu_bytes() -> int | None:
    """Memory of the smallest visible CUDA device (bytes), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def check(profile: Profile, gpu_bytes: int | None = None) -> MemoryPlan | None:
    """Plan ``profile`` on GPUs of ``gpu_bytes`` (default: ``ray.gpu_memory_gib``, else the local CUDA devices).
    Returns the plan, or None when the profile uses no GPU or the GPU size is unknown. Raises PlanError with the
    numbers when it does not fit."""
    if not uses_gpus(profile):
        return None
    if gpu_bytes is None:
        gpu_bytes, _ = gpu_bytes_of(profile)
    if gpu_bytes is None:
        return None
    p = plan(profile, gpu_bytes)
    if not p.fits:
        raise PlanError(f"profile {profile.name} does not fit its GPUs:\n" + format_plan(p, profile.name))
    return p
