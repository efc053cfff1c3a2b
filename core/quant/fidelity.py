"""``fidelity.json``: what ``chimera quantize`` measured for a checkpoint, and the checks a server runs before it
serves one.

The file sits in the checkpoint folder beside ``config.json``. It records the scheme, the quantized units, the
held-out fidelity report (:func:`core.quant.kld.summarize` per held-out set) and the SHA-256 of the reference
weights it was made from (:func:`weights_sha256`), so a checkpoint made from other weights than the profile's LLM
is refused rather than served with a report that describes another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FIDELITY_FILE = "fidelity.json"
FORMAT_VERSION = 1


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint that must not be served: no or unreadable ``fidelity.json``, made from other weights,
    not a compressed-tensors checkpoint, or a scheme the host cannot run. The message names the fix."""


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 (hex) over the ``*.safetensors`` files of ``model_dir`` in name order (names and bytes). Raises
    FileNotFoundError when there are none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def write_record(path: str | Path, version: int, record: dict) -> Path:
    """Write ``record`` with ``format: version`` added as JSON at ``path`` (atomically: a temporary file, then a
    rename), the one writer of the measured records beside a checkpoint (``fidelity.json``; ``speculator.json``,
    :mod:`core.spec.record`); returns ``path``."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": version, **record}, indent=1) + "\n")
    tmp.replace(path)
    return path


def read_record(path: str | Path, version: int, error: type[ValueError], kind: str, made_by: str,
                remedy: str) -> dict:
    """The parsed record at ``path`` written by :func:`write_record`. Raises ``error`` when it is missing ("only
    {made_by} is served"), unreadable or not a ``kind`` record of format ``version``, each message ending in
    ``remedy``."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path} is missing: only {made_by} is served") from None
    except (OSError, ValueError) as e:
        raise error(f"{path} is unreadable ({e}): {remedy}") from None
    if not isinstance(record, dict) or record.get("format") != version:
        raise error(f"{path} is not a {kind} record of format {version}: {remedy}")
    return record


def check_made_from(want: str | None, reference_dir: str | Path, error: type[ValueError], made: str,
                    remedy: str) -> None:
    """Check that a record's reference hash ``want`` is :func:`weights_sha256` of ``reference_dir`` (the weights a
    quantized checkpoint or a draft head was made for). Raises ``error`` when ``reference_dir`` holds no weights,
    or "{made} {reference_dir} (sha256 ... vs ...): {remedy}" when the hashes differ."""
    try:
        have = weights_sha256(reference_dir)
    except FileNotFoundError as e:
        raise error(str(e)) from None
    if want != have:
        raise error(f"{made} {reference_dir} (sha256 {str(want)[:12]}... vs {have[:12]}...): {remedy}")


def read_config(model_dir: str | Path, error: type[ValueError]) -> dict:
    """The parsed ``config.json`` of ``model_dir``. Raises ``error`` when it is missing or unreadable."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise error(f"{model_dir}/config.json is unreadable ({e})") from None


def write_fidelity(checkpoint_dir: str | Path, record: dict) -> Path:
    """Write ``record`` (with ``format`` added) as ``<checkpoint_dir>/fidelity.json``; returns its path."""
    return write_record(Path(checkpoint_dir) / FIDELITY_FILE, FORMAT_VERSION, record)


def read_fidelity(checkpoint_dir: str | Path) -> dict:
    """The parsed ``fidelity.json`` of ``checkpoint_dir``. Raises QuantizedCheckpointError when it is missing,
    unreadable or of another format version."""
    return read_record(Path(checkpoint_dir) / FIDELITY_FILE, FORMAT_VERSION, QuantizedCheckpointError, "fidelity",
                       "a checkpoint written by `chimera quantize` (which measures its fidelity)",
                       "run `chimera quantize` again")


def verify_checkpoint(checkpoint_dir: str | Path, reference_dir: str | Path, device: str = "cpu") -> dict:
    """Check that ``checkpoint_dir`` may be served in place of ``reference_dir`` on ``device`` and return its
    fidelity record: ``fidelity.json`` present and readable, its reference hash equal to
    :func:`weights_sha256` of ``reference_dir``, ``config.json`` naming a compressed-tensors quantization, the
    scheme runnable on this host (:func:`core.quant.schemes.host_refusal`). Raises QuantizedCheckpointError
    naming the first failed check."""
    from .schemes import UnsupportedSchemeError, host_refusal

    record = read_fidelity(checkpoint_dir)
    want = record.get("reference", {}).get("sha256")
    check_made_from(want, reference_dir, QuantizedCheckpointError,
                    f"{checkpoint_dir} was made from other weights than",
                    "quantize this model again with `chimera quantize`")
    cfg = read_config(checkpoint_dir, QuantizedCheckpointError)
    if cfg.get("quantization_config", {}).get("quant_method") != "compressed-tensors":
        raise QuantizedCheckpointError(f"{checkpoint_dir}/config.json names no compressed-tensors quantization")
    try:
        reason = host_refusal(record.get("scheme", "?"), device)
    except UnsupportedSchemeError as e:
        reason = str(e)
    if reason:
        raise QuantizedCheckpointError(f"{checkpoint_dir} cannot be served here: {reason}")
    return record
