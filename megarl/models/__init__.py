"""Models: HF config -> megatron-core GPTModel, HF safetensors <-> sharded weights.

- ``read_hf_config(dir) -> ModelInfo``: the supported architectures and their shape.
- ``build_gpt_model(info, groups, ModelOptions) -> GPTModel``: this stage's model.
- ``load_hf_checkpoint(model, dir, info, groups)``: each rank reads its own slices.
- ``export_hf(model, info, groups, out_dir)``: back to a HF directory.
- ``load_value_model``: a critic / reward model from *ForSequenceClassification or *ForCausalLM.
- ``run_pipeline`` / ``forward_logits``: micro-batches through megatron's schedule.
"""
from megarl.models.builder import ModelOptions, build_gpt_model, transformer_config
from megarl.models.exporter import export_hf
from megarl.models.hf_config import SUPPORTED, ModelConfigError, ModelInfo, read_hf_config
from megarl.models.loader import LoadReport, load_hf_checkpoint
from megarl.models.pipeline import forward_logits, run_pipeline
from megarl.models.value_head import ValueHead, init_value_head, load_value_model

__all__ = [
    "SUPPORTED", "LoadReport", "ModelConfigError", "ModelInfo", "ModelOptions", "ValueHead",
    "build_gpt_model", "export_hf", "forward_logits", "init_value_head", "load_hf_checkpoint",
    "load_value_model", "read_hf_config", "run_pipeline", "transformer_config",
]
