"""Parity: shoal's adapter against the model's reference library, on the fixed probes.

Before onboarding writes an entry, the model is run twice on `app.onboard.probes`: by the
library its authors publish it for (sentence-transformers, a transformers pipeline, plain
transformers where no library wraps the family), in float32 on the CPU, following the
entry's settings (pooling, normalisation, prompts, max_seq_length), and by shoal's own
adapter through a `ModelHost`, on the runtime and precision being considered. `compare`
turns the two into a few figures per family and holds them to `TOLERANCES`: tight in
fp32, where both compute the same thing and only summation order differs; looser in the
reduced precisions (bf16, fp16, int8), where the numbers themselves change.

The reference is computed once per entry settings and reused for every runtime and
precision (`check_parity(..., reference=...)`); it follows the entry, not blindly the
files, so a user's different pooling choice is checked against what that choice means
in sentence-transformers, and a wrong one shows as a failed figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from app.onboard.parity.common import (
    NEW_TOKENS,
    Outputs,
    ParityResult,
    Reference,
    ShoalRefused,
    settings_key,
)
from app.onboard.parity.figures import compare
from app.onboard.parity.ours import generation_items, shoal_outputs
from app.onboard.parity.references import reference_outputs
from app.onboard.parity.tolerances import TOLERANCES, precision_class, stated, tolerance_of
from tasks.engines import DEFAULT

if TYPE_CHECKING:
    from tasks.catalog import ModelEntry


__all__ = ["NEW_TOKENS", "TOLERANCES", "Outputs", "ParityResult", "Reference", "ShoalRefused",
           "check_parity", "compare", "generation_items", "precision_class",
           "reference_outputs", "settings_key", "shoal_outputs", "stated", "tolerance_of"]


def check_parity(entry: ModelEntry, folder: Path, engine: str = DEFAULT,
                 precision: str = "fp32",
                 reference: Reference | None = None) -> tuple[ParityResult, Reference]:
    """Shoal on `engine` at `precision` against the reference: the one given, else one
    computed now for the entry's settings. Given, it is used as is: onboarding holds an
    alternative choice (another pooling) to the reference of the files' own settings,
    the truth it must match. Returns the result and the reference."""
    if reference is None:
        reference = reference_outputs(entry, Path(folder))
    try:
        ours = shoal_outputs(entry, engine, precision)
    except ShoalRefused as exc:
        bounds = tolerance_of(entry.adapter, precision)
        return ParityResult({}, False, stated(bounds), str(exc), reference.library), reference
    return compare(entry, reference, ours, precision), reference
