"""The decode graphs' attention plans made on the host (`HostPlans`): what each replay copies in equals
the device plan kernel's spec for the padded lengths, at every bucket, in both staging sets."""
from types import SimpleNamespace

import numpy as np
import torch

from megarl.kernels.decode_plan import decode_plan_ref
from megarl.rollout.graphs import HostPlans, buckets_up_to


def _engine(hkv=2, d=64, page=16, max_len=700):
    cache = torch.empty(1, page, hkv, d, dtype=torch.bfloat16)
    return SimpleNamespace(cache=SimpleNamespace(keys=lambda i: cache), max_len=max_len, device=torch.device("cpu"))


def test_staged_plans_equal_the_spec():
    buckets = buckets_up_to(48)
    plans = HostPlans(_engine(), buckets, pin=False)
    g = torch.Generator().manual_seed(0)
    for turn, b in enumerate(buckets):
        n = max(1, b - 3)
        lens = np.zeros(b, dtype=np.int64)  # rows past the real batch: no keys, as the graphs pad them
        lens[:n] = torch.randint(0, 700, (n,), generator=g).numpy()
        dst, src = plans.staged(turn % 2, lens, b)
        dst.copy_(src)
        got = plans.plan(b)
        launch = plans.launch(b)
        want = decode_plan_ref(torch.from_numpy(lens), launch.block_n, launch.target, launch.segments)
        assert got.launch == launch
        assert torch.equal(got.rows, want[0]) and torch.equal(got.segments, want[1])


def test_empty_plan_for_a_capture():
    plans = HostPlans(_engine(), buckets_up_to(8), pin=False)
    plans.load_empty(8)
    want = decode_plan_ref(torch.zeros(8, dtype=torch.int64), plans.launch(8).block_n, plans.launch(8).target,
                           plans.launch(8).segments)
    assert torch.equal(plans.plan(8).rows, want[0]) and torch.equal(plans.plan(8).segments, want[1])
