"""Models: HF config -> megatron-core GPTModel, HF safetensors <-> sharded weights.

- ``read_hf_config(dir) -> ModelInfo``: the supported architectures and their shape.
- ``build_gpt_model(info, groups, ModelOptions) -> GPTModel``: this stage's model.
- ``load_hf_checkpoint(model, dir, info, groups)``: each rank reads its own slices.
- ``export_hf(model, info, groups, out_dir)``: back to a HF directory.
- ``load_value_model``: a critic / reward model from *ForSequenceClassification or *ForCausalLM.
- ``run_pipeline`` / ``forward_logits``: micro-batches through megatron's schedule.

Names resolve lazily, so ``megarl.models.hf_config`` (plain JSON) imports
without megatron-core.
"""
import importlib

_EXPORTS = {
    "ModelOptions": "builder", "build_gpt_model": "builder", "transformer_config": "builder",
    "export_hf": "exporter",
    "SUPPORTED": "hf_config", "ModelConfigError": "hf_config", "ModelInfo": "hf_config",
    "read_hf_config": "hf_config",
    "LoadReport": "loader", "load_hf_checkpoint": "loader",
    "forward_logits": "pipeline", "run_pipeline": "pipeline",
    "ValueHead": "value_head", "init_value_head": "value_head", "load_value_model": "value_head",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megarl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megarl.models.{_EXPORTS[name]}"), name)
