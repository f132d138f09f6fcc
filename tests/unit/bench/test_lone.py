"""bench.lone's variants: each stack once per labelled environment, in one run."""

from __future__ import annotations

import pytest

from bench.lone import main, variants


def test_variants_are_the_plain_stack_then_each_labelled_environment():
    assert variants(["spin0:GOMP_SPINCOUNT=0", "emu:SHOAL_EMULATE_DEVICE=6.5,0;A=b"]) == {
        "": {}, "spin0": {"GOMP_SPINCOUNT": "0"},
        "emu": {"SHOAL_EMULATE_DEVICE": "6.5,0", "A": "b"}}
    assert variants([]) == {"": {}}


@pytest.mark.parametrize("spec", ["no-colon", "label:no-equals"])
def test_a_malformed_variant_is_refused(spec, capsys):
    with pytest.raises(SystemExit):
        main(["--variant", spec])
    assert "--variant takes" in capsys.readouterr().err
