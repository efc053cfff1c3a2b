"""``chimera quantize``: quantize a family's language model with measured fidelity, and print the report.

``chimera quantize --family vlm --scheme w8a8-int8 --select greedy --fraction 0.75`` writes a compressed-tensors
checkpoint (served by the profile option ``vlm.engine.vllm.quantized: <folder>``) with ``fidelity.json``;
``chimera quantize report <folder>`` prints its tables. The work runs in ``.venv-quant``
(:mod:`core.quant.runner`); the family's prompts are built here, in the service's environment.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

quantize_app = typer.Typer(add_completion=False, invoke_without_command=True,
                           help="Quantize a language model with measured fidelity (KL divergence).")
FAMILIES = ("vlm", "tts")


def _fractions(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--compare {text!r}: a comma list of fractions, e.g. 0.25,0.5,0.75") from None
    if any(not 0 < v < 1 for v in vals):
        raise typer.BadParameter(f"--compare {text!r}: every fraction must be in (0, 1)")
    return vals


@quantize_app.callback()
def quantize(ctx: typer.Context,
             family: str = typer.Option("vlm", help="whose language model: vlm (the grafted VLM's LLM) or tts "
                                                    "(the speech LM; statistics over its audio ids)"),
             profile: str = typer.Option("cpu", help="profile name (configs/<name>.yaml) or path"),
             scheme: str = typer.Option("w8a8-int8", help="w8a8-int8 (CPU: AVX2/AVX512; CUDA), w4a16 (CPU with "
                                                          "AVX512; CUDA), fp8 (CUDA only)"),
             select: str = typer.Option("greedy", help="none | all | greedy | sensitivity | random"),
             fraction: float = typer.Option(None, help="fraction of units to quantize (greedy, sensitivity, random; "
                                                       "none: 0, all: 1)"),
             seed: int = typer.Option(0, help="random selection and scene draws"),
             shortlist: int = typer.Option(8, help="greedy: candidates tried per step (the least sensitive left)"),
             answer_tokens: int = typer.Option(32, help="greedy reference answer length scored per prompt"),
             scene_prompts: int = typer.Option(None, help="vlm: held-out scene questions (with images; default 48)"),
             search_prompts: int = typer.Option(8, help="vlm: search-set scene questions (plus 8 text prompts); "
                                                        "tts: search utterances"),
             compare: str = typer.Option(None, help="also score every method at these fractions (e.g. "
                                                    "0.25,0.5,0.75) for the comparison table"),
             out: Path = typer.Option(None, help="checkpoint folder (default <model_dir>/<family>/"
                                                 "llm-<scheme>-<select>-<fraction>, lm-... for tts)"),
             threads: int = typer.Option(None, help="torch threads of the worker (default: torch's)")):
    """Quantize, measure, write the checkpoint and fidelity.json; print the table. Exit 2: refused (unknown
    family, scheme, selection; a scheme this host cannot serve; a profile error); exit 1: the worker failed."""
    if ctx.invoked_subcommand is not None:
        return
    from core.quant.report import comparison_table
    from core.quant.runner import QuantizeError, run_worker
    from core.quant.schemes import UnsupportedSchemeError, require_host
    from core.quant.search import selection_fraction

    from .config.profiles import ProfileError, load_profile

    def refuse(msg: str):
        typer.echo(f"chimera quantize: {msg}", err=True)
        raise typer.Exit(2)

    device = "cuda" if _cuda() else "cpu"
    try:
        require_host(scheme, device)
    except UnsupportedSchemeError as e:
        refuse(str(e))
    if family not in FAMILIES:
        refuse(f"--family {family!r}: one of {', '.join(FAMILIES)}")
    if family == "tts" and scene_prompts is not None:
        refuse("--scene-prompts is the VLM's held-out scene questions: the speech LM has none (--family tts)")
    try:
        frac = selection_fraction(select, fraction)
    except ValueError as e:
        refuse(str(e))
    fractions = _fractions(compare)
    try:
        prof = load_profile(profile)
    except ProfileError as err:
        refuse(str(err))
    section = getattr(prof, family)
    if section is None:
        refuse(f"profile {prof.name} has no {family} section")
    from core.config import resolve_path
    from core.quant.prompts import write_prompts

    model_dir = prof.resolved_model_dir()
    cfg = section.engine
    llm_dir = resolve_path(model_dir, cfg.llm if family == "vlm" else cfg.lm)
    name = f"{'llm' if family == 'vlm' else 'lm'}-{scheme}-{select}"
    out = out or model_dir / family / (name + ("" if select in ("none", "all") else f"-{frac:g}"))
    with tempfile.TemporaryDirectory(prefix="chimera-quantize-") as tmp:
        typer.echo(f"prompts: building the search and held-out sets ({prof.name} profile)")
        if family == "vlm":
            from grafting.train.quant_prompts import vlm_prompt_sets

            held = {} if scene_prompts is None else {"scene_heldout": scene_prompts}  # else the builder's default
            sets, vocab = vlm_prompt_sets(cfg, model_dir, scene_search=search_prompts, seed=seed, **held), None
        else:
            from audio.quant_prompts import tts_prompt_sets

            sets, vocab = tts_prompt_sets(cfg, model_dir, search=search_prompts)
        prompts = write_prompts(Path(tmp) / "prompts.safetensors", sets, vocab)
        spec = {"model_dir": str(llm_dir), "prompts": str(prompts), "out": str(Path(out).resolve()),
                "scheme": scheme, "select": select, "fraction": frac, "seed": seed, "shortlist": shortlist,
                "answer_tokens": answer_tokens, "compare_fractions": fractions, "family": family,
                "device": device, "threads": threads}
        try:
            record = run_worker(spec, Path(tmp) / "spec.json", echo=typer.echo)
        except QuantizeError as e:
            typer.echo(f"chimera quantize: {e}", err=True)
            raise typer.Exit(2 if e.returncode == 2 else 1) from None
    typer.echo(comparison_table(record))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@quantize_app.command("report")
def report(checkpoint: Path = typer.Argument(..., help="a folder written by chimera quantize"),
           detail: bool = typer.Option(True, help="also the llama.cpp-style listing per held-out set")):
    """Print a checkpoint's fidelity tables (from its fidelity.json). Exit 2: no readable fidelity.json."""
    from core.quant.fidelity import QuantizedCheckpointError, read_fidelity
    from core.quant.report import comparison_table
    from core.quant.report import detail as listing

    try:
        record = read_fidelity(checkpoint)
    except QuantizedCheckpointError as e:
        typer.echo(f"chimera quantize report: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{checkpoint}: {record['scheme']}, {record['select']} @ {record['fraction']:g}: "
               f"{len(record['quantized_units'])}/{record['units_total']} units quantized")
    typer.echo(comparison_table(record))
    if detail:
        for name, rep in record["heldout"].items():
            typer.echo("")
            typer.echo(listing(rep, name))
