"""``chimera speculator``: train an EAGLE-3 draft head for the VLM's LLM on the service's kinds of traffic, with
measured acceptance, and print the report.

``chimera speculator train`` has the LLM answer the cpu profile's prompts greedily (self-distillation: text chat
prompts as token ids, the graft's scene questions as the image embeddings the service sends), trains the head on
its hidden states and writes a checkpoint in speculators' format with ``speculator.json`` (what vLLM's
``--speculative-config '{"method": "eagle3", "model": <folder>, "num_speculative_tokens": 3}'`` loads, and the VLM
profile's ``vlm.engine.vllm.speculative`` serves once :func:`services.engines.vllm_server.served_speculation`
accepts it; for SmolLM2-135M the head carries its own embedding table with a row for vLLM's mixed-prompt marker
id, :func:`core.spec.worker.pad_head_table`);
``chimera speculator report <folder>`` prints its table. The work runs in ``.venv-spec`` (:mod:`core.spec.runner`);
the prompts are built here, in the service's environment (:func:`grafting.train.quant_prompts.vlm_prompt_sets`),
with ``--traffic``'s captured conversations (:func:`grafting.traffic.read_traffic`: text ones as token ids, those
with images as the embeddings the service sent, from the image rows stored at capture) as two more training sets,
``traffic_text`` and ``traffic_image``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

TRAIN_KINDS = ("scene", "chat", "both")  # --train-kinds: the training set's kinds of traffic

speculator_app = typer.Typer(add_completion=False, no_args_is_help=True,
                             help="Train and inspect EAGLE-3 draft heads (speculative decoding) for the VLM's LLM.")


@speculator_app.command("train")
def train(profile: str = typer.Option("cpu", help="profile name (configs/<name>.yaml) or path"),
          out: Path = typer.Option(None, help="head folder (default <model_dir>/vlm/speculator-eagle3)"),
          steps: int = typer.Option(400, min=1, help="training steps (one packed batch each)"),
          lr: float = typer.Option(1e-3, min=0.0, help="AdamW peak learning rate (5 % warm-up, cosine)"),
          tokens: int = typer.Option(3, min=1, help="draft tokens per step (training-time test steps; serve with "
                                                    "this num_speculative_tokens)"),
          draft_vocab: int = typer.Option(8192, min=1, help="draft vocabulary: the most frequent answer tokens"),
          answer_tokens: int = typer.Option(64, min=2, help="greedy answer length per prompt (EOS ends it sooner)"),
          train_kinds: str = typer.Option("both", help="the training set's traffic: scene (scene questions only), "
                                                        "chat (text prompts only) or both"),
          train_scenes: int = typer.Option(32, min=0, help="train-split scene questions in the training set (0 with "
                                                          "--train-kinds chat)"),
          train_chat: int = typer.Option(8, min=0, help="text prompts in the training set, none of them held out "
                                                       "(0 with --train-kinds scene; at most 507)"),
          heldout_scenes: int = typer.Option(16, min=1, help="held-out test-split scene questions"),
          heldout_chat: int = typer.Option(24, min=1, max=24, help="held-out text chat prompts (the first of the "
                                                                  "evaluation's 24 TEXT_PROMPTS)"),
          pack_tokens: int = typer.Option(2048, min=16, help="tokens per packed training batch"),
          seed: int = typer.Option(0, help="scene draws, initialisation and batch order"),
          threads: int = typer.Option(2, min=1, help="torch threads of the worker"),
          device: str = typer.Option("cpu", help="where the verifier (in the profile's dtype) and the head run: cpu "
                                                 "or cuda (the gpu profile's GLM-4-9B)"),
          traffic: Path = typer.Option(None, help="a captured traffic dataset (vlm.engine.traffic_capture's JSONL): "
                                                  "its conversations join the training set (text ones as token ids, "
                                                  "those with images as the stored image embeddings; lines whose "
                                                  "embeddings are missing are skipped and counted)")):
    """Distill, train, measure acceptance on the held-out sets, write the head and speculator.json; print the
    table. Exit 2: refused (a profile error, no vlm section, an unknown --train-kinds or --device, an empty
    training set);
    exit 1: the worker failed."""
    from core.config import resolve_path
    from core.quant.prompts import write_prompts
    from core.spec.report import acceptance_table
    from core.spec.runner import SpeculatorTrainError, train_head

    from .config.profiles import ProfileError, load_profile

    def refuse(msg: str):
        typer.echo(f"chimera speculator train: {msg}", err=True)
        raise typer.Exit(2)

    try:
        prof = load_profile(profile)
    except ProfileError as err:
        refuse(str(err))
    if prof.vlm is None:
        refuse(f"profile {prof.name} has no vlm section")
    if device not in ("cpu", "cuda"):
        refuse(f"--device {device!r}: cpu or cuda")
    if train_kinds not in TRAIN_KINDS:
        refuse(f"--train-kinds {train_kinds!r}: one of {', '.join(TRAIN_KINDS)}")
    n_scenes = 0 if train_kinds == "chat" else train_scenes
    n_chat = 0 if train_kinds == "scene" else train_chat
    cfg = prof.vlm.engine
    model_dir = prof.resolved_model_dir()
    llm_dir = resolve_path(model_dir, cfg.llm)
    out = Path(out or Path(model_dir) / "vlm" / "speculator-eagle3").resolve()
    captured = None
    if traffic is not None:
        from grafting.traffic import read_traffic

        try:
            captured = read_traffic(traffic)
        except (OSError, ValueError) as e:
            refuse(f"--traffic: {e}")
        typer.echo(f"traffic: {len(captured.text)} text and {len(captured.images)} image conversations from "
                   f"{traffic}; {captured.missing} with images skipped (their embeddings are missing)")
    if n_scenes + n_chat + (len(captured.text) + len(captured.images) if captured else 0) == 0:
        refuse(f"--train-kinds {train_kinds}: the training set would be empty")
    with tempfile.TemporaryDirectory(prefix="chimera-speculator-") as tmp:
        typer.echo(f"prompts: building the training and held-out sets ({prof.name} profile)")
        from grafting.train.quant_prompts import vlm_prompt_sets

        try:
            sets = vlm_prompt_sets(cfg, model_dir, scene_heldout=heldout_scenes, scene_search=n_scenes,
                                   chat_heldout=heldout_chat, chat_search=n_chat, seed=seed, fit="train", traffic=captured)
        except ValueError as e:  # too many chat prompts, or a captured conversation the processor refuses
            refuse(f"--traffic: a captured conversation is refused: {e}"
                   if captured is not None and "chat training prompts" not in str(e) else str(e))
        prompts = write_prompts(Path(tmp) / "prompts.safetensors", sets)
        spec = {"verifier": str(llm_dir), "prompts": str(prompts), "out": str(out), "layer_ids": None,
                "answer_tokens": answer_tokens, "draft_vocab": draft_vocab, "steps": steps, "lr": lr,
                "ttt_steps": tokens, "pack_tokens": pack_tokens, "batch": 8, "seed": seed, "threads": threads,
                "device": device, "verifier_dtype": cfg.dtype}
        try:
            record = train_head(spec, Path(tmp) / "spec.json", echo=typer.echo)
        except SpeculatorTrainError as e:
            typer.echo(f"chimera speculator train: {e}", err=True)
            raise typer.Exit(2 if e.returncode == 2 else 1) from None
    typer.echo(acceptance_table(record))


@speculator_app.command("report")
def report(head: Path = typer.Argument(..., help="a folder written by chimera speculator train")):
    """Print a head's acceptance table (from its speculator.json). Exit 2: no readable speculator.json."""
    from core.spec.record import SpeculatorError, read_record
    from core.spec.report import acceptance_table

    try:
        record = read_record(head)
    except SpeculatorError as e:
        typer.echo(f"chimera speculator report: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{head}: EAGLE-3 head for {record['verifier']}, {record['parameters']:,} trained parameters, "
               f"{record['steps']} steps, draft vocabulary {record['draft_vocab']}, layers {record['layer_ids']}")
    typer.echo(acceptance_table(record))
