"""Generated answers to everyday questions: greedy decoding, answer extraction and the one-word format check.

Multiple-choice scoring (:mod:`grafting.train.evaluate`) says which written answer the graft finds most likely; it
cannot see a graft that replies "Large." to "What colour is it? Answer with one word." This module looks at
what the graft *writes*: each question is answered by greedy decoding (temperature 0, at most
``max_new_tokens``), then
- the answer is read out of the text: the one option value (colour, shape, number word, yes/no, colour + shape,
  position, size word) that the text names; a text naming none or several is wrong;
- the format check: a question whose instruction asks for one word (style ``word``,
  :mod:`grafting.train.scenes`) is obeyed when the text is one word (letters only, trailing ``.``/``!`` allowed).
Rows are the ``test.jsonl`` rows of :func:`grafting.train.scenes.write_dataset` (``question_type``, ``style``,
``answer_word``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import torch

from ..generate import SamplingParams, generate_stream
from ..llm_stream import completion_request
from ..model import GraftedVLM
from ..processor import GraftProcessor
from .data import load_image, to_messages
from .scenes import values

DIGITS = {"1": "one", "2": "two", "3": "three"}


def one_word(text: str) -> bool:
    """True when ``text`` is a single word of letters (surrounding spaces and a final ``.``/``!`` allowed)."""
    return re.fullmatch(r"\s*[A-Za-z]+[.!]?\s*", text) is not None


def read_answer(text: str, qtype: str) -> str | None:
    """The option value of ``qtype`` that ``text`` names (lower case, as :func:`grafting.train.scenes.values`), or
    None when it names none or more than one. ``multi`` needs exactly one colour and one shape; plurals
    ("circles") and digits ("2") count."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    words = [DIGITS.get(w, w) for w in words]
    words = [w[:-1] if w.endswith("s") and w[:-1] in {"circle", "square", "triangle"} else w for w in words]
    joined = " " + " ".join(words) + " "
    if qtype == "multi":
        c = {v for v in values("colour") if f" {v} " in joined}
        s = {v for v in values("shape") if f" {v} " in joined}
        return f"{c.pop()} {s.pop()}" if len(c) == 1 and len(s) == 1 else None
    if qtype == "yesno":
        return words[0] if words and words[0] in ("yes", "no") else None
    found = [v for v in values(qtype) if f" {v} " in joined]
    return found[0] if len(found) == 1 else None


@torch.inference_mode()
def generate_answer(vlm: GraftedVLM, processor: GraftProcessor, messages: list[dict], max_new_tokens: int = 12) -> str:
    """Greedy completion text of ``messages`` (OpenAI-style, images as PIL parts), at most ``max_new_tokens``
    tokens, stopping at the chat template's end of turn."""
    tok = processor.tokenizer
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int) and i >= 0}
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    req = completion_request(vlm, processor(messages), params, eos)
    return "".join(c.text for c in generate_stream(vlm.llm, tok, req))


def evaluate_generated(vlm: GraftedVLM, processor: GraftProcessor, rows: list[dict], max_new_tokens: int = 12,
                       progress: bool = False) -> dict:
    """Greedy-generate the answer to each of ``rows`` (:func:`generate_answer`) and score the texts
    (:func:`score_generated`; same return value)."""
    it = rows
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(rows, desc="eval generated")
    texts = [generate_answer(vlm, processor, to_messages({"conversations": row["conversations"][:1]}, load_image(row)),
                             max_new_tokens) for row in it]
    return score_generated(rows, texts)


def score_generated(rows: list[dict], texts: list[str]) -> dict:
    """Generated-answer accuracy per question type and the one-word format check of ``texts``, the answers to
    ``rows`` in order (whoever generated them: this process or the served API).

    Returns ``{"accuracy": {qtype: acc}, "n": {qtype: n}, "correct": one bool per row in order (for paired
    comparisons, :func:`paired_difference`), "format_obeyed": acc over style-``word`` rows, "format_n",
    "format_failures": up to 10 ``(question, text)``, "samples": the first 10 ``(question, text, right
    answer)``, "confusion": ``{qtype: {right value: {value read (:func:`read_answer`, "none" when it names none or
    several): n}}}`` over every row, e.g. which counts are taken for which}``. Raises ValueError when ``rows`` and
    ``texts`` differ in length."""
    if len(rows) != len(texts):
        raise ValueError(f"{len(rows)} rows but {len(texts)} texts")
    hits, fmt, failures, samples, correct = defaultdict(list), [], [], [], []
    confusion: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for row, text in zip(rows, texts):
        q = row["conversations"][0]["value"].replace("<image>", "").strip()
        read = read_answer(text, row["question_type"])
        confusion[row["question_type"]][row["answer_word"]][read or "none"] += 1
        correct.append(read == row["answer_word"])
        hits[row["question_type"]].append(correct[-1])
        if row.get("style") == "word":
            fmt.append(one_word(text))
            if not fmt[-1] and len(failures) < 10:
                failures.append((q, text))
        if len(samples) < 10:
            samples.append((q, text, row["conversations"][1]["value"]))
    return {"accuracy": {k: sum(v) / len(v) for k, v in sorted(hits.items())},
            "n": {k: len(v) for k, v in sorted(hits.items())}, "correct": correct,
            "format_obeyed": sum(fmt) / len(fmt) if fmt else None, "format_n": len(fmt),
            "format_failures": failures, "samples": samples,
            "confusion": {t: {w: dict(sorted(c.items())) for w, c in sorted(by.items())}
                          for t, by in sorted(confusion.items())}}


def paired_difference(base: list[bool], other: list[bool]) -> dict:
    """Paired accuracy comparison of two models answering the same questions (``base[i]``, ``other[i]``: was
    question ``i`` answered right), McNemar-style: only the discordant questions carry the difference.

    Returns ``{"n", "acc_base", "acc_other" (fractions), "diff_points": 100 * (acc_other - acc_base),
    "se_points": its standard error (the paired-proportion estimate sqrt(b + c - (c - b)**2 / n) / n, in
    points), "base_only": b (right by base only), "other_only": c (right by other only), "p_mcnemar": the
    exact two-sided binomial p of b vs c (1.0 when b + c = 0)}``. Raises ValueError when the lists differ in
    length or are empty."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired lists of {len(base)} and {len(other)} answers: need equal, non-empty")
    n = len(base)
    b = sum(1 for x, y in zip(base, other) if x and not y)
    c = sum(1 for x, y in zip(base, other) if y and not x)
    k, m = min(b, c), b + c
    p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m) if m else 1.0
    return {"n": n, "acc_base": sum(base) / n, "acc_other": sum(other) / n, "diff_points": 100 * (c - b) / n,
            "se_points": 100 * math.sqrt(max(0.0, m - (c - b) ** 2 / n)) / n, "base_only": b, "other_only": c,
            "p_mcnemar": p}
