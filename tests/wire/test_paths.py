"""Checkpoint paths: the one spelling of the `tinker://` form, and `parse` reading it back."""

from __future__ import annotations

import pytest

from twinkle_wire import paths


def test_a_checkpoint_id_of_a_run_reads_back_as_the_same_checkpoint():
    path = paths.tinker_path("run-1", "sampler_weights/step-2")
    assert path == "tinker://run-1/sampler_weights/step-2"
    parsed = paths.parse(path)
    assert (parsed.run_id, parsed.kind, parsed.name) == ("run-1", "sampler", "step-2")
    assert parsed.tinker() == path
    assert paths.parse(parsed.twinkle()).tinker() == path


def test_parse_refuses_a_path_with_no_segment_and_says_the_forms():
    with pytest.raises(paths.PathError, match="<scheme><run_id>/weights/<name>"):
        paths.parse(paths.tinker_path("run-1", "step-2"))
