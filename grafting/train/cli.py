"""``chimera graft ...``: synthetic data, tower pretraining, projector training, evaluation, export.

The typer app ``graft_app`` is mounted by ``services/cli.py``; it is also runnable alone
(``python -m grafting.train``, :mod:`grafting.train.__main__`) and under
``accelerate launch -m grafting.train train --config ...``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

graft_app = typer.Typer(help="Grafting: synthetic data, tower pretraining, projector training, evaluation.",
                        no_args_is_help=True)
ASSETS = Path(__file__).resolve().parents[1] / "assets"  # grafting/assets


@graft_app.command()
def synth(out: Path = typer.Option(Path("runs/synth"), help="output folder"),
          n_train: int = typer.Option(2000, help="training images (one caption row + one QA row each)"),
          n_test: int = typer.Option(200, help="held-out test images (one question row per question type)"),
          seed: int = typer.Option(0), canvas: int = typer.Option(112, help="image side in pixels")):
    """Write the synthetic shape dataset (LLaVA JSONL + PNG images) with its held-out split."""
    from .synth import write_dataset

    paths = write_dataset(out, n_train, n_test, seed, canvas)
    typer.echo(json.dumps({k: str(v) for k, v in paths.items()}))


@graft_app.command()
def scenes(out: Path = typer.Option(Path("runs/scenes"), help="output folder"),
           n_train: int = typer.Option(3000, help="training images (one caption row + one 3-turn QA row each)"),
           n_test: int = typer.Option(150, help="held-out images (gradient backgrounds, held-out size band), "
                                                "one held-out-phrasing question row per question type"),
           seed: int = typer.Option(0), canvas: int = typer.Option(112, help="image side in pixels")):
    """Write the varied scene dataset (grafting.train.scenes): everyday phrasings, held-out phrasings and renderings."""
    from .scenes import write_dataset

    paths = write_dataset(out, n_train, n_test, seed, canvas)
    typer.echo(json.dumps({k: str(v) for k, v in paths.items()}))


@graft_app.command("pretrain-tower")
def pretrain_tower_cmd(out: Path = typer.Option(..., help="folder for the tower (save_pretrained)"),
                       steps: int = typer.Option(1800), batch_size: int = typer.Option(32),
                       lr: float = typer.Option(1e-3), seed: int = typer.Option(0),
                       hidden_size: int = typer.Option(192), layers: int = typer.Option(3),
                       heads: int = typer.Option(4), intermediate_size: int = typer.Option(512),
                       split: str = typer.Option("pretrain", help="synthetic split: pretrain (broad) or train"),
                       init: str = typer.Option(None, help="continue from this tower folder"),
                       source: str = typer.Option("synth", help="synth (grafting.train.synth) or scenes "
                                                                "(grafting.train.scenes)"),
                       token_weight: float = typer.Option(0.0, help="per-token shape/colour loss weight (scenes)"),
                       centre_weight: float = typer.Option(0.0, help="per-token object-centre count loss weight "
                                                                     "(scenes)"),
                       density_weight: float = typer.Option(0.0, help="per-token object-area density loss weight "
                                                                      "(scenes, mean squared error)"),
                       patch_stem: str = typer.Option("linear", help="linear (MoonViT's patch embedding) or conv "
                                                                     "(grafting.tower.MoonViTConvStem)"),
                       stem_channels: str = typer.Option("24,48,48", help="conv stem widths, comma list"),
                       stem_strides: str = typer.Option("2,1,1", help="conv stem strides (1 or 2), comma list"),
                       stem_patch: int = typer.Option(14, help="conv stem: px each 14-px patch is resampled to"),
                       canvas: int = typer.Option(112, min=28, help="scene side in px (224: 64 merged tokens a "
                                                                 "scene, 112: 16)")):
    """Pretrain a small MoonViT on synthetic shape/colour classification (seeded), then save it frozen."""
    import torch

    from ..config import TowerBuild
    from .pretrain import PretrainTowerConfig, pretrain_tower

    torch.manual_seed(seed)
    cfg = PretrainTowerConfig(tower=TowerBuild(hidden_size=hidden_size, num_hidden_layers=layers,
                                               num_attention_heads=heads, intermediate_size=intermediate_size,
                                               patch_stem=patch_stem,
                                               stem_channels=[int(c) for c in stem_channels.split(",")],
                                               stem_strides=[int(c) for c in stem_strides.split(",")],
                                               stem_patch=stem_patch),
                              steps=steps, batch_size=batch_size, lr=lr, seed=seed, split=split, init=init,
                              source=source, token_weight=token_weight, centre_weight=centre_weight,
                              density_weight=density_weight, canvas=canvas)
    m = pretrain_tower(cfg, out, log=typer.echo)
    typer.echo(json.dumps({"test_probe_accuracy": m["test_probe_accuracy"], "seconds": round(m["seconds"], 1)}))


@graft_app.command()
def train(config: Path = typer.Option(..., help="training YAML (configs/graft/*.yaml)"),
          output_dir: str = typer.Option(None, help="override output_dir"),
          dry_run: bool = typer.Option(False, help="build on the meta device and report; no training")):
    """Train the projector (tower and LLM frozen); stages, checkpoints and resume as configured."""
    from .config import TrainConfig
    from .loop import dry_run as do_dry_run, train as do_train

    cfg = TrainConfig.from_yaml(config, output_dir=output_dir)
    if dry_run:
        rep = do_dry_run(cfg)
        rep["devices"] = sorted(rep["devices"])
        typer.echo(json.dumps(rep))
        return
    typer.echo(json.dumps(do_train(cfg, log=typer.echo)))


@graft_app.command("eval")
def eval_cmd(checkpoint: Path = typer.Option(..., help="a checkpoint folder (graft.json + projector/)"),
             data: Path = typer.Option(..., help="test.jsonl (synthetic), MMStar/MMMU-Pro .tsv or .jsonl"),
             conditions: str = typer.Option("image,blind,shuffled", help="comma list of image|blind|shuffled"),
             kl: bool = typer.Option(True, help="also measure text-only KL vs the base LLM"),
             tower: str = typer.Option(None, help="override the tower named in graft.json"),
             llm_dtype: str = typer.Option("bfloat16"), limit: int = typer.Option(None, help="first N items"),
             types: str = typer.Option(None, help="comma list of question types to keep"),
             generate: bool = typer.Option(False, help="also greedy-generate every answer (grafting.train.scenes test "
                                                    "files): generated accuracy, one-word format check, table"),
             out: Path = typer.Option(None, help="write the results as JSON here")):
    """Multiple-choice accuracy by answer likelihood, blind/shuffled baselines and text-only KL; with
    ``--generate`` also generated-answer accuracy and the format check, then a Markdown table."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from .evaluate import predict, random_chance, summarize, text_kl
    from .mcq import read_items
    from .checkpoint import load_checkpoint_config, load_graft

    acc = Accelerator()
    mc = load_checkpoint_config(checkpoint)
    mc.llm_dtype = llm_dtype
    if tower:
        mc.tower = tower
    vlm, processor = load_graft(mc, acc.device)
    items = read_items(data, limit)
    if types:
        items = [it for it in items if it.question_type in types.split(",")]
    res = {"checkpoint": str(checkpoint), "data": str(data), "chance": random_chance(items)}
    for cond in [c.strip() for c in conditions.split(",") if c.strip()]:
        part = predict(vlm, processor, items, cond, shard=(acc.process_index, acc.num_processes),
                       progress=acc.is_main_process)
        merged = {}
        for d in gather_object([part]):
            merged.update(d)
        res[cond] = summarize(items, merged, cond)
    if generate and acc.is_main_process:
        from .data import read_jsonl
        from .freeform import evaluate_generated

        keep = {it.id for it in items}
        rows = [r for r in read_jsonl(data) if r["id"] in keep]
        res["generated"] = evaluate_generated(vlm, processor, rows, progress=True)
    if kl and acc.is_main_process:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(mc.llm, dtype=vlm.llm.dtype).to(acc.device).eval()
        vals = text_kl(vlm, base, processor)
        res["text_kl"] = {"n_prompts": len(vals), "max": max(vals), "mean": sum(vals) / len(vals)}
        del base
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if acc.is_main_process:
        text = json.dumps(res, indent=2)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        typer.echo(text)
        if generate:
            from .report import varied_table

            typer.echo(varied_table(res))


@graft_app.command()
def export(checkpoint: Path = typer.Option(..., help="trained checkpoint folder (graft.json + projector/)"),
           name: str = typer.Option(..., help="folder name under grafting/assets"),
           dtype: str = typer.Option("float16", help="storage dtype of tower and projector weights")):
    """Copy a trained projector and its tower into ``grafting/assets/<name>`` (``build.shipped_graft``)."""
    from transformers import Kimi_K25ImageProcessor

    from core.memory import DTYPES

    from ..projector import GraftProjector
    from ..tower import tower_class

    dt = DTYPES[dtype]
    g = json.loads((checkpoint / "graft.json").read_text())
    dest = ASSETS / name
    shutil.rmtree(dest, ignore_errors=True)
    tower_class(g["tower"]).from_pretrained(g["tower"]).to(dt).save_pretrained(dest / "tower")
    Kimi_K25ImageProcessor.from_pretrained(g["tower"]).save_pretrained(dest / "tower")
    GraftProjector.from_pretrained(checkpoint / "projector").to(dt).save_pretrained(dest / "projector")
    g.update(tower="tower", projector="projector", exported_dtype=dtype)
    (dest / "graft.json").write_text(json.dumps(g, indent=2))
    typer.echo(str(dest))
