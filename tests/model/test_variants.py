"""The variant table: "H/14" decodes to paper Table 1's shape plus the patch size."""
from vitp.model.variants import decode_variant


def test_decode_variant():
    s = decode_variant("H/14")
    assert (s.depth, s.width, s.mlp_dim, s.heads, s.patch) == (32, 1280, 5120, 16, 14)
    assert decode_variant("B/8").patch == 8
