"""launch/ppo.py with rollout.engine=sglang served by tests/sglang_fake.py (never used by megarl itself).

Every generate of the fake appends the checksum of the weights it sampled from (null: values no one
chose) as one JSON line to ``$MEGARL_TEST_SGLANG_LOG.rank<RANK>``. With ``MEGARL_TEST_SGLANG_NO_EXPERTS`` set the fake starts
without ``enable_return_routed_experts`` whatever the adapter asks (SGLang without its expert capture).

Run it like the entry script: ``torchrun ... tests/sglang_fake_launch.py yaml/tiny.yaml key=value ...``.
"""
import functools
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _install() -> None:
    import megarl.rollout.sglang as sglang
    from sglang_fake import FakeEngine, FakeSerialized

    log = f"{os.environ['MEGARL_TEST_SGLANG_LOG']}.rank{os.environ.get('RANK', '0')}"

    class LoggingFake(FakeEngine):
        def __init__(self, **kwargs):
            if os.environ.get("MEGARL_TEST_SGLANG_NO_EXPERTS"):
                kwargs["enable_return_routed_experts"] = False
            super().__init__(**kwargs)

        def generate(self, **kwargs):
            outs = super().generate(**kwargs)
            with open(log, "a") as f:
                f.write(json.dumps({"weights": self.calls[-1][1]["weights"], "requests": len(outs)}) + "\n")
            return outs

    sglang.SGLangEngine = functools.partial(sglang.SGLangEngine, engine_factory=LoggingFake,
                                            tensor_wrapper=FakeSerialized)


if __name__ == "__main__":
    _install()
    sys.argv = [os.path.join(ROOT, "launch/ppo.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
