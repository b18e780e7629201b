"""gather_rows (the varlen layout's copy kernel) against its torch reference: on CUDA, or on CPU through Triton's
interpreter. A copy, so exact in every dtype; it runs inside chunk_kda_varlen's forward and backward, whose
tests (test_kda_varlen.py) cover it there with gradients."""
import pytest
import torch

from k3cli.ops.rows import gather_rows, gather_rows_reference

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape,dtype,out", [((7, 3, 5), torch.float32, None),        # odd features, gaps
                                             ((9, 2, 300), torch.float16, None),      # two feature blocks
                                             ((5, 4), torch.float32, torch.float16),  # a cast on the store
                                             ((1,), torch.float16, torch.float32)],   # one feature per row
                         ids=["odd", "wide", "cast", "scalar-rows"])
def test_gather_rows_matches_reference(shape, dtype, out):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(DEV, dtype)
    R = shape[0]
    # every row, some twice, and the zero row (index R) in between
    idx = torch.cat([torch.randperm(R, generator=gen), torch.tensor([R, 0, R, R - 1])]).to(DEV)
    for idx_dtype in (torch.int64, torch.int32):
        y = gather_rows(x, idx.to(idx_dtype), out)
        ref = gather_rows_reference(x, idx, out)
        assert y.dtype == ref.dtype and y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert (gather_rows(x, idx)[R] == 0).all()


def test_gather_rows_edges():
    x = torch.randn(4, 3, device=DEV)
    assert gather_rows(x, torch.empty(0, dtype=torch.long, device=DEV)).shape == (0, 3)
    assert (gather_rows(x.new_empty(0, 3), torch.zeros(2, dtype=torch.long, device=DEV)) == 0).all()   # all gaps
    torch.testing.assert_close(gather_rows(x.t(), torch.tensor([2, 0], device=DEV)), x.t()[[2, 0]])   # strided x
    with pytest.raises(ValueError, match="1-D int32/int64"):
        gather_rows(x, torch.tensor([0.0], device=DEV))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        gather_rows(x, torch.zeros(1, 1, dtype=torch.long, device=DEV))
