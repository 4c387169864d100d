"""The documentation generators: the API reference covers every public name, the ring picture is
well-formed SVG."""
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import ringflex


def test_api_reference_covers_the_public_api():
    from tools import gen_api_docs
    text = gen_api_docs.render()
    for name in ringflex.__all__:
        assert f"`{name}`" in text, name
    for name in ["ring_flex_attention(", "class `RingFlexAttention(", "class `RingFlexMode(", "class `PackedSequences(",
                 "varlen_attention(", "`shard(", "`unshard(", "class `CallRejected", "class `RingFailure",
                 "sharded_cross_entropy(", "reduce_gradients(", "shard_batch(", "position_ids(", "next_token_labels(",
                 "`causal(", "`sliding_window(", "`document(", "`alibi(", "`and_masks`", "`register(",
                 "ringflex_attention_forward(", "ringflex_mask("]:
        assert name in text, name


def test_api_reference_lists_no_internal_helper():
    """Only ringflex.__all__ and the public modules: not the helpers of the modules that define
    those names (ringflex.api's reject, ringflex.module's attention, the layout's segments)."""
    from tools import gen_api_docs
    text = gen_api_docs.render()
    for name in ["`reject(", "`attention(", "`current_mode(", "`segments(", "`permutation(", "`check_layout(",
                 "`warn_if_launched_alone(", "class `Progress(", "`versions(", "with_mask(", "## `ringflex.api`",
                 "## `ringflex.module`", "## `ringflex.parallel"]:
        assert name not in text, name


def test_api_reference_is_up_to_date():
    from tools import gen_api_docs
    assert (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text() == gen_api_docs.render(), \
        "docs/api.md is stale: run python -m tools.gen_api_docs"


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_picture_is_svg(world_size):
    from tools import draw_ring
    root = ET.fromstring(draw_ring.draw(world_size))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}circle")) == world_size
