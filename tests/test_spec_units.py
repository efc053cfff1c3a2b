"""core.spec without a worker: acceptance statistics against a hand-computed case (and vLLM's counters),
speculator.json's checks, the profile option's check before vLLM starts, the worker's widening of a head's
embedding table for vLLM's marker id, its training alignment, the acceptance table and the CLI's refusals."""

from __future__ import annotations

import json

import pytest
import torch

from core.spec.acceptance import acceptance_summary, accepted_lengths, counters_from_metrics, from_vllm_counters
from core.spec.record import SpeculatorError, read_record, verify_head, write_record


def test_accepted_lengths_match_a_hand_computed_case():
    """Truth 10 11 12 13 14 15; three drafts of k = 3 from offset 1 propose truth[1..3], truth[2..4], truth[3..5]:
    draft 0 = 11 12 99 (2 accepted), draft 1 = 12 13 14 (3), draft 2 = 98 14 15 (0: the first token is wrong, so
    the later matches do not count)."""
    truth = torch.tensor([10, 11, 12, 13, 14, 15])
    drafts = torch.tensor([[11, 12, 98], [12, 13, 14], [99, 14, 15]])  # (k, S): row i = every draft's token i
    lengths = accepted_lengths(drafts, truth, offset=1)
    assert lengths.tolist() == [2, 3, 0]
    s = acceptance_summary(lengths, 3)
    assert s["drafts"] == 3 and s["num_speculative_tokens"] == 3
    assert s["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)  # vLLM's: the bonus token counts
    assert s["acceptance_rate"] == pytest.approx(5 / 9)
    assert s["acceptance_rate_per_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    with pytest.raises(ValueError, match="truth has 6 tokens"):
        accepted_lengths(drafts, truth, offset=2)


def test_acceptance_without_drafts_is_nan():
    s = acceptance_summary(torch.zeros(0, dtype=torch.long), 3)
    assert s["drafts"] == 0 and s["mean_acceptance_length"] != s["mean_acceptance_length"]
    assert from_vllm_counters(0, 0, [0, 0])["drafts"] == 0


METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="llm"} 3.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="llm"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llm"} 9.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llm"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llm",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llm",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llm",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="llm",position="0"} 1.7e+09
"""


def test_vllm_counters_give_the_same_summary_as_the_drafts():
    """The hand case's three drafts as vLLM counts them (2 + 3 + 0 accepted; per position 2, 2, 1)."""
    drafts, accepted, per_pos = counters_from_metrics(METRICS)
    assert (drafts, accepted, per_pos) == (3.0, 5.0, [2.0, 2.0, 1.0])
    got = from_vllm_counters(drafts, accepted, per_pos)
    want = acceptance_summary(torch.tensor([2, 3, 0]), 3)
    for key in ("drafts", "mean_acceptance_length", "acceptance_rate"):
        assert got[key] == pytest.approx(want[key])
    assert got["acceptance_rate_per_position"] == pytest.approx(want["acceptance_rate_per_position"])
    assert counters_from_metrics("# nothing\nvllm:num_requests_running 0.0\n") == (0.0, 0.0, [])


def _head(tmp_path, weights: bytes = b"verifier weights"):
    """A verifier folder and a head folder whose speculator.json names it."""
    from core.quant.fidelity import weights_sha256

    ref, head = tmp_path / "llm", tmp_path / "head"
    ref.mkdir(parents=True)
    head.mkdir()
    (ref / "model.safetensors").write_bytes(weights)
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    write_record(head, {"verifier_sha256": weights_sha256(ref), "num_speculative_tokens": 3})
    return ref, head


def test_record_checks(tmp_path):
    ref, head = _head(tmp_path)
    assert verify_head(head, ref)["num_speculative_tokens"] == 3
    assert read_record(head)["format"] == 1
    (ref / "model.safetensors").write_bytes(b"retrained")
    with pytest.raises(SpeculatorError, match="trained for other weights"):
        verify_head(head, ref)
    ref2, head2 = _head(tmp_path / "b")
    (head2 / "config.json").write_text(json.dumps({"speculators_model_type": "mlp_speculator"}))
    with pytest.raises(SpeculatorError, match="not a speculators EAGLE-3 config"):
        verify_head(head2, ref2)
    (head2 / "speculator.json").write_text("{not json")
    with pytest.raises(SpeculatorError, match="unreadable"):
        read_record(head2)
    (head2 / "speculator.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(SpeculatorError, match="format 1"):
        read_record(head2)
    (head2 / "speculator.json").unlink()
    with pytest.raises(SpeculatorError, match="speculator.json is missing"):
        verify_head(head2, ref2)
    with pytest.raises(SpeculatorError, match="no \\*.safetensors"):
        verify_head(head, tmp_path / "empty")


def own_table(head, rows: int, declared: int | None = None, width: int = 4):
    """Give the head folder ``head`` an ``embed_tokens.weight`` of ``(rows, width)`` zeros (its only tensor) and a
    config declaring ``declared`` (default ``rows``) rows."""
    from safetensors.torch import save_file

    save_file({"embed_tokens.weight": torch.zeros(rows, width)}, str(head / "model.safetensors"))
    cfg = json.loads((head / "config.json").read_text())
    cfg["transformer_layer_config"] = {"vocab_size": rows if declared is None else declared}
    (head / "config.json").write_text(json.dumps(cfg))


def test_pad_head_table_gives_the_marker_a_row(tmp_path, model_dir):
    """The worker's widening of a saved head (:func:`core.spec.worker.pad_head_table`): SmolLM2's 49152 rows and
    vLLM's marker id 49152 give 49216 rows, the verifier's first, the marker's equal to that of id 0 (the id the
    head saw at image positions), zeros elsewhere, the config's ``vocab_size`` and the dtype following; a head
    without a table is refused; :func:`core.vllm_marker.embeds_marker` reads the marker from the tokenizer."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from core.smollm2 import smollm2_tokenizer
    from core.spec.worker import pad_head_table
    from core.vllm_marker import embeds_marker, head_embed_rows, padded_rows

    tok = smollm2_tokenizer(model_dir)
    tok.save_pretrained(tmp_path / "llm")
    LlamaConfig(vocab_size=len(tok)).save_pretrained(tmp_path / "llm")
    marker, rows = embeds_marker(tmp_path / "llm")
    assert (marker, rows) == (49152, 49152) and padded_rows(rows, marker) == 49216
    assert padded_rows(49216, 49152) == 49216 and padded_rows(100, 163) == 192
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    own_table(head, rows)
    table = torch.randn(rows, 4, dtype=torch.bfloat16)
    save_file({"embed_tokens.weight": table, "fc.weight": torch.ones(2, 2)}, str(head / "model.safetensors"))
    assert pad_head_table(head, marker, rows) == 49216
    got = load_file(str(head / "model.safetensors"))
    e = got["embed_tokens.weight"]
    assert e.shape == (49216, 4) and e.dtype == torch.bfloat16 and torch.equal(got["fc.weight"], torch.ones(2, 2))
    assert torch.equal(e[:rows], table) and torch.equal(e[marker], table[0]) and not e[marker + 1:].any()
    assert head_embed_rows(head) == 49216
    save_file({"fc.weight": torch.ones(2, 2)}, str(head / "model.safetensors"))
    assert head_embed_rows(head) is None
    with pytest.raises(ValueError, match="no embed_tokens.weight"):
        pad_head_table(head, marker, rows)


def test_served_speculation_checks_an_eagle3_head_before_vllm_starts(tmp_path, model_dir):
    """``vllm.speculative``: n-gram passes unchanged; an eagle3 head is resolved against the model directory and
    checked against a speculator.json naming the LM's weights; for the VLM (image prompts as vLLM mixed prompts) it
    is refused when neither the LLM's embedding table (SmolLM2's tokenizer with as many rows as ids, the cpu
    profile's LLM) nor the head's own has a row for vLLM's marker id, or when the head's own table disagrees with
    its config, and served when the head's own table has one (64 rows more, as the worker writes it) or the LLM's
    has; the speech LM's config refuses any speculation."""
    from transformers import LlamaConfig

    from audio.config import TTSConfig
    from core.config import DraftSpeculation, NgramSpeculation, VLLMOptions
    from core.smollm2 import smollm2_tokenizer
    from grafting.config import VLMConfig
    from services.engines.vllm_server import served_speculation

    ref, head = _head(tmp_path)
    tok = smollm2_tokenizer(model_dir)
    tok.save_pretrained(ref)
    LlamaConfig(vocab_size=len(tok)).save_pretrained(ref)
    ngram = NgramSpeculation(method="ngram", num_speculative_tokens=4)
    assert served_speculation(VLMConfig(backend="vllm", llm="llm", vllm=VLLMOptions(speculative=ngram)),
                              tmp_path) == ngram
    assert served_speculation(VLMConfig(backend="vllm", llm="llm"), tmp_path) is None
    eagle = VLLMOptions(speculative=DraftSpeculation(method="eagle3", model="head", num_speculative_tokens=3))
    cfg = VLMConfig(backend="vllm", llm="llm", vllm=eagle)
    with pytest.raises(SpeculatorError, match="the id 49152 of its own marker token '<prompt_embeds>'.* the LLM's "
                                              "has 49152 rows and the head none of its own"):  # no table of its own
        served_speculation(cfg, tmp_path)
    own_table(head, len(tok))  # an older head: speculators saved the LLM's own 49152 rows
    with pytest.raises(SpeculatorError, match="the LLM's has 49152 rows and the head 49152, .*chimera speculator "
                                              "train"):
        served_speculation(cfg, tmp_path)
    own_table(head, len(tok) + 64, declared=len(tok))
    with pytest.raises(SpeculatorError, match="has 49216 rows but its config.json's transformer_layer_config"):
        served_speculation(cfg, tmp_path)
    own_table(head, len(tok) + 64)  # what the worker writes now (pad_head_table)
    assert served_speculation(cfg, tmp_path).model == str(head)
    (head / "model.safetensors").unlink()
    LlamaConfig(vocab_size=len(tok) + 64).save_pretrained(ref)  # a padded LLM: the head may share its table
    assert served_speculation(cfg, tmp_path).model == str(head)
    (head / "speculator.json").unlink()
    with pytest.raises(SpeculatorError, match="speculator.json is missing"):  # checked first
        served_speculation(cfg, tmp_path)
    # the speech server always loads its frame-constraint logits processor, which vLLM refuses beside speculation
    with pytest.raises(ValueError, match="vllm.speculative: the speech LM is served without speculative decoding"):
        TTSConfig(backend="vllm", lm="llm", vllm=eagle)
    with pytest.raises(ValueError, match="vllm.speculative: the speech LM"):
        TTSConfig(backend="vllm", lm="llm", vllm=VLLMOptions(speculative=ngram))


def test_serve_refuses_an_eagle3_head_for_the_vlm_before_ray_starts(tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    ref, head = _head(tmp_path)
    (head / "speculator.json").unlink()
    prof = tmp_path / "p.yaml"
    import yaml

    from core.config import in_project

    data = yaml.safe_load(in_project("configs/cpu.yaml").read_text())
    data["vlm"]["engine"]["vllm"]["speculative"] = {"method": "eagle3", "model": str(head),
                                                    "num_speculative_tokens": 3}
    prof.write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(app, ["serve", "--profile", str(prof)])
    assert r.exit_code == 2, r.output
    assert "vlm.engine.vllm.speculative" in r.output and "speculator.json is missing" in r.output


def test_training_batch_alignment():
    """speculators' EAGLE-3 alignment (``shift_batch``): position j pairs token ids[j + 1] with the aux states of
    position j and the verifier's last state at j + 1; the loss covers the positions whose next token is an
    answer token; two sequences are packed as two documents."""
    from core.spec.worker import Sequence, batch_of

    ids = torch.tensor([5, 6, 7, 8, 9])  # prompt 5 6, answer 7 8 9
    aux = torch.arange(5.0).unsqueeze(1).repeat(1, 6)  # (T, 3 * H), H = 2: row t holds t
    last = 10 + torch.arange(5.0).unsqueeze(1).repeat(1, 2)
    s = Sequence(ids, aux, last, prompt_len=2)
    assert s.loss_mask().tolist() == [False, False, True, True, False]
    b = batch_of([s, Sequence(ids[:3], aux[:3], last[:3], prompt_len=2)])
    assert b["input_ids"].tolist() == [[6, 7, 8, 9, 6, 7]]
    assert b["hidden_states"][0, :, 0].tolist() == [0, 1, 2, 3, 0, 1]
    assert b["verifier_last_hidden_states"][0, :, 0].tolist() == [11, 12, 13, 14, 11, 12]
    assert b["loss_mask"].tolist() == [[False, True, True, False, False, False]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1]]
    assert b["position_ids"].tolist() == [[1, 2, 3, 4, 1, 2]]


def test_acceptance_table():
    from core.spec.report import acceptance_table

    record = {"num_speculative_tokens": 3, "sets": {"train": {"role": "train"}, "chat": {"role": "heldout"}},
              "acceptance": {"train": acceptance_summary(torch.tensor([3, 3]), 3),
                             "chat": acceptance_summary(torch.tensor([2, 3, 0]), 3)}}
    lines = acceptance_table(record).splitlines()
    assert lines[2] == "| chat | heldout | 3 | 2.667 | 0.556 | 0.667 | 0.667 | 0.333 |"
    assert lines[3].startswith("| train | train | 2 | 4.000 | 1.000 |")


def test_prompt_roles_and_builder_refusal(tmp_path):
    from core.quant.prompts import PromptSet, read_prompts, write_prompts
    from grafting.train.quant_prompts import vlm_prompt_sets

    sets = {"train": PromptSet("train", "ids", [torch.tensor([1, 2])]),
            "chat": PromptSet("heldout", "ids", [torch.tensor([3])])}
    got, _ = read_prompts(write_prompts(tmp_path / "p.safetensors", sets))
    assert got["train"].role == "train"
    with pytest.raises(ValueError, match="role 'fit'"):
        write_prompts(tmp_path / "q.safetensors", {"x": PromptSet("fit", "", [torch.tensor([1])])})
    with pytest.raises(ValueError, match="fit 'eval'"):
        vlm_prompt_sets(None, None, fit="eval")


def test_runner_without_the_environment(tmp_path, monkeypatch):
    from core.spec.runner import SpeculatorTrainError, train_head

    monkeypatch.setenv("CHIMERA_SPEC_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(SpeculatorTrainError, match="run `make install`"):
        train_head({"out": str(tmp_path)}, tmp_path / "spec.json")


def test_speculator_report_refuses_a_folder_without_its_record(tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    r = CliRunner().invoke(app, ["speculator", "report", str(tmp_path)])
    assert r.exit_code == 2 and "speculator.json is missing" in r.output
    r = CliRunner().invoke(app, ["speculator", "train", "--profile", str(tmp_path / "none.yaml")])
    assert r.exit_code == 2, r.output


def test_train_chat_prompts_hold_out_the_chat_set():
    """The chat training prompts: the 8 search prompts first, then the 499 templated ones not among them ("Write a
    short poem about rain." is both) in a fixed order; none is a held-out text prompt, all distinct; more than there
    are is refused."""
    from grafting.train.evaluate import TEXT_PROMPTS
    from grafting.train.quant_prompts import SEARCH_CHAT_PROMPTS, train_chat_prompts

    every = train_chat_prompts(507)
    assert every[:8] == SEARCH_CHAT_PROMPTS and len(set(every)) == 507
    assert not set(every) & set(TEXT_PROMPTS)
    assert train_chat_prompts(12) == every[:12] and train_chat_prompts(0) == []
    with pytest.raises(ValueError, match="508 chat training prompts: there are 507"):
        train_chat_prompts(508)


def test_speculator_train_refuses_unknown_kinds_and_an_empty_set():
    from typer.testing import CliRunner

    from services.cli import app

    r = CliRunner().invoke(app, ["speculator", "train", "--train-kinds", "images"])
    assert r.exit_code == 2 and "--train-kinds 'images': one of scene, chat, both" in r.output
    r = CliRunner().invoke(app, ["speculator", "train", "--train-kinds", "scene", "--train-scenes", "0"])
    assert r.exit_code == 2 and "the training set would be empty" in r.output


def test_bench_token_latencies_and_percentiles():
    """bench/speculator.py's inter-token latencies: a first chunk of 2 tokens at 1.0 s (TTFT, then 0 for the
    second), one token at 1.5 s (0.5), a chunk of 3 at 2.1 s (0.2 each; speculation's accepted tokens), an empty
    usage chunk ignored; the percentiles are bench/tts_concurrency.py's."""
    from bench.speculator import token_latencies
    from bench.tts_concurrency import pct

    itl = token_latencies([(1.0, 2), (1.5, 1), (1.6, 0), (2.1, 3)], 0.0)
    assert itl == pytest.approx([0.0, 0.5, 0.2, 0.2, 0.2])
    assert pct(itl, 0.5) == pytest.approx(0.2) and pct(itl, 0.95) == pytest.approx(0.44)


def test_head_layer_config_for_glm4_is_a_llama_layer_of_its_widths():
    """GLM-4-9B-0414's config (transformers' Glm4Config defaults are its sizes): speculators builds only Llama and
    Qwen3 EAGLE-3 layers, so the head gets a 1-layer LlamaConfig of GLM's widths with full rotary; a Llama verifier
    keeps its own config (1 layer), and neither argument is changed."""
    from transformers import Glm4Config, LlamaConfig

    from core.spec.worker import head_layer_config

    glm = Glm4Config()
    h = head_layer_config(glm)
    assert h.model_type == "llama" and glm.num_hidden_layers == 40
    assert (h.num_hidden_layers, h.hidden_size, h.intermediate_size, h.vocab_size) == (1, 4096, 13696, 151552)
    assert (h.num_attention_heads, h.num_key_value_heads, h.head_dim) == (32, 2, 128)
    assert h.rms_norm_eps == glm.rms_norm_eps and h.rope_parameters["rope_theta"] == 10000.0
    assert not getattr(h, "attention_bias", False)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=4)
    own = head_layer_config(llama)
    assert own.model_type == "llama" and own.num_hidden_layers == 1 and llama.num_hidden_layers == 4
    assert own.hidden_size == 64
