"""The out-of-memory report: the largest live tensors, each storage once; printed when a run dies of OOM."""
import pytest
import torch

from megarl.monitor.oom_report import live_tensors, oom_report


def test_largest_groups_first_views_counted_once():
    big = torch.zeros(512, 1024)  # 2 MiB
    view = big[:10]  # the same storage: not counted again
    weight = torch.nn.Parameter(torch.zeros(256, 1024))  # 1 MiB
    pair = [torch.zeros(64, 1024, dtype=torch.float16) for _ in range(2)]  # 2 x 128 KiB
    groups = live_tensors("cpu")
    assert groups[((512, 1024), "float32", False)] == (1, 2 * 2**20)
    assert groups[((256, 1024), "float32", True)] == (1, 2**20)
    assert groups[((64, 1024), "float16", False)] == (2, 2 * 2**17)
    lines = oom_report(top=200, device_type="cpu").splitlines()
    assert lines[0].startswith("live cpu tensors held by Python objects:")
    named = [line for line in lines[1:] if "[512, 1024] float32" in line or "[256, 1024] float32" in line]
    assert named[0].endswith("1 x tensor [512, 1024] float32") and named[1].endswith("1 x parameter [256, 1024] float32")
    del view, weight, pair


def test_main_guard_prints_it_when_the_run_runs_out_of_memory(capsys):
    from megarl.cli import main_guard

    def main(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.50 GiB.")

    with pytest.raises(torch.OutOfMemoryError):
        main_guard(main, [])
    err = capsys.readouterr().err
    assert "CUDA out of memory; live cuda tensors held by Python objects:" in err
