"""Helpers of bench/gpu_scale.sh's quantization part (issue 26: FP8 vs BF16 for GLM-4-9B and Orpheus-3B, and the
KL search at real size), run on the CPU in a second:

- ``profile --out P [--vlm-quantized C] [--tts-quantized C]``: write a one-GPU copy of the gpu profile (the VLM's
  ``tensor_parallel_size`` and ``num_gpus`` set to 1, ``ray.num_gpus`` to 1, no video section; the lent machine
  has one GPU) with the named quantized checkpoints (``<family>.engine.vllm.quantized``), for ``chimera quantize``,
  ``chimera profile show`` and the benchmarks.
- ``missing --profile P``: print what of the profile's weights is not on this machine (the LLM, the speech LM,
  the trained projector), one line each; exit 1 when something is missing, 0 when all is there.
- ``validate -- CMD...``: parse one command of the script with the parser it will meet (``chimera quantize``'s
  typer command and its value checks, ``chimera profile show``, ``bench/quantization.py``'s and
  ``bench/tts_concurrency.py``'s argparse) without running it; exit 2 with the reason when it would be refused.

    .venv/bin/python bench/gpu_quant.py profile|missing|validate ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_gpu_profile(out: Path, vlm_quantized: str | None = None, tts_quantized: str | None = None,
                    base: str = "gpu") -> Path:
    """Write the profile ``base`` (configs/<base>.yaml) for one GPU, with the quantized checkpoints named, to
    ``out`` (YAML); returns ``out``. Raises ProfileError when the result does not validate."""
    import yaml

    from services.config.profiles import load_profile, parse_profile, profile_path

    data = yaml.safe_load(profile_path(base).read_text())
    data["name"] = out.stem
    data["ray"] = dict(data.get("ray", {}), num_gpus=1)
    data.pop("video", None)  # not measured here
    vlm, tts = data.get("vlm"), data.get("tts")
    if vlm:
        vlm["deployment"] = dict(vlm["deployment"], num_gpus=1)
        vlm["engine"]["vllm"] = dict(vlm["engine"].get("vllm", {}), tensor_parallel_size=1, quantized=vlm_quantized)
    if tts:
        tts["engine"]["vllm"] = dict(tts["engine"].get("vllm", {}), quantized=tts_quantized)
    parse_profile(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    load_profile(out)
    return out


def missing_weights(profile: str) -> list[str]:
    """What of ``profile``'s VLM LLM, speech LM and trained projector is neither under its model_dir nor in the
    Hugging Face cache (no download is tried): one line each, empty when all is here."""
    from core.config import resolve_path
    from services.config.profiles import load_profile

    prof = load_profile(profile)
    model_dir = prof.resolved_model_dir()
    gone = []

    def have(p: str) -> bool:
        if Path(p).exists():
            return True
        try:
            from huggingface_hub import try_to_load_from_cache

            return isinstance(try_to_load_from_cache(p, "config.json"), str)
        except Exception:  # noqa: BLE001 - not a hub id either
            return False

    for fam, key in (("vlm", "llm"), ("vlm", "projector"), ("tts", "lm")):
        section = getattr(prof, fam)
        name = getattr(section.engine, key, None) if section else None
        if name and not have(resolve_path(model_dir, name)):
            gone.append(f"{fam}.engine.{key}: {name} (not under {model_dir}, not in the Hugging Face cache)")
    return gone


def _why(e: Exception) -> str:
    """A typer/click error's message as the CLI prints it."""
    return e.format_message() if hasattr(e, "format_message") else str(e)


def validate(argv: list[str]) -> None:
    """Parse one command line of bench/gpu_scale.sh as the program it names would, without running it. Raises
    ValueError with the reason when it would be refused (unknown option, bad value, unknown program)."""
    import typer

    names = [Path(a).name for a in argv]
    if "chimera" in names[:1] and argv[1:2] == ["quantize"]:
        from core.quant.schemes import UnsupportedSchemeError, require_host
        from core.quant.search import selection_fraction
        from services.config.profiles import ProfileError, load_profile
        from services.quantize_cli import FAMILIES, _fractions, quantize_app

        cmd = typer.main.get_command(quantize_app)
        if argv[2:3] == ["report"]:
            try:
                cmd.commands["report"].make_context("report", list(argv[3:]))
            except typer.TyperException as e:
                raise ValueError(f"{' '.join(argv)}: {_why(e)}") from None
            return
        try:
            ctx = cmd.make_context("quantize", list(argv[2:]))
        except typer.TyperException as e:
            raise ValueError(f"{' '.join(argv)}: {_why(e)}") from None
        p = ctx.params
        try:
            require_host(p["scheme"], "cuda")
            if p["family"] not in FAMILIES:
                raise ValueError(f"--family {p['family']!r}")
            selection_fraction(p["select"], p["fraction"])
            _fractions(p["compare"])
            load_profile(p["profile"])
        except (UnsupportedSchemeError, ValueError, ProfileError) as e:
            raise ValueError(f"{' '.join(argv)}: {e}") from None
        return
    if "chimera" in names[:1] and argv[1:3] == ["profile", "show"]:
        from services.cli import app
        from services.config.profiles import ProfileError, load_profile

        group = typer.main.get_command(app)
        try:
            ctx = group.commands["profile"].commands["show"].make_context("show", list(argv[3:]))
            load_profile(ctx.params["profile"])
        except (typer.TyperException, ProfileError) as e:
            raise ValueError(f"{' '.join(argv)}: {e}") from None
        return
    if "chimera" in names[:1] and argv[1:2] == ["speculator"]:
        from services.config.profiles import ProfileError, load_profile
        from services.speculator_cli import TRAIN_KINDS, speculator_app

        cmd = typer.main.get_command(speculator_app)
        sub = argv[2] if len(argv) > 2 else ""
        try:
            ctx = cmd.commands[sub].make_context(sub, list(argv[3:]))
            if sub == "train":
                p = ctx.params
                if p["train_kinds"] not in TRAIN_KINDS or p["device"] not in ("cpu", "cuda"):
                    raise ValueError(f"--train-kinds {p['train_kinds']!r} --device {p['device']!r}")
                load_profile(p["profile"])
        except KeyError:
            raise ValueError(f"{' '.join(argv)}: no speculator command {sub!r}") from None
        except (typer.TyperException, ValueError, ProfileError) as e:
            raise ValueError(f"{' '.join(argv)}: {_why(e)}") from None
        return
    script = next((a for a in argv if a.endswith(".py")), None)
    if script and Path(script).name in ("quantization.py", "tts_concurrency.py", "speculator.py"):
        import importlib

        from services.config.profiles import ProfileError, load_profile

        mod = importlib.import_module(f"bench.{Path(script).stem}")
        rest = argv[argv.index(script) + 1:]
        try:
            a = mod.parser().parse_args(rest)
            load_profile(a.profile)
        except SystemExit:
            raise ValueError(f"{' '.join(argv)}: refused by {script}'s parser") from None
        except ProfileError as e:
            raise ValueError(f"{' '.join(argv)}: {e}") from None
        if hasattr(mod, "check_args"):
            mod.check_args(a)
        return
    raise ValueError(f"{' '.join(argv)}: not a command this validator knows")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    pr = sub.add_parser("profile")
    pr.add_argument("--out", type=Path, required=True)
    pr.add_argument("--vlm-quantized")
    pr.add_argument("--tts-quantized")
    mi = sub.add_parser("missing")
    mi.add_argument("--profile", default="gpu")
    va = sub.add_parser("validate")
    va.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.what == "profile":
        print(one_gpu_profile(a.out, a.vlm_quantized, a.tts_quantized))
        return 0
    if a.what == "missing":
        gone = missing_weights(a.profile)
        print("\n".join(gone))
        return 1 if gone else 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    try:
        validate(cmd)
    except ValueError as e:
        print(f"gpu_quant validate: {e}", file=sys.stderr)
        return 2
    print(f"ok: {' '.join(cmd)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
