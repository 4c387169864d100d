"""The documentation generators: the API reference covers every public name, the ring picture is
well-formed SVG."""
import xml.etree.ElementTree as ET

import pytest

import ringflex


def test_api_reference_covers_the_public_api():
    from tools import gen_api_docs
    text = gen_api_docs.render()
    for name in ringflex.__all__:
        assert f"`{name}`" in text, name
    for name in ["ring_flex_attention(", "class `RingFlexAttention(", "class `PackedSequences(", "varlen_attention(",
                 "sharded_cross_entropy(", "reduce_gradients(", "ringflex_attention_forward(", "class `Progress("]:
        assert name in text, name


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_picture_is_svg(world_size):
    from tools import draw_ring
    root = ET.fromstring(draw_ring.draw(world_size))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}circle")) == world_size
