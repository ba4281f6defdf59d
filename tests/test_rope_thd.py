"""megarl.models.rope_thd.packed_rope equals megatron-core's per-sequence THD RoPE bitwise."""
import pytest
import torch

from megarl.models.rope_thd import _MEGATRON_THD, packed_rope, padded_rope


class OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("lengths", [[7], [3, 1, 5], [4, 4, 4, 4], [1, 9, 2]])
@pytest.mark.parametrize("per_token", [False, True])
def test_packed_rope_equals_megatron_bitwise(lengths, per_token):
    g = torch.Generator().manual_seed(sum(lengths))
    total, d = sum(lengths), 16
    t = torch.randn(total, 3, d, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    rows = total if per_token else 12  # per-token freqs (megatron's exact mapping) or positions 0..11
    freqs = torch.randn(rows, 1, 1, d, generator=g)
    want = _MEGATRON_THD(t, cu, freqs, cp_group=OneRank())
    assert torch.equal(packed_rope(t, cu, freqs, cp_group=OneRank()), want)
    assert not torch.equal(want, t)


def test_installed_by_the_model_builder():
    from megatron.core.models.common.embeddings import rope_utils

    import megarl.models.builder  # noqa: F401

    assert rope_utils._apply_rotary_pos_emb_thd is packed_rope
    assert rope_utils._apply_rotary_pos_emb_bshd is padded_rope


def test_positions_made_once_per_micro_batch():
    from megarl.models import rope_thd

    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    first = rope_thd._packed_positions(cu, 9, False, cu.device)
    assert first.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert rope_thd._packed_positions(cu, 9, False, cu.device) is first  # every layer of the micro-batch
    assert rope_thd._packed_positions(cu, 9, True, cu.device).tolist() == list(range(9))
    cu[1] = 2  # the same tensor changed in place: made again
    assert rope_thd._packed_positions(cu, 9, False, cu.device).tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 4]
    other = torch.tensor([0, 9], dtype=torch.int32)  # another micro-batch
    assert rope_thd._packed_positions(other, 9, False, other.device).tolist() == list(range(9))
    assert rope_thd._padded_positions(3, 2, cu.device).tolist() == [0, 0, 1, 1, 2, 2]
    assert rope_thd._padded_positions(3, 2, cu.device) is rope_thd._padded_positions(3, 2, cu.device)


def test_positions_of_inference_mode_stay_there():
    from megarl.models import rope_thd

    with torch.inference_mode():
        inside = rope_thd._padded_positions(4, 1, torch.device("cpu"))
    outside = rope_thd._padded_positions(4, 1, torch.device("cpu"))
    # the RoPE kernel saves positions for backward, which an inference tensor cannot be
    assert inside.is_inference() and not outside.is_inference()
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with torch.inference_mode():
        packed_inside = rope_thd._packed_positions(cu, 4, False, cu.device)
    assert packed_inside.is_inference() and not rope_thd._packed_positions(cu, 4, False, cu.device).is_inference()
